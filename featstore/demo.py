"""The pieces of ``featstore demo``: a small frozen CNN (Model A), a synthetic image dataset and
an MLP (Model B). Importable, so tests, examples and benchmarks use the same workload."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import Dataset

if TYPE_CHECKING:
    from distributed import Client
    from distributed.deploy import Cluster as DaskCluster


class SyntheticImages(Dataset[dict[str, torch.Tensor]]):
    """Deterministic random images with a label that depends on them (so B can learn).

    Items are ``{"input": float32 [3, S, S], "target": int64}``; item ``i`` is the same in
    every process, computed from ``seed`` and ``i`` alone.
    """

    def __init__(self, n: int, size: int = 32, classes: int = 10, seed: int = 0) -> None:
        self.n, self.size, self.classes, self.seed = n, size, classes, seed
        g = torch.Generator().manual_seed(seed)
        self.prototypes = torch.randn(classes, 3, size, size, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        target = int(torch.randint(self.classes, (1,), generator=g))
        x = self.prototypes[target] + 1.5 * torch.randn(3, self.size, self.size, generator=g)
        return {"input": x, "target": torch.tensor(target)}

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        return [self[i] for i in indices]


class ModelA(nn.Module):
    """A small frozen CNN: a conv backbone giving ``features``, a linear head giving ``logits``."""

    def __init__(self, width: int = 32, features: int = 128, classes: int = 1000, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.backbone = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1, stride=2), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(8 * width, features), nn.ReLU(),
        )
        self.head = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        f = self.backbone(x)
        return {"features": f, "logits": self.head(f)}


def model_b(features: int = 128, classes: int = 10, hidden: int = 256) -> nn.Module:
    """Model B: an MLP probe on A's features."""
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def _train_epochs(net: nn.Module, batches: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]], epochs: int,
                  set_epoch: Callable[[int], None] | None = None) -> float:
    """Train ``net`` on ``batches()`` for some epochs; return the last epoch's accuracy."""
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    correct = total = 0
    for epoch in range(epochs):
        if set_epoch is not None:
            set_epoch(epoch)
        correct = total = 0
        for x, y in batches():
            logits = net(x)
            loss = loss_fn(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            correct += int((logits.argmax(1) == y).sum())
            total += len(y)
    return correct / max(total, 1)


def run_demo(root: str = "./featstore-demo", n: int = 20000, epochs: int = 3, batch_size: int = 256,
             workers: int = 0, client: Client | DaskCluster | str | None = None,
             storage_options: dict[str, object] | None = None) -> dict[str, float | None]:
    """Compute Model A's outputs into ``root`` with Dask, train Model B from the store, then
    train the same B with A run every step (the frozen-submodule approach); print both times.

    Run again on the same store, the compute is skipped (the version is there): the table then
    shows the compute time the version's manifest recorded when it was computed, and says so."""
    import datetime
    import time

    import featstore

    torch.manual_seed(0)
    data = SyntheticImages(n)
    store = featstore.open_store(root, storage_options=storage_options)
    print(f"featstore demo: N={n} images 3x32x32, Model A = small CNN, store = {store.url}")
    started = datetime.datetime.now(datetime.UTC)
    t0 = time.perf_counter()
    version = store.compute("demo/cnn-a", model=ModelA(), dataset=data, keep=["target"],
                            outputs={"features": "float16", "logits": "float32"},
                            batch_size=batch_size, client=client)
    t_compute: float | None = time.perf_counter() - t0  # None: skipped, and no time recorded
    m = version.manifest
    print(f"version {version.name}@{version.id}: {len(version)} samples, {m.layout.n_shards} shards; "
          f"features max |fp16 error| {m.stats['features'].get('max_abs_error', 0):.2e}")
    skipped = datetime.datetime.fromisoformat(m.created_at) < started
    recorded = m.timings.get("total_s")
    if skipped:
        found = "" if version.report is None else f"{version.report.describe()}; "
        print(f"compute skipped: the version was already in the store ({found}found in {t_compute:.1f} s); "
              + (f"its compute took {recorded:.1f} s when it ran (recorded in its manifest)" if recorded is not None
                 else "its manifest records no compute time")
              + f". For a fresh measurement, run with another --root than {store.url}.")
        t_compute = recorded

    ds = store.dataset(f"demo/cnn-a@{version.id}", batch_size=batch_size, shuffle=True, seed=0,
                       fields=("features", "target"))
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
    torch.manual_seed(1)
    net = model_b()
    t0 = time.perf_counter()
    acc_store = _train_epochs(net, lambda: ((b["features"].float(), b["target"]) for b in loader),
                              epochs, ds.set_epoch)
    t_train = time.perf_counter() - t0

    frozen = ModelA().eval().requires_grad_(False)
    inputs = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True, num_workers=workers)
    torch.manual_seed(1)
    net = model_b()

    def online() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for b in inputs:
            with torch.inference_mode():
                f = frozen(b["input"])["features"].half().float()
            yield f.clone(), b["target"]

    t0 = time.perf_counter()
    acc_online = _train_epochs(net, online, epochs)
    t_online = time.perf_counter() - t0
    print()
    print(f"{'approach':<42}{'time (s)':>10}{'B accuracy':>12}")
    if t_compute is None:  # skipped, and its manifest recorded no time: no end-to-end figure
        total, end_to_end = None, "not measured end to end (the compute was skipped)"
        print(f"{'featstore: ' + str(epochs) + ' epochs of B from the store':<42}{t_train:>10.1f}{acc_store:>12.3f}")
    else:
        total = t_compute + t_train
        end_to_end = f"{t_online / total:.2f}x end to end" + (" (with the recorded compute time)" if skipped else "")
        which = "recorded when it ran" if skipped else "Dask, incl. start-up"
        print(f"{'featstore: compute A once + ' + str(epochs) + ' epochs of B':<42}{total:>10.1f}{acc_store:>12.3f}")
        print(f"{'  of which compute (' + which + ')':<42}{t_compute:>10.1f}")
        print(f"{'  of which training B from the store':<42}{t_train:>10.1f}")
    print(f"{'frozen submodule: A every step, ' + str(epochs) + ' epochs':<42}{t_online:>10.1f}{acc_online:>12.3f}")
    print(f"speed-up: {end_to_end}, {t_online / t_train:.2f}x per {epochs} epochs once computed")
    return {"compute_s": t_compute, "train_s": t_train, "online_s": t_online,
            "acc_store": acc_store, "acc_online": acc_online, "compute_skipped": skipped}
