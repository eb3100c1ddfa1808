"""A consumer's reads as slices of shuffle windows, so that a plan can start and stop mid-window.

An epoch's plan gives each consumer shuffle windows (:func:`featstore.read.consumer_plan` for one
version, :func:`featstore.read.plans._mixture.mixture_share` for several). A consumer yields each
window's rows in the window's *order* (:func:`window_order`), cutting batches across window
boundaries. This module names the pieces of that sequence:

- a :class:`Window` is one window of one epoch's plan: for each stream (a version of a mixture;
  one for a plain version) the shard :class:`~featstore.read.Piece`\\ s it reads, and the
  (consumer, window index) that made it, which seeds its order;
- a :class:`Slice` is a range of positions of a window's order;
- a :class:`Share` is what one consumer yields, in order: a tuple of slices.

An uninterrupted epoch's share is its windows whole. A resumed consumer's share
(:mod:`featstore.read.plans._elastic`) starts and ends mid-window, wherever the interrupted run stopped
or the new split cuts, and keeps every window's order: a row's place is fixed by the epoch's
first plan, whichever split reads it.

**A window's order.** Its rows are read stream by stream (``runs[0]``'s pieces, then
``runs[1]``'s, ...). With one stream, shuffled, the order is
:func:`~featstore.read.plans._assignment.window_permutation` (the reader's order), unshuffled the
identity. With several streams it is *stratified*: each stream's rows are permuted on their own
(shuffled), and the streams take turns in the balanced pattern of :func:`interleave`, so that
every stretch of the order, not only the whole window, holds each stream in its proportion to
within ``ceil(log2(streams))`` rows (one row for two streams). A plain permutation of the whole
window would not: at a 0.7/0.3 mixture, 10,000 rows drawn at random from a window of 40,000
stray by about 0.4% (one standard deviation), and a batch of 64 by 6%.

**Reading a slice** (:func:`slice_rows`): shuffled, a partial slice's rows lie anywhere in its
window, so the whole window is read; unshuffled, each stream's rows of a slice are one contiguous
run of that stream's pieces, and only those are read.

Nothing here does IO.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from featstore.read.plans._assignment import ConsumerPlan, Piece, window_permutation


def interleave(counts: Sequence[int], x: Any) -> list[Any]:
    """How many of the first ``x`` positions of the balanced interleave of ``counts`` belong to
    each stream (``x``: an int, or an int array for many positions at once).

    The streams are halved recursively; at each level the left half takes
    ``round(x * left / (left + right))`` of ``x`` positions. So every stream's count rises by 0
    or 1 per position, the counts sum to ``x``, each is within ``levels / 2`` of
    ``x * count / total``, and at ``x = total`` each is exactly its own count.

    >>> interleave([7, 3], 10), interleave([7, 3], 5)
    ([7, 3], [4, 1])
    """
    if len(counts) == 1:
        return [x]
    half = len(counts) // 2
    left, total = sum(counts[:half]), sum(counts)
    xl = (x * left + total // 2) // total if total else x * 0
    return interleave(counts[:half], xl) + interleave(counts[half:], x - xl)


@dataclass(frozen=True)
class Window:
    """One shuffle window of an epoch's plan.

    Attributes:
        runs: per stream, the pieces this window reads (one stream for a plain version).
        consumer: the consumer of the epoch's first plan that made it.
        index: its index among that consumer's windows (with ``consumer``, seeds its order).
    """

    runs: tuple[tuple[Piece, ...], ...]
    consumer: int
    index: int

    @property
    def sizes(self) -> tuple[int, ...]:
        """Rows of each stream."""
        return tuple(sum(p.size for p in run) for run in self.runs)

    @property
    def size(self) -> int:
        return sum(self.sizes)


@dataclass(frozen=True)
class Slice:
    """Positions ``rows`` (a ``range``) of a window's order."""

    window: Window
    rows: range


@dataclass(frozen=True)
class Share:
    """What one consumer yields, in order: slices of windows."""

    slices: tuple[Slice, ...]

    @property
    def n_samples(self) -> int:
        return sum(len(s.rows) for s in self.slices)

    def rows(self, lo: int, hi: int) -> Share:
        """Positions ``[lo, hi)`` of this share (O(slices), whatever the positions)."""
        out: list[Slice] = []
        pos = 0
        for s in self.slices:
            part = s.rows[max(lo - pos, 0):max(hi - pos, 0)]
            if part:
                out.append(Slice(s.window, part))
            pos += len(s.rows)
            if pos >= hi:
                break
        return Share(tuple(out))


def whole(plan: ConsumerPlan, cid: int) -> Share:
    """A plain version's consumer plan as a share of whole windows."""
    windows = (Window((pieces,), cid, i) for i, pieces in enumerate(plan.windows))
    return Share(tuple(Slice(w, range(w.size)) for w in windows))


def balanced_positions(sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(stream, rank within the stream) of each position of the balanced interleave of
    ``sizes`` (O(total) numpy; read-only arrays, kept for the last few ``sizes``: a mixture's
    windows mostly have the same sizes, so each epoch's windows compute it once)."""
    return _balanced_positions(tuple(int(n) for n in sizes))


@functools.lru_cache(maxsize=8)
def _flat_positions(sizes: tuple[int, ...]) -> np.ndarray:
    """``starts[stream] + rank`` of :func:`balanced_positions`, cached like it: per slice, a
    mixture's window order is then one gather."""
    stream, rank = _balanced_positions(sizes)
    flat: np.ndarray = run_starts(sizes)[stream] + rank
    flat.flags.writeable = False
    return flat


@functools.lru_cache(maxsize=8)
def _balanced_positions(sizes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    total = sum(sizes)
    cum = np.stack(interleave(list(sizes), np.arange(total + 1, dtype=np.int64)))  # [streams, total + 1]
    stream = np.argmax(np.diff(cum, axis=1), axis=0)
    rank = cum[stream, np.arange(total)]
    stream.flags.writeable = rank.flags.writeable = False
    return stream, rank


def window_order(window: Window, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The window's rows in the order a consumer yields them, as indices into its rows read
    stream by stream (see the module docstring)."""
    sizes = window.sizes
    streams = len(sizes)
    # Stream k of window i is permuted with the key of index i * streams + k: distinct for every
    # stream and window, and with one stream the reader's own window_permutation.
    perms = [window_permutation(seed, epoch, window.consumer, window.index * streams + k, n) if shuffle
             else np.arange(n) for k, n in enumerate(sizes)]
    if streams == 1:
        return perms[0]
    # position x takes row rank[x] of stream[x]'s permutation: with the permutations (shifted to
    # the stream's start) laid end to end, that is one gather at starts[stream] + rank
    laid = np.concatenate([start + perm for start, perm in zip(run_starts(sizes), perms, strict=True)])
    out: np.ndarray = laid[_flat_positions(sizes)]
    return out


@dataclass(frozen=True)
class SliceRows:
    """How to read a slice: the pieces of each stream, and the yielded rows.

    Attributes:
        reads: per stream, the pieces to read (rows are then taken stream by stream).
        order: the slice's rows in yield order, as indices into the rows of ``reads``.
        streams: the stream of each yielded row (the batch's label).
    """

    reads: tuple[tuple[Piece, ...], ...]
    order: np.ndarray
    streams: np.ndarray


def slice_rows(s: Slice, seed: int, epoch: int, shuffle: bool) -> SliceRows:
    """What a consumer reads and yields for one slice (O(window) numpy)."""
    window, lo, hi = s.window, s.rows.start, s.rows.stop
    order = window_order(window, seed, epoch, shuffle)[lo:hi]
    # each stream's rows are permuted among themselves: position x's row is of stream[x]
    streams = balanced_positions(window.sizes)[0][lo:hi] if len(window.sizes) > 1 else np.zeros(hi - lo, np.int64)
    reads = slice_reads(s, shuffle)
    if reads is window.runs:  # shuffled, or the whole window
        return SliceRows(reads, order, streams)
    # Unshuffled, stream k's rows of the slice are its rows [F_k(lo), F_k(hi)): each moves from
    # where they stand among the window's rows to where they stand among the rows read.
    first = np.array(interleave(list(window.sizes), lo), dtype=np.int64)
    shift = run_starts(window.sizes) + first - run_starts([sum(p.size for p in run) for run in reads])
    return SliceRows(reads, order - shift[streams], streams)


def slice_reads(s: Slice, shuffle: bool) -> tuple[tuple[Piece, ...], ...]:
    """The pieces :func:`slice_rows` reads for ``s`` (per stream), without its order: the whole
    window when shuffled or whole, else each stream's run of the slice's rows."""
    if shuffle or len(s.rows) == s.window.size:
        return s.window.runs
    sizes = list(s.window.sizes)
    first, last = interleave(sizes, s.rows.start), interleave(sizes, s.rows.stop)
    return tuple(cut_pieces(run, a, b) for run, a, b in zip(s.window.runs, first, last, strict=True))


def run_starts(sizes: Sequence[int]) -> np.ndarray:
    """Where each run starts when runs of ``sizes`` rows are laid end to end."""
    return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)[:-1]])


def cut_pieces(pieces: Sequence[Piece], lo: int, hi: int) -> tuple[Piece, ...]:
    """Rows ``[lo, hi)`` of the pieces' rows taken one after another, as pieces."""
    return split_pieces(pieces, [lo, hi - lo])[1]


def split_pieces(pieces: Sequence[Piece], sizes: Sequence[int]) -> list[tuple[Piece, ...]]:
    """The pieces' rows taken one after another, cut into consecutive runs of ``sizes`` rows
    (each run as pieces; a piece a cut falls inside is split): :func:`cut_pieces` for every run
    in one pass, O(pieces + runs)."""
    out: list[tuple[Piece, ...]] = []
    rest = iter(pieces)
    cur, off = next(rest, None), 0  # the piece being cut, and its rows already taken
    for size in sizes:
        run: list[Piece] = []
        need = int(size)
        while need > 0:
            if cur is None:
                raise ValueError(f"the pieces hold fewer rows than the runs ({sum(int(n) for n in sizes)})")
            take = min(need, cur.size - off)
            run.append(Piece(cur.shard, cur.lo + off, cur.lo + off + take))
            off, need = off + take, need - take
            if off == cur.size:
                cur, off = next(rest, None), 0
        out.append(tuple(run))
    return out
