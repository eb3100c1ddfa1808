"""One DDP rank for test_ddp: gloo on CPU, a FeatureDataset, a collective after the loop."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader


def run(rank: int, world: int, init_file: str, version, workers: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    ds = version.dataset(batch_size=16, seed=11)  # rank and world size from torch.distributed
    ds.set_epoch(1)
    loader = DataLoader(ds, batch_size=None, num_workers=workers, timeout=60 if workers else 0)
    batches, indices = 0, []
    for batch in loader:
        dummy = torch.ones(1) * len(batch["index"])
        dist.all_reduce(dummy)  # a collective per step: uneven batch counts would hang here
        batches += 1
        indices += batch["index"].tolist()
    total = torch.tensor([batches])
    dist.all_reduce(total)  # and one after the loop
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": ds.rank, "world": ds.world_size, "batches": batches, "total": int(total),
                   "indices": indices}, f)
    dist.destroy_process_group()


def elastic_run(rank: int, world: int, init_file: str, version, workers: int, out_dir: str, global_batch: int,
                steps: int | None, path: str) -> None:
    """One rank of a job with global batch ``global_batch``: resumes the state at ``path`` if it
    exists, reads ``steps`` batches (None: to the epoch's end) with a collective per step, and
    rank 0 saves its state there (each rank's indices go to ``out_dir/rank{rank}.json``)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    ds = version.dataset(batch_size=global_batch // world, seed=5)  # rank and world size from torch.distributed
    state = None
    if os.path.exists(path):
        with open(path) as f:
            state = json.load(f)
        ds.load_state_dict(state)
    loader = DataLoader(ds, batch_size=None, num_workers=workers, timeout=60 if workers else 0)
    batches, indices = 0, []
    for batch in loader:
        dummy = torch.ones(1)
        dist.all_reduce(dummy)  # a collective per step: ranks with unequal batch counts would hang here
        batches += 1
        indices += batch["index"].tolist()
        if steps is not None and batches == steps:
            break
    total = torch.tensor([batches])
    dist.all_reduce(total)
    dist.barrier()  # every rank has read the state before rank 0 replaces it
    if rank == 0 and steps is not None:
        seen = batches + (state["batches_seen"] if state else 0)
        with open(path, "w") as f:
            json.dump(ds.state_dict(batches_seen=seen, num_workers=workers), f)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"batches": batches, "total": int(total), "indices": indices}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit("run through torch.multiprocessing.spawn from tests/read/test_ddp.py")
