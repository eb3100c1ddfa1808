"""Who reads what: the worker/rank/shuffle arithmetic, as pure functions.

A *consumer* is one (rank, DataLoader worker) pair; there are ``world_size * max(workers, 1)``
of them. Each epoch:

1. the shards are permuted with a seed made of (seed, epoch) - every consumer computes the same
   permutation without talking to the others, and only at the positions of its own span
   (:class:`featstore.read.ShardPermutation`), so a plan's cost does not grow with the number
   of shards when they are given as :class:`UniformShards` (a version's layout);
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

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from featstore.read.plans._partitions import PARTITIONS, Partition
from featstore.read.plans._shuffle import ShardPermutation



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


@dataclass(frozen=True)
class UniformShards:
    """``n_samples`` cut into shards of ``per_shard`` rows, the last possibly shorter: a
    version's layout, described without listing every shard's size."""

    n_samples: int
    per_shard: int

    @property
    def n_shards(self) -> int:
        return -(-self.n_samples // self.per_shard)

    def sizes(self) -> list[int]:
        """Every shard's size (O(shards): for tests and small versions)."""
        n = self.n_shards
        return [self.per_shard] * (n - 1) + [self.n_samples - (n - 1) * self.per_shard] if n else []


def shard_order(n_shards: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's whole shard order (identity when not shuffling); O(shards), for tests and
    tools: a plan evaluates only its own positions."""
    return [int(s) for s in ShardPermutation(n_shards, seed, epoch, shuffle).shards(np.arange(n_shards))]


def consumer_span(n: int, consumers: int, cid: int, partition: Partition) -> tuple[int, int]:
    """Positions ``[start, stop)`` of consumer ``cid`` in the epoch's sequence of ``n`` samples.

    With ``"pad"`` ``stop`` may exceed ``n``: positions wrap around (``pos % n``).
    """
    if not 0 <= cid < consumers:
        raise ValueError(f"consumer {cid} out of range for {consumers} consumers")
    if partition in ("pad", "drop"):
        per = -(-n // consumers) if partition == "pad" else n // consumers
        return cid * per, (cid + 1) * per
    if partition == "even":
        base, extra = divmod(n, consumers)
        start = cid * base + min(cid, extra)
        return start, start + base + (1 if cid < extra else 0)
    raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")


def span_pieces(order: Sequence[int] | np.ndarray, shard_sizes: Sequence[int], start: int, stop: int) -> list[Piece]:
    """Split positions ``[start, stop)`` of the ordered shard sequence into per-shard pieces.

    Vectorised (numpy over the shards, Python only over this span's pieces): at a billion
    samples every consumer plans over ~74,000 shards.
    """
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    n = int(sizes.sum())
    if n == 0 or stop <= start:
        return []
    ordered = np.asarray(order, dtype=np.int64)
    offsets = np.zeros(len(ordered) + 1, dtype=np.int64)
    np.cumsum(sizes[ordered], out=offsets[1:])
    pieces: list[Piece] = []
    for _, a, b in laps(start, stop, n):
        first, last = np.searchsorted(offsets, [a, b - 1], side="right") - 1  # the shards of a and of b - 1
        ks = np.arange(first, last + 1)
        pieces += _pieces(ordered[ks], offsets[ks], offsets[ks + 1], a, b)
    return pieces


def laps(start: int, stop: int, n: int) -> Iterator[tuple[int, int, int]]:
    """Positions ``[start, stop)`` of a sequence of ``n`` repeated end to end, as runs
    ``(lap, lo, hi)``: positions ``[lo, hi)`` of the sequence's ``lap``-th repeat."""
    pos = start
    while pos < stop:
        lap, lo = divmod(pos, n)
        hi = min(n, lo + stop - pos)
        yield lap, lo, hi
        pos += hi - lo


def _pieces(shards: np.ndarray, starts: np.ndarray, ends: np.ndarray, a: int, b: int) -> list[Piece]:
    """Positions ``[a, b)`` of consecutive shards that hold positions ``[starts, ends)`` (an
    empty shard between them gives no piece)."""
    los, his = np.maximum(a - starts, 0), np.minimum(b, ends) - starts
    return [Piece(s, lo, hi) for s, lo, hi in zip(shards.tolist(), los.tolist(), his.tolist(), strict=True) if lo < hi]


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


def uniform_span_pieces(shards: UniformShards, perm: ShardPermutation, start: int, stop: int) -> list[Piece]:
    """:func:`span_pieces` for a uniform layout, touching only the span's own positions: the
    one short shard (the last) stands at ``perm.positions([last])``, and every offset follows."""
    n, spp = shards.n_samples, shards.per_shard
    if n == 0 or stop <= start:
        return []
    short = n - (shards.n_shards - 1) * spp  # rows of the last shard
    q = perm.last  # its position in the order

    def locate(p: int) -> int:  # the position whose rows hold sample position p
        if p < q * spp:
            return p // spp
        return q if p < q * spp + short else q + 1 + (p - q * spp - short) // spp

    pieces: list[Piece] = []
    for _, a, b in laps(start, stop, n):  # at most two: a pad span wraps around once
        ks = np.arange(locate(a), locate(b - 1) + 1, dtype=np.int64)
        offsets = ks * spp - np.where(ks > q, spp - short, 0)
        pieces += _pieces(perm.shards(ks), offsets, offsets + np.where(ks == q, short, spp), a, b)
    return pieces


def dropped_pieces(shards: UniformShards, *, seed: int, epoch: int, shuffle: bool, consumers: int) -> list[Piece]:
    """The pieces at the epoch's positions that no consumer reads under ``"drop"`` (the last
    ``n % consumers``), in plan order.

    >>> dropped_pieces(UniformShards(10, 4), seed=0, epoch=0, shuffle=False, consumers=3)
    [Piece(shard=2, lo=1, hi=2)]
    """
    n = shards.n_samples
    perm = ShardPermutation(shards.n_shards, seed, epoch, shuffle)
    return uniform_span_pieces(shards, perm, consumers * (n // consumers), n)


def consumer_plan(
    shard_sizes: Sequence[int] | UniformShards, *, seed: int, epoch: int, shuffle: bool, consumers: int,
    cid: int, partition: Partition, window: int,
) -> ConsumerPlan:
    """The whole plan of consumer ``cid`` for one epoch (see the module docstring).

    ``shard_sizes`` as :class:`UniformShards` costs O(the consumer's pieces); as a list of sizes
    (any layout) O(shards). Both give the same plan for the same shards.
    """
    n = shard_sizes.n_samples if isinstance(shard_sizes, UniformShards) else int(np.sum(shard_sizes, dtype=np.int64))
    start, stop = consumer_span(n, consumers, cid, partition)
    if isinstance(shard_sizes, UniformShards):
        perm = ShardPermutation(shard_sizes.n_shards, seed, epoch, shuffle)
        pieces = uniform_span_pieces(shard_sizes, perm, start, stop)
    else:
        pieces = span_pieces(shard_order(len(shard_sizes), seed, epoch, shuffle), shard_sizes, start, stop)
    return ConsumerPlan(group_windows(pieces, max(1, window)), max(0, stop - start) if n else 0)


def window_permutation(seed: int, epoch: int, cid: int, window_index: int, size: int) -> np.ndarray:
    """The row permutation applied inside one shuffle window."""
    return np.random.default_rng([seed, epoch, 1 + cid, window_index]).permutation(size)


def round_robin_consumed(batches_seen: int, per_worker: Sequence[int]) -> list[int]:
    """How many batches each DataLoader worker had delivered after ``batches_seen`` in total.

    DataLoader returns batches from its workers in turn, skipping a worker once it is exhausted;
    this counts that order out (O(workers), not O(batches)), so a mid-epoch resume knows where
    each worker stopped.
    """
    counts = np.asarray(per_worker, dtype=np.int64)
    if batches_seen > int(counts.sum()):
        raise ValueError(f"{batches_seen} batches seen, but the epoch has only {int(counts.sum())}")
    # Arithmetic, not a replay: a resume costs the same late in an epoch as early. After r whole
    # rounds worker w has min(count, r); the last, partial round goes to the first still running.
    lo, hi = 0, int(counts.max(initial=0))
    while lo < hi:  # the most whole rounds that fit
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if int(np.minimum(counts, mid).sum()) <= batches_seen else (lo, mid - 1)
    done = np.minimum(counts, lo)
    done[np.flatnonzero(counts > lo)[:batches_seen - int(done.sum())]] += 1
    return [int(d) for d in done]


def rotated(worker: int, workers: int, seen: int, counts: Sequence[int]) -> tuple[int, int]:
    """(role, batches to skip) of ``worker`` resuming a rank-level state after ``seen`` batches;
    ``counts``: each role's batches this epoch. DataLoader's round robin restarts at worker 0,
    which must continue as the worker the original run would have read next."""
    w = max(1, workers)
    role = (worker + seen) % w
    return role, round_robin_consumed(seen, counts)[role]
