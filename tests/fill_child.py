"""A training process that fills a version as it reads (tests/test_fill.py): as a script for the
kill and race tests, and ``rank`` for the gloo ranks under torch.multiprocessing.

Script: ``python -m tests.fill_child STORE_URL NAME SEED BATCHES_BEFORE_PAUSE``: reads epoch 0
with fill=True; after that many batches it prints ``paused <json state_dict>`` and waits for a
line on stdin (the kill test SIGKILLs it there), then reads the rest and prints ``done <n>``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import featstore
from featstore import ComputeOptions, Teacher

from .models import TinyA, VectorData

N = 200


def fill_teacher() -> Teacher:
    return Teacher(model=TinyA(), dataset=VectorData(N), keep=["target"],
                   outputs={"features": "float16", "logits": "float32"}, samples_per_shard=32, batch_size=32,
                   options=ComputeOptions(progress=False, chunk_rows=16), fill=True)


def rank(rank: int, world: int, init_file: str, url: str, out_dir: str) -> None:
    """One gloo rank: fill epoch 0 (rank and world from torch.distributed), a collective per step."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    store = featstore.open_store(url)
    ds = store.dataset("fill/ddp", batch_size=16, seed=4, teacher=fill_teacher())
    indices = []
    for batch in DataLoader(ds, batch_size=None, num_workers=0):
        dist.all_reduce(torch.ones(1))  # uneven batch counts would hang here
        indices += batch["index"].tolist()
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"indices": indices, "version": ds.version.id}, f)
    dist.destroy_process_group()


def main(url: str, name: str, seed: int, pause: int) -> None:
    store = featstore.open_store(url)
    ds = store.dataset(name, batch_size=20, seed=seed, teacher=fill_teacher())
    seen = 0
    for _ in ds:
        seen += 1
        if seen == pause:
            print("paused", json.dumps(ds.state_dict()), flush=True)
            sys.stdin.readline()
    print("done", seen, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
