"""Processes for tests/read/test_diskcache.py: a DDP-like rank on the node reading through the disk
cache with 2 DataLoader workers, and a reader that is SIGKILLed while it fetches.

    python -m tests.diskcache_child rank URL ENDPOINT REF CACHE_DIR R WORLD SYNC_DIR
    python -m tests.diskcache_child fetch URL ENDPOINT REF CACHE_DIR
"""

from __future__ import annotations

import os
import sys
import time

from torch.utils.data import DataLoader

import featstore


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + 240
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.02)


def rank(url: str, endpoint: str, ref: str, cache_dir: str, r: int, world: int, sync: str) -> None:
    """Epoch 0, tell the test, wait for it (it counts the GETs per epoch), epoch 1."""
    ds = featstore.open_store(url, {"endpoint_url": endpoint}).dataset(
        ref, batch_size=16, seed=5, rank=r, world_size=world, cache="disk", cache_dir=cache_dir, cache_bytes=2**26)
    seen = []
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        n = sum(len(b["index"]) for b in DataLoader(ds, batch_size=None, num_workers=2, timeout=120))
        seen.append(n)
        open(os.path.join(sync, f"done-{r}-{epoch}"), "w").close()
        if epoch == 0:
            _wait_for(os.path.join(sync, "go-1"))
    print("read", *seen, flush=True)


def fetch(url: str, endpoint: str, ref: str, cache_dir: str) -> None:
    """Read an epoch (the test stalls one GET at its proxy and kills this process meanwhile)."""
    ds = featstore.open_store(url, {"endpoint_url": endpoint}).dataset(
        ref, batch_size=16, seed=5, cache="disk", cache_dir=cache_dir, cache_bytes=2**26)
    print("reading", flush=True)
    for _ in ds:
        pass
    print("finished", flush=True)  # the test fails if this is reached


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "rank":
        rank(*args[:4], int(args[4]), int(args[5]), args[6])
    else:
        fetch(*args)
