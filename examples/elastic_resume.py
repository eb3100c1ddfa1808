"""Resume an epoch on another number of ranks and workers, and read a weighted mixture.

A 2-rank job (ranks simulated in one process with rank=/world_size=) reads 5 steps of an epoch and
saves rank 0's state; a 3-rank job resumes it with DataLoader workers: every sample of the epoch
once. Then a 0.7/0.3 mixture of two versions, resumed on 1 rank after 5 steps on 2.

    python examples/elastic_resume.py
"""

from __future__ import annotations

import tempfile
from collections import Counter

import torch
from torch import nn
from torch.utils.data import DataLoader

import featstore


class Vectors(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        self.x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input": self.x[i]}


def write(store: featstore.FeatureStore, name: str, n: int, seed: int) -> featstore.Version:
    return store.compute(name, model=nn.Linear(16, 8), dataset=Vectors(n, seed), outputs={"features": "float16"},
                         samples_per_shard=64, client="in-process", options=featstore.ComputeOptions(progress=False))


def job(make, world: int, workers: int, steps: int | None = None, state: dict | None = None):
    """Each rank's rows (``steps`` batches each, or to the epoch's end) and rank 0's state after them."""
    rows, saved = [], None
    for rank in range(world):
        ds = make(world, rank)
        if state is not None:
            ds.load_state_dict(state)
        for i, batch in enumerate(DataLoader(ds, batch_size=None, num_workers=workers)):
            if steps is not None and i == steps:
                break
            source = batch.get("source", torch.zeros_like(batch["index"]))
            rows += list(zip(source.tolist(), batch["index"].tolist(), strict=True))
        if rank == 0 and steps is not None:
            saved = ds.state_dict(batches_seen=steps, num_workers=workers)
    return rows, saved


def main() -> None:
    store = featstore.open_store(tempfile.mkdtemp())
    a, b = write(store, "web", 600, 1), write(store, "code", 300, 2)

    def plain(world: int, rank: int):  # global batch 24 on any world size that divides it
        return a.dataset(batch_size=24 // world, seed=0, partition="even", rank=rank, world_size=world)

    before, state = job(plain, world=2, workers=0, steps=5)
    after, _ = job(plain, world=3, workers=2, state=state)
    counts = Counter(before + after)
    print(f"2 ranks read {len(before)} samples, 3 ranks x 2 workers the other {len(after)}: "
          f"{len(counts)} distinct of {len(a)}, max {max(counts.values())} reads each")
    try:
        plain(5, 0).load_state_dict(state)
    except featstore.InvalidInput as exc:
        print("5 ranks:", str(exc)[:120], "...")

    def mixed(world: int, rank: int):
        return featstore.mix([(a, 0.7), (b, 0.3)], epoch_size=900, batch_size=24 // world, seed=0,
                             partition="even", rank=rank, world_size=world)

    before, state = job(mixed, world=2, workers=0, steps=5)
    after, _ = job(mixed, world=1, workers=2, state=state)
    whole, _ = job(mixed, world=1, workers=0)
    got = Counter(before + after)
    print(f"mixture 0.7/0.3 of {len(whole)} samples: {Counter(s for s, _ in whole)} by source; resumed on 1 rank "
          f"after 5 steps on 2: same samples as one uninterrupted epoch: {got == Counter(whole)}")


if __name__ == "__main__":
    main()
