"""The reader's windows in flight: shuffle windows read ahead on a thread pool, each yielded once
all its reads are done (a window is permuted as a whole, so it is only usable once complete).

:class:`WindowReader` drives the reads a :class:`~featstore.read.FeatureDataset` defines
(``_read_field``, ``_source``, ``_arena_rows``, ``_read_tokens``): which arrays are gathered in
place, through the arena, or decoded into window buffers, and how many pieces stay in flight.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from featstore.read._arena import supported as arena_supported
from featstore.read._gather import ArenaRows, InPlace
from featstore.read._assignment import Piece
from featstore.codecs._ragged import RaggedWindow


class WindowReader:
    """Keeps shuffle windows in flight and yields each once all its reads are done.

    Every (piece, array) is its own read, so one shard's arrays are fetched concurrently;
    ``prefetch`` pool threads issue them. The next window's reads are always in flight while
    the current one is consumed (a window is only usable once whole: it is permuted together),
    so S3 latency hides behind Model B instead of adding up window by window. Every read decodes
    straight into its rows of the window's buffers: no concatenation.
    """

    def __init__(self, ds: Any, pool: ThreadPoolExecutor | InThread,
                 todo: list[tuple[int, int, tuple[Piece, ...]]]) -> None:
        self.ds, self.pool, self.todo = ds, pool, iter(todo)
        self.specs = ds.version.manifest.arrays
        self.spp = ds.version.manifest.layout.samples_per_shard
        self.queue: deque[tuple[int, int, dict[str, Any], list[Future], tuple[Piece, ...]]] = deque()
        self.in_flight = 0  # pieces submitted and not yet consumed
        self.placed = [f for f in ds.fields if ds._in_place(f)]
        # Mapping a local uncompressed shard is bookkeeping (~0.2 ms): done here, not handed to a
        # pool thread that would wait for a core behind Model B's busy torch threads.
        local_raw = {f for f in self.placed if ds._proc.storage.is_local and not ds._shard_format(f).compressed}
        # (the disk tier's entries only under "keep", which never evicts them while this reads:
        # under "lru" an entry could go between its fetch and its mapping, and be fetched twice)
        self.disk_raw = {f for f in self.placed if ds._disk is not None and ds._disk[0].policy == "keep"
                         and not ds._shard_format(f).compressed}
        # one index_select per batch: local uncompressed objects, or the disk tier's, or the shared cache's shards
        self.arena = (set(self.placed) if ds._memory else local_raw | self.disk_raw) if arena_supported() else set()
        self.mapped = set() if ds._memory else local_raw - self.arena
        self.ragged = [f for f in ds.fields if ds.version.manifest.arrays[f].ragged]
        self.dense = [f for f in ds.fields if f not in self.placed and f not in self.ragged]
        self.chunk_rows = ds.version.manifest.layout.chunk_rows
        # Shuffled batches are gathered copies, so a consumed window's buffers are reused for a
        # later window: no fresh pages to fault in for every window (~15% of the read cost).
        # Unshuffled batches are views into the window, which the caller may keep.
        self.spare: list[dict[str, np.ndarray]] | None = [] if ds.options.shuffle else None

    def __iter__(self) -> Iterator[tuple[int, int, dict[str, np.ndarray]]]:
        arrays: dict[str, Any] = {}
        try:
            self._fill()
            while self.queue:
                wi, drop, arrays, futs, window = self.queue.popleft()
                for f in futs:
                    f.result()
                for f in self.placed:  # an arena's rows (a future), or each piece's source (a list)
                    arrays[f] = (arrays[f].result() if isinstance(arrays[f], Future)
                                 else InPlace([x.result() for x in arrays[f]], window, self.chunk_rows))
                for f in self.ragged:
                    arrays[f] = RaggedWindow([x.result()[f] for x in arrays[f]])
                self.in_flight -= len(window)
                self._fill()
                yield wi, drop, arrays
                release(arrays.values())  # the consumer has cut every batch of this window
                if self.spare is not None:
                    self.spare.append({k: v for k, v in arrays.items() if k in self.dense or k == "index"})
        finally:
            release(arrays.values())
            for _, _, queued, futs, _ in self.queue:  # an abandoned epoch: do not read what nobody will use
                for f in futs:
                    f.cancel()
                release(queued.values())

    def _buffers(self, total: int) -> dict[str, np.ndarray]:
        while self.spare:
            got = self.spare.pop()
            if len(got["index"]) == total:
                return got
        return {f: np.empty((total, *self.specs[f].shape), dtype=self.specs[f].dtype) for f in self.dense}

    def _fill(self) -> None:
        """Keep ``prefetch`` pieces in flight, and the next two windows at least."""
        while self.in_flight < self.ds.options.prefetch or len(self.queue) < 2:
            nxt = next(self.todo, None)
            if nxt is None:
                return
            wi, drop, window = nxt
            arrays = self._buffers(sum(p.size for p in window))
            arrays["index"] = np.concatenate(
                [np.arange(p.shard * self.spp + p.lo, p.shard * self.spp + p.hi, dtype=np.int64) for p in window])
            futs, off = [], 0
            for p in window:
                futs += [self.pool.submit(self.ds._read_field, p, f, arrays[f][off:off + p.size])
                         for f in self.dense]
                off += p.size
            for f in self.placed:  # each piece's source; an InPlace once all are done
                # a window whose disk tier entries are not all held yet fetches them piece by
                # piece on the pool, shard by shard (the arena's pins would fetch one at a time)
                held = self.ds._entries_held(window, f) if f in self.disk_raw else None
                if f in self.arena and (held or f not in self.disk_raw):  # bookkeeping only, in this thread
                    arrays[f] = now(self.ds._arena_rows, window, f, held)
                    futs.append(arrays[f])
                    continue
                run = now if f in self.mapped else self.pool.submit
                arrays[f] = [run(self.ds._source, p, f) for p in window]
                futs += arrays[f]
            if self.ragged:  # each piece's token rows of every per-token array; RaggedWindows once done
                tokens = [self.pool.submit(self.ds._read_tokens, p, tuple(self.ragged)) for p in window]
                arrays.update({f: tokens for f in self.ragged})
                futs += tokens
            self.queue.append((wi, drop, arrays, futs, window))
            self.in_flight += len(window)


class InThread:
    """An executor that runs each read in the calling thread (a finished future)."""

    def submit(self, fn: Any, *args: Any) -> Future:
        return now(fn, *args)


def spare_cores() -> int:
    """Cores this process may use beyond its torch intra-op threads."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores - torch.get_num_threads()


def release(values: Any) -> None:
    """Give back the arena slots of a window's arrays (an :class:`ArenaRows`, or the finished
    future of one)."""
    for v in values:
        if isinstance(v, Future) and v.done() and not v.cancelled() and v.exception() is None:
            v = v.result()
        if isinstance(v, ArenaRows):
            v.release()


def now(fn: Any, *args: Any) -> Future:
    """``fn(*args)`` run in the calling thread, as a finished future (its error kept in it)."""
    fut: Future = Future()
    try:
        fut.set_result(fn(*args))
    except BaseException as exc:  # noqa: BLE001 - re-raised where the result is taken, as from a pool
        fut.set_exception(exc)
    return fut
