"""A training process for test_cache: reads a version through 2 DataLoader workers with
cache="memory", prints the cache folder, and then (by mode) ends normally, loses a worker to
SIGKILL mid-epoch, or waits to be killed itself.

    python -m tests.cache_child STORE_ROOT REF MODE      # MODE: normal | kill-worker | hang
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader

import featstore


def main(root: str, ref: str, mode: str) -> None:
    ds = featstore.open_store(root).dataset(ref, batch_size=16, seed=3, cache="memory", cache_bytes=2**24)
    print(ds._shared_cache().folder, flush=True)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True, timeout=120)
    it = iter(loader)
    next(it)
    if mode == "kill-worker":
        os.kill(it._workers[0].pid, signal.SIGKILL)  # the other worker and this process go on
        try:
            for _ in it:
                pass
        except RuntimeError as exc:  # "DataLoader worker (pid ...) exited unexpectedly"
            print("worker lost:", exc, flush=True)
        del it
        return
    n = 16 + sum(len(b["index"]) for b in it)
    print("samples", n, flush=True)
    if mode == "hang":
        print("ready", flush=True)
        time.sleep(600)
    torch.set_num_threads(1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
