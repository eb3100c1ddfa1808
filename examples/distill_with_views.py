"""Distil a student with data augmentation from a store of K augmented views of a teacher.

    python examples/distill_with_views.py [STORE_DIR]

The teacher's logits are computed once for K = 8 augmented views of every sample; each training
epoch reads one view (every view once per 8 epochs), and the reader rebuilds, in its DataLoader
workers, the exact augmented pixels the teacher saw, so teacher and student stay consistent
without running the teacher. Data: scikit-learn's handwritten digits (``pip install
scikit-learn``), upsampled to 16x16; the teacher here is a randomly initialised CNN, so the
script runs in seconds: put your trained teacher in its place.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn import functional as F

import featstore


class Digits(torch.utils.data.Dataset):
    """Items ``{"image": float32[1, 16, 16], "target": int64}``."""

    def __init__(self) -> None:
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
        self.images = F.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False)
        self.targets = torch.tensor(d.target)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[i], "target": self.targets[i]}


def augment(item: dict, gen: torch.Generator) -> dict:
    """Shift by up to 2 pixels and flip half the time. Every random number comes from ``gen``:
    that is what makes a view replayable (featstore checks it at compute time)."""
    dy, dx = (int(v) for v in torch.randint(0, 5, (2,), generator=gen))
    x = F.pad(item["image"], (2, 2, 2, 2))[:, dy:dy + 16, dx:dx + 16]
    flip = bool(torch.rand((), generator=gen) < 0.5)
    # "flip" is returned as an extra field: `keep=["flip"]` stores it per view.
    return {"image": x.flip(-1) if flip else x, "target": item["target"], "flip": torch.tensor(flip)}


def main(root: str = "./example-views-store") -> None:
    store = featstore.open_store(root)
    data = Digits()
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                            nn.Flatten(), nn.Linear(64, 10))

    # 1. K = 8 augmented views per sample, the teacher run once on each (Dask, dashboard printed).
    version = store.compute("example/digits-teacher", model=teacher, dataset=data, input_key="image",
                            keep=["target", "flip"], outputs={"logits": "float32"},
                            views=featstore.Views(k=8, augment=augment, seed=0))
    print(f"stored {version}: {version.views} views per sample")
    # Any view replays exactly: the input the teacher saw for sample 10, view 3.
    seen = augment(data[10], torch.Generator().manual_seed(version.view_seed(10, 3)))
    assert bool(seen["flip"]) == bool(version[3, 10]["flip"])

    # 2. The student: one view per epoch, its own augmented input joined beside the logits.
    ds = store.dataset(version, batch_size=128, seed=0, source=data, augment=augment, source_fields=["image"])
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    student = nn.Sequential(nn.Flatten(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.Adam(student.parameters(), lr=3e-3)
    tau = 4.0
    for epoch in range(8):
        ds.set_epoch(epoch)
        total, seen_rows, views = 0.0, 0, set()
        for batch in loader:  # {"image", "logits", "target", "flip", "index", "view"}
            s = student(batch["image"])
            loss = F.kl_div(F.log_softmax(s / tau, 1), F.log_softmax(batch["logits"] / tau, 1),
                            log_target=True, reduction="batchmean") * tau * tau
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(s)
            seen_rows += len(s)
            views |= set(batch["view"].tolist())
        print(f"epoch {epoch}: view {sorted(views)}, {seen_rows} samples, KD loss {total / seen_rows:.4f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
