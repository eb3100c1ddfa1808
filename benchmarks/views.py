"""Distillation with augmentation: the teacher run online every step vs featstore's views.

``python -m benchmarks.views`` (a few minutes on 2 cores; ``--epochs``, ``--views`` to change
the grid). Real data no one here wrote: scikit-learn's bundled handwritten digits (1,797 8x8
scans), upsampled to 16x16 and augmented with random crops (resized back by nearest pixel),
shifts and horizontal flips, all drawn from the generator featstore passes in. A teacher CNN is
trained here on augmented views; then one student architecture is distilled (KL on the
teacher's temperature-scaled logits, same optimiser, same epochs, same batch order) from:

- (a) online: the teacher run on the same augmented batch every step;
- (b) a featstore version of 1 un-augmented view (what featstore stored before views) while
  the student sees augmented inputs (joined by the reader with ``source=``/``augment=``);
- (c) featstore versions of K augmented views (``views=K``), the reader picking one view per
  epoch and joining the exact pixels the teacher saw.

Reported per row: held-out accuracy (un-augmented test split), teacher-student top-1
agreement on it, wall time (featstore's compute, incl. its embedded Dask start-up, plus
training), and stored bytes per sample. Torch runs on one thread everywhere (so the machine's
other load disturbs every row alike). Results go to the marked section of
``docs/benchmarks.md``, and as JSON to ``docs/benchmarks-views.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: Dask's executor threads inherit it

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterable, Iterator  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import featstore  # noqa: E402
from featstore.versions import epoch_seeds, replay  # noqa: E402
from featstore.versions import stored

from .sections import write_marked

SIZE, PAD, MIN_CROP = 16, 2, 11
TAU = 4.0
MARK_START, MARK_END = "<!-- views-benchmark:start -->", "<!-- views-benchmark:end -->"


@dataclass(frozen=True)
class Setup:
    """The benchmark's knobs (defaults: a few minutes on 2 shared cores)."""

    epochs: int = 24
    views: tuple[int, ...] = (4, 8, 16)
    teacher_epochs: int = 8
    teacher_width: int = 24
    batch: int = 64
    test: int = 497
    seed: int = 0


# -- data: real digits, augmented from the generator ------------------------------------------
class Digits(torch.utils.data.Dataset):
    """scikit-learn's digits, upsampled to 16x16: items ``{"image": [1,16,16], "target": int}``."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor) -> None:
        self.images, self.targets = images, targets

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[i], "target": self.targets[i]}


def load_digits(setup: Setup) -> tuple[Digits, Digits]:
    """A fixed train/test split of the 1,797 digits (test: ``setup.test`` images)."""
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(SIZE, SIZE), mode="bilinear", align_corners=False).contiguous()
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(setup.seed))
    test, train = perm[:setup.test], perm[setup.test:]
    return Digits(x[train].clone(), y[train].clone()), Digits(x[test].clone(), y[test].clone())


def _draw(gen: torch.Generator, low: int, high: int) -> int:
    return int(torch.randint(low, high + 1, (), generator=gen))


def augment(item: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random crop (side 11-16, resized back by nearest pixel), shift by up to 2 pixels,
    horizontal flip with p=0.5: integer indexing only, so a replay is bit-identical anywhere."""
    x = item["image"]
    side = _draw(gen, MIN_CROP, SIZE)
    top, left = _draw(gen, 0, SIZE - side), _draw(gen, 0, SIZE - side)
    pick = (torch.arange(SIZE) * side) // SIZE
    x = x[:, top + pick][:, :, left + pick]
    dy, dx = _draw(gen, 0, 2 * PAD), _draw(gen, 0, 2 * PAD)
    x = F.pad(x, (PAD, PAD, PAD, PAD))[:, dy:dy + SIZE, dx:dx + SIZE]
    if bool(torch.rand((), generator=gen) < 0.5):
        x = x.flip(-1)
    return {"image": x.contiguous(), "target": item["target"]}


# -- models -----------------------------------------------------------------------------------
def teacher_net(width: int) -> nn.Module:
    """A VGG-style CNN (~4 MFLOP/sample at width 24)."""
    c = width
    return nn.Sequential(
        nn.Conv2d(1, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
        nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(),
        nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * c, 4 * c, 3, padding=1), nn.BatchNorm2d(4 * c), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * c, 10))


def student_net() -> nn.Module:
    """A small CNN (~0.1 MFLOP/sample)."""
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(16 * 4 * 4, 10))


def augmented_rows(data: Digits, idx: torch.Tensor, seeds: np.ndarray) -> dict[str, torch.Tensor]:
    items = [replay(augment, data[int(i)], int(s)) for i, s in zip(idx, seeds, strict=True)]
    return {"image": torch.stack([it["image"] for it in items]), "target": data.targets[idx]}


def order(n: int, setup: Setup, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(1000 * setup.seed + epoch))


def train_teacher(train: Digits, setup: Setup) -> tuple[nn.Module, float]:
    """Cross-entropy on augmented views (fresh each epoch), one-cycle AdamW."""
    torch.manual_seed(setup.seed)
    net = teacher_net(setup.teacher_width)
    steps = setup.teacher_epochs * -(-len(train) // setup.batch)
    opt = torch.optim.AdamW(net.parameters(), 2e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 4e-3, total_steps=steps)
    t0 = time.perf_counter()
    for epoch in range(setup.teacher_epochs):
        perm = order(len(train), setup, 10_000 + epoch)
        for k in range(0, len(train), setup.batch):
            idx = perm[k:k + setup.batch]
            rows = augmented_rows(train, idx, epoch_seeds(setup.seed + 1, epoch, idx.numpy()))
            loss = F.cross_entropy(net(rows["image"]), rows["target"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return net.eval().requires_grad_(False), time.perf_counter() - t0


# -- distillation: one loop, three sources of (input, teacher logits) batches -------------------
Batches = Callable[[int], Iterable[tuple[torch.Tensor, torch.Tensor]]]


def distill(batches: Batches, n: int, setup: Setup) -> tuple[nn.Module, float]:
    """Train a student for ``setup.epochs`` epochs on ``batches(epoch)``; return it and the seconds."""
    torch.manual_seed(setup.seed + 1)
    net = student_net()
    opt = torch.optim.AdamW(net.parameters(), 3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 6e-3, total_steps=setup.epochs * -(-n // setup.batch))
    t0 = time.perf_counter()
    for epoch in range(setup.epochs):
        for x, teacher_logits in batches(epoch):
            s = net(x)
            loss = F.kl_div(F.log_softmax(s / TAU, 1), F.log_softmax(teacher_logits.float() / TAU, 1),
                            log_target=True, reduction="batchmean") * TAU * TAU
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return net.eval(), time.perf_counter() - t0


def online(teacher: nn.Module, train: Digits, setup: Setup) -> Batches:
    """(a) The teacher on the same augmented batch, every step."""
    def epoch_batches(epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        perm = order(len(train), setup, epoch)
        for k in range(0, len(train), setup.batch):
            idx = perm[k:k + setup.batch]
            x = augmented_rows(train, idx, epoch_seeds(setup.seed, epoch, idx.numpy()))["image"]
            with torch.no_grad():  # not around the yield: grad mode is per thread, not per generator
                logits = teacher(x)
            yield x, logits
    return epoch_batches


def from_store(ds: featstore.FeatureDataset) -> Batches:
    """(b)/(c) featstore's reader: stored logits, and the student's input joined by the reader."""
    def epoch_batches(epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        ds.set_epoch(epoch)
        for batch in ds:
            yield batch["image"], batch["logits"]
    return epoch_batches


def evaluate(student: nn.Module, teacher: nn.Module, test: Digits) -> tuple[float, float, list[int]]:
    """Held-out accuracy, top-1 agreement with the teacher, and which test images were right."""
    with torch.no_grad():
        s, t = student(test.images).argmax(1), teacher(test.images).argmax(1)
    right = (s == test.targets).to(torch.int64)
    return float(right.float().mean()), float((s == t).float().mean()), right.tolist()


def stored_bytes(version: featstore.Version) -> int:
    fs, root = stored(version).storage.fs, version.url
    return int(sum(fs.du(root, total=False).values())) if hasattr(fs, "du") else 0


# -- rows -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    approach: str
    views: int | None
    compute_s: float
    train_s: float
    accuracy: float
    agreement: float
    bytes_per_sample: float
    right: list[int]  # per held-out image: 1 if the student got it right (for paired comparisons)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.train_s


def store_row(label: str, store: featstore.FeatureStore, teacher: nn.Module, train: Digits, test: Digits,
              setup: Setup, views: int | None, keep_input: bool = False) -> Row:
    """One featstore row: compute the teacher's logits (per view), then distill from the store.
    ``keep_input``: the augmented input is stored with each view (``keep=["image"]``) and read
    back, instead of replaying ``augment`` in the reader every epoch (bytes for CPU)."""
    t0 = time.perf_counter()
    kw = {} if views is None else {"views": featstore.Views(k=views, augment=augment, seed=setup.seed)}
    version = store.compute(f"digits/teacher-{views or 'clean'}{'-input' if keep_input else ''}", model=teacher,
                            dataset=train, input_key="image", keep=["image"] if keep_input else (),
                            outputs={"logits": "float32"}, batch_size=256,
                            options=featstore.ComputeOptions(progress=False), **kw)
    compute_s = time.perf_counter() - t0
    join = {} if keep_input else {"source": train, "augment": augment, "source_fields": ["image"]}
    ds = store.dataset(version, batch_size=setup.batch, seed=setup.seed, **join)
    student, train_s = distill(from_store(ds), len(train), setup)
    acc, agree, right = evaluate(student, teacher, test)
    return Row(label, views, compute_s, train_s, acc, agree, stored_bytes(version) / len(train), right)


def run(setup: Setup) -> dict:
    import distributed  # noqa: F401 - a one-time import per process, not part of any compute

    started = time.strftime("%Y-%m-%d %H:%M:%S")
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    train, test = load_digits(setup)
    teacher, teacher_s = train_teacher(train, setup)
    teacher_acc = float((teacher(test.images).argmax(1) == test.targets).float().mean())
    print(f"teacher: {teacher_s:.1f} s, held-out accuracy {teacher_acc:.4f}", flush=True)
    rows = []
    student, train_s = distill(online(teacher, train, setup), len(train), setup)
    acc, agree, right = evaluate(student, teacher, test)
    rows.append(Row("(a) online: teacher every step", None, 0.0, train_s, acc, agree, 0.0, right))
    print(rows[-1].approach, rows[-1].total_s, rows[-1].accuracy, flush=True)
    with tempfile.TemporaryDirectory(prefix="featstore-views-") as root:
        store = featstore.open_store(os.path.join(root, "store"))
        rows.append(store_row("(b) featstore, 1 un-augmented view", store, teacher, train, test, setup, None))
        print(rows[-1].approach, rows[-1].total_s, rows[-1].accuracy, flush=True)
        for k in setup.views:
            rows.append(store_row(f"(c) featstore, K={k} views", store, teacher, train, test, setup, k))
            print(rows[-1].approach, rows[-1].total_s, rows[-1].accuracy, flush=True)
        k = setup.views[0]
        rows.append(store_row(f"(c) featstore, K={k} views, augmented input stored", store, teacher, train, test,
                              setup, k, keep_input=True))
        print(rows[-1].approach, rows[-1].total_s, rows[-1].accuracy, flush=True)
    return {"setup": asdict(setup), "teacher_s": teacher_s, "teacher_accuracy": teacher_acc,
            "n_train": len(train), "n_test": len(test), "rows": [asdict(r) | {"total_s": r.total_s} for r in rows],
            "started": started, "minutes": (time.perf_counter() - t0) / 60, "load_average": os.getloadavg()}


# -- report -----------------------------------------------------------------------------------
def paired_delta(row: dict, base: dict) -> tuple[float, float]:
    """Accuracy difference to ``base`` in points, and 1.96 standard errors of it, paired over the
    same held-out images (only images one got right and the other wrong move the difference)."""
    diff = [a - b for a, b in zip(row["right"], base["right"], strict=True)]
    n = len(diff)
    mean = sum(diff) / n
    var = sum((d - mean) ** 2 for d in diff) / max(1, n - 1)
    return 100 * mean, 100 * 1.96 * (var / n) ** 0.5


def verdict(result: dict) -> list[str]:
    """The issue's targets, checked on this run's rows."""
    rows = result["rows"]
    a = rows[0]
    b = next(r for r in rows if r["views"] is None and r is not a)
    views = [r for r in rows if r["views"] is not None]
    close = [r for r in views if r["accuracy"] >= a["accuracy"] - 0.01]
    lines = [f"- (b) 1 un-augmented view: {paired_delta(b, a)[0]:+.1f} ± {paired_delta(b, a)[1]:.1f} points of "
             f"accuracy and {100 * (b['agreement'] - a['agreement']):+.1f} points of agreement vs (a)."]
    if close:
        best = max(close, key=lambda r: a["total_s"] / r["total_s"])
        speed = a["total_s"] / best["total_s"]
        met = "met" if speed >= 2 else "missed"
        delta, err = paired_delta(best, a)
        lines.append(f"- Best K within 1 point of (a): K={best['views']} ({delta:+.1f} ± {err:.1f} points), "
                     f"{speed:.2f}x less wall time than (a): target (>= 2x) **{met}**.")
    else:
        lines.append("- No K came within 1 point of (a)'s accuracy in this run: target **missed**.")
    return lines


def markdown(result: dict) -> str:
    s = result["setup"]
    head = [
        MARK_START,
        "## Distillation with augmentation: views vs the teacher online (issue 9)",
        "",
        f"Generated by `python -m benchmarks.views` (started {result['started']}, {result['minutes']:.1f} min, "
        f"load average {result['load_average'][0]:.1f} at the end, on 2 cores shared with other jobs; torch on "
        "one thread). "
        f"scikit-learn's handwritten digits ({result['n_train']} train / {result['n_test']} held-out "
        f"images, upsampled to 16x16), augmented with random crops, shifts and flips. Teacher: a CNN "
        f"of width {s['teacher_width']} trained here for {s['teacher_epochs']} epochs "
        f"({result['teacher_s']:.0f} s, held-out accuracy {result['teacher_accuracy']:.3f}). Student: a "
        f"small CNN distilled for {s['epochs']} epochs (KL at T={TAU:g}, batch {s['batch']}), the same "
        "loop in every row; featstore rows read with 0 DataLoader workers and join the student's "
        "augmented input in the reader (`source=`, `augment=`), except the last row, which stores each "
        "view's augmented input with it at compute time (`keep=[\"image\"]`, per view) and reads it back: "
        "`augment` then runs K times per sample once, instead of once per sample every epoch.",
        "",
        "| approach | compute s | training s | total s | (a)'s time / this | held-out acc | acc vs (a), points "
        "| agreement | stored bytes/sample |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    a = result["rows"][0]
    body = [f"| {r['approach']} | {r['compute_s']:.1f} | {r['train_s']:.1f} | {r['total_s']:.1f} | "
            f"{a['total_s'] / r['total_s']:.2f}x | {r['accuracy']:.3f} | "
            + ("" if r is a else "{:+.1f} ± {:.1f}".format(*paired_delta(r, a)))
            + f" | {r['agreement']:.3f} | {r['bytes_per_sample']:.0f} |" for r in result["rows"]]
    notes = ["", *verdict(result), "",
             "One seed per row: ± is 1.96 standard errors of the accuracy difference, paired over the "
             "same held-out images (the student's own seed-to-seed spread is not in it). "
             "Compute includes featstore's embedded Dask start-up and the replay check; K views cost K "
             "teacher forwards per sample once, where (a) pays one per sample every epoch. Bytes per "
             "sample are the whole version (all K views, float32 logits, labels, seeds, metadata); an "
             "epoch reads one view.", MARK_END]
    return "\n".join(head + body + notes) + "\n"


def write_section(path: str, text: str) -> None:
    """This benchmark's section of ``path`` replaced (or appended), the rest left alone."""
    write_marked(path, MARK_START, MARK_END, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=Setup.epochs)
    p.add_argument("--teacher-epochs", type=int, default=Setup.teacher_epochs)
    p.add_argument("--views", type=int, nargs="+", default=list(Setup.views))
    p.add_argument("--out", default="docs", help="folder of benchmarks.md (the section is replaced)")
    args = p.parse_args(argv)
    result = run(Setup(epochs=args.epochs, teacher_epochs=args.teacher_epochs, views=tuple(args.views)))
    section = markdown(result)
    print(section)
    write_section(os.path.join(args.out, "benchmarks.md"), section)
    with open(os.path.join(args.out, "benchmarks-views.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
