"""Who reads what: the worker/rank/shuffle arithmetic, as pure functions.

A *consumer* is one (rank, DataLoader worker) pair; there are ``world_size * max(workers, 1)``
of them. Each epoch:

1. the shards are permuted with a seed made of (seed, epoch) - every consumer computes the same
   permutation without talking to the others;
2. the shards, in that order, form one sequence of N sample positions, which is cut into one
   contiguous span per consumer (``partition``: ``"even"`` spans differ by at most one sample and
   cover every sample exactly once; ``"pad"`` gives each ``ceil(N/C)`` by wrapping around to the
   start; ``"drop"`` gives each ``floor(N/C)`` and leaves out the last ``N mod C``);
3. a span is split at shard boundaries into :class:`Piece` reads, grouped into shuffle windows
   of at least ``window`` samples, and each window's rows are permuted with a seed made of
   (seed, epoch, consumer, window).

Nothing here does IO, so it is tested exhaustively over ranks x workers x shard layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Partition = Literal["even", "pad", "drop"]
PARTITIONS = ("even", "pad", "drop")


@dataclass(frozen=True)
class Piece:
    """Rows ``[lo, hi)`` of shard ``shard`` (shard-local offsets)."""

    shard: int
    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class ConsumerPlan:
    """One consumer's reads for one epoch, grouped into shuffle windows."""

    windows: tuple[tuple[Piece, ...], ...]
    n_samples: int

    def n_batches(self, batch_size: int, drop_last: bool) -> int:
        full, rest = divmod(self.n_samples, batch_size)
        return full + (1 if rest and not drop_last else 0)


def shard_order(n_shards: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's shard permutation (identity when not shuffling)."""
    return _order(n_shards, seed, epoch, shuffle).tolist()


def _order(n_shards: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n_shards, dtype=np.int64)
    return np.random.default_rng([seed, epoch, 0]).permutation(n_shards)


def consumer_span(n: int, consumers: int, cid: int, partition: Partition) -> tuple[int, int]:
    """Positions ``[start, stop)`` of consumer ``cid`` in the epoch's sequence of ``n`` samples.

    With ``"pad"`` ``stop`` may exceed ``n``: positions wrap around (``pos % n``).
    """
    if not 0 <= cid < consumers:
        raise ValueError(f"consumer {cid} out of range for {consumers} consumers")
    if partition == "pad":
        per = -(-n // consumers)
        return cid * per, (cid + 1) * per
    if partition == "drop":
        per = n // consumers
        return cid * per, (cid + 1) * per
    if partition == "even":
        base, extra = divmod(n, consumers)
        start = cid * base + min(cid, extra)
        return start, start + base + (1 if cid < extra else 0)
    raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")


def span_pieces(order: Sequence[int], shard_sizes: Sequence[int], start: int, stop: int) -> list[Piece]:
    """Split positions ``[start, stop)`` of the ordered shard sequence into per-shard pieces.

    Vectorised (numpy over the shards, Python only over this span's pieces): at a billion
    samples every consumer plans over ~74,000 shards.
    """
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    n = int(sizes.sum())
    if n == 0 or stop <= start:
        return []
    order = np.asarray(order, dtype=np.int64)
    offsets = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(sizes[order], out=offsets[1:])
    pieces: list[Piece] = []
    pos = start
    while pos < stop:
        p = pos % n
        k = int(np.searchsorted(offsets, p, side="right")) - 1
        take = min(stop - pos, int(offsets[k + 1]) - p)
        lo = p - int(offsets[k])
        pieces.append(Piece(int(order[k]), lo, lo + take))
        pos += take
    return pieces


def group_windows(pieces: Sequence[Piece], window: int) -> tuple[tuple[Piece, ...], ...]:
    """Group consecutive pieces into windows of at least ``window`` samples (the last may be less)."""
    windows: list[tuple[Piece, ...]] = []
    current: list[Piece] = []
    size = 0
    for piece in pieces:
        current.append(piece)
        size += piece.size
        if size >= window:
            windows.append(tuple(current))
            current, size = [], 0
    if current:
        windows.append(tuple(current))
    return tuple(windows)


def consumer_plan(
    shard_sizes: Sequence[int], *, seed: int, epoch: int, shuffle: bool, consumers: int, cid: int,
    partition: Partition, window: int,
) -> ConsumerPlan:
    """The whole plan of consumer ``cid`` for one epoch (see the module docstring)."""
    n = int(np.sum(shard_sizes, dtype=np.int64))
    order = _order(len(shard_sizes), seed, epoch, shuffle)
    start, stop = consumer_span(n, consumers, cid, partition)
    pieces = span_pieces(order, shard_sizes, start, stop)
    return ConsumerPlan(group_windows(pieces, max(1, window)), max(0, stop - start) if n else 0)


def window_permutation(seed: int, epoch: int, cid: int, window_index: int, size: int) -> np.ndarray:
    """The row permutation applied inside one shuffle window."""
    return np.random.default_rng([seed, epoch, 1 + cid, window_index]).permutation(size)


def round_robin_consumed(batches_seen: int, per_worker: Sequence[int]) -> list[int]:
    """How many batches each DataLoader worker had delivered after ``batches_seen`` in total.

    DataLoader returns batches from its workers in turn, skipping a worker once it is exhausted;
    this replays that order, so a mid-epoch resume knows where each worker stopped.
    """
    if batches_seen > sum(per_worker):
        raise ValueError(f"{batches_seen} batches seen, but the epoch has only {sum(per_worker)}")
    done = [0] * len(per_worker)
    left = batches_seen
    while left:
        for w, total in enumerate(per_worker):
            if left and done[w] < total:
                done[w] += 1
                left -= 1
    return done
