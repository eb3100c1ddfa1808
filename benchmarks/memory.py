"""The memory rows: the reader's and a writer worker's peak RSS at N and at 10 x N.

Running Model A over 10 x N samples would take too long for the quick profile, so these
versions are written by featstore's real writer from a *replay* Model A that returns A's
outputs already computed (tiled to the length wanted): the writer and reader do the same work
per byte, and only the memory is compared here, never the time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

import featstore

from .measure import RssSampler
from .workload import BATCH

NAME = "bench/replay"


class ReplayData(Dataset):
    """Item ``i`` is row ``i % n0`` of A's stored outputs (features as float32, as A gives them)."""

    def __init__(self, outputs: dict[str, torch.Tensor], n: int) -> None:
        self.features = outputs["features"].float()
        self.logits = outputs["logits"]
        self.target = outputs["target"]
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        j = i % len(self.target)
        return {"features": self.features[j], "logits": self.logits[j], "target": self.target[j]}

    def __getitems__(self, idx: list[int]) -> list[dict[str, torch.Tensor]]:
        return [self[i] for i in idx]


class Replay(nn.Module):
    """A stand-in Model A that returns the outputs carried in its input batch."""

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"features": x["features"], "logits": x["logits"]}


def replay_version(root: str, outputs: dict[str, torch.Tensor], n: int,
                   exclude: tuple[int, ...]) -> tuple[featstore.Version, int]:
    """Write an ``n``-sample version through the real writer; return it and a writer worker's peak RSS."""
    store = featstore.open_store(root)
    with RssSampler(exclude=exclude) as rss:
        v = store.compute(NAME, model=Replay(), dataset=ReplayData(outputs, n), input_key=None,
                          keep=["target"], outputs={"features": "float16", "logits": "float32"},
                          batch_size=BATCH, options=featstore.ComputeOptions(
                              progress=False, dataset_id=f"replay-{n}",
                              processes=True))  # a worker process of its own, so its peak RSS is measurable
    return v, rss.child_peak


def reader_peak(root: str, vid: str) -> dict[str, Any]:
    """Peak RSS of a fresh process that streams one epoch of the version (0 workers)."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.memory", root, f"{NAME}@{vid}"],
                         capture_output=True, text=True, check=True, cwd=os.getcwd())
    return json.loads(out.stdout.strip().splitlines()[-1])


def _child(root: str, ref: str) -> None:
    import resource

    import psutil

    from .workload import read_only

    v = featstore.open_store(root).open(ref)
    ds = v.dataset(batch_size=BATCH, shuffle=True, seed=0, fields=("features", "logits", "target"))
    base = psutil.Process().memory_info().rss
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
    secs, n = read_only((b["features"], b["logits"], b["target"]) for b in loader)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_rss": peak, "base_rss": base, "samples": n, "seconds": secs}))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
