"""A training process for test_cache: reads a version through 2 DataLoader workers with
cache="memory", prints the cache folder, and then (by mode) ends normally, loses a worker to
SIGKILL mid-epoch, or waits to be killed itself.

    python -m tests.cache_child STORE_ROOT REF MODE      # MODE: normal | kill-worker | hang
    python -m tests.cache_child STORE_ROOT REF rank R SYNC_DIR
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader

import featstore


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + 240
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.05)


RANK_OPTIONS = dict(batch_size=16, seed=4, world_size=2, cache="memory", cache_bytes=2**24)


def _save(batches: list[dict], path: str) -> None:
    """An epoch's batches, each field concatenated (numpy arrays: the test reads them back
    without unpickling)."""
    import numpy as np

    np.savez(path, **{k: torch.cat([b[k] for b in batches]).numpy() for k in batches[0]})


def rank(root: str, ref: str, r: int, sync: str) -> None:
    """One of 2 ranks on this machine: epoch 0 decodes its half into the shared cache; after
    both ranks are done and the store's chunks are gone, epoch 1 (other shards) still reads.
    Each epoch's batches are saved for the test to compare."""
    ds = featstore.open_store(root).dataset(ref, rank=r, **RANK_OPTIONS)
    first = list(ds)
    _save(first, os.path.join(sync, f"epoch0-{r}.npz"))
    open(os.path.join(sync, f"done-{r}"), "w").close()
    _wait_for(os.path.join(sync, "deleted"))  # the test removes the chunk objects
    ds.set_epoch(1)
    _save(list(ds), os.path.join(sync, f"epoch1-{r}.npz"))


def main(root: str, ref: str, mode: str) -> None:
    ds = featstore.open_store(root).dataset(ref, batch_size=16, seed=3, cache="memory", cache_bytes=2**24)
    print(ds.process_reads().memory.folder, flush=True)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True, timeout=120)
    it = iter(loader)
    next(it)
    if mode == "kill-worker":
        time.sleep(0.5)  # the workers prefetch: the dead one leaves queued batches behind
        # torch's SIGCHLD handler raises wherever this process happens to be when the signal lands
        # (once inside the except clause below, under load); without it the loss is found by the
        # loader itself, from next(): its worker status check or the reset fd-passing connection.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.kill(it._workers[0].pid, signal.SIGKILL)  # the other worker and this process go on
        try:
            for _ in it:
                pass
        # "DataLoader worker (pid ...) exited unexpectedly"; or, for a batch the worker had queued
        # before it died, the reset connection of its fd-passing tensor (ConnectionResetError).
        except (RuntimeError, ConnectionError) as exc:
            print("worker lost:", exc, flush=True)
        # Shut the surviving worker down now: left to interpreter exit, torch's cleanup can meet
        # the dead worker's reset pipe when stderr is already gone, and exit with status 1.
        with contextlib.suppress(Exception):
            it._shutdown_workers()
        loader._iterator = None
        del it
        return
    n = 16 + sum(len(b["index"]) for b in it)
    print("samples", n, flush=True)
    if mode == "hang":
        print("ready", flush=True)
        time.sleep(600)
    torch.set_num_threads(1)


if __name__ == "__main__":
    if sys.argv[3] == "rank":
        rank(sys.argv[1], sys.argv[2], int(sys.argv[4]), sys.argv[5])
    else:
        main(*sys.argv[1:4])
