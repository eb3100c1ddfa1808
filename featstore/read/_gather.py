"""How a batch takes its rows from a slice's windows (the reader's innermost loop).

A slice of a plan's window has each stream's rows read into that stream's window arrays
(:mod:`featstore.read.shards`), and a yield order (:func:`~featstore.read.plans.slice_rows`):
for each position, its stream (``streams``) and its row among that stream's rows read
(``local``). A batch yields its rows grouped by stream (stream 0's first), each stream's in
yield order, with each row's stream beside them.

With one stream (one version, or several teachers on the same rows) a batch is its window's rows
at the batch's positions: a slice (unshuffled) or one gather per array, the rows of in-place
arrays located once per batch for all of them (:func:`~featstore.read.shards.window_rows`).

With several, :class:`SliceRows` does once per slice what does not depend on the batch, so that
a batch costs about what one stream's does (one gather per array):

- per slice, for each array whose rows all the versions' windows can address jointly, one array
  for the whole slice in yield order: the unit offsets of windows mapped into the same arena
  (:class:`~featstore.read.shards._gather.ArenaRows` that :meth:`~featstore.read.shards._gather.ArenaRows.shares_rows`),
  or the rows themselves when they are at most :data:`JOINT_ROW_BYTES` (the sample index, a
  label: copying them costs what an offset would);
- per slice too, the order batches yield its rows (:func:`batch_grouped`: each batch grouped by
  version, one vectorised stable sort of small integer labels for all its batches);
- per batch, for each joint array a slice of it (and for arena rows one ``index_select``, as for
  one version); any other array (decoded window buffers, rows gathered shard by shard, windows in
  different arenas) is gathered stream by stream into one preallocated buffer, never joined from
  pieces; per-token arrays stream by stream, their rows joined.
"""

from __future__ import annotations


from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from featstore.codecs import RaggedRows, RaggedWindow
from featstore.read.plans import run_starts
from featstore.read.shards import ArenaRows, BatchRows, SpanRows, window_rows

#: Rows at most this wide (bytes) are copied into one joint array per slice, like offsets.
JOINT_ROW_BYTES = 8


@dataclass(frozen=True)
class _Joint:
    """One array's rows of every stream, addressed jointly in the slice's yield order: unit
    offsets into ``arena``'s rows, or (``arena`` None) the rows themselves."""

    values: np.ndarray
    arena: ArenaRows | None


@dataclass(frozen=True)
class Rows:
    """A batch's rows (or part of one) grouped by stream, and each row's stream."""

    arrays: dict[str, BatchRows]
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


class SliceRows:
    """One slice's rows of every stream in yield order (see the module docstring).

    ``arrays``: each stream's window arrays for the slice (None: the slice reads none of it);
    ``streams``/``local``: each yielded position's stream and its row among that stream's rows
    read (``local`` None: one stream, its rows in read order from row ``drop``, unshuffled)."""

    def __init__(self, arrays: Sequence[Mapping[str, SpanRows] | None], streams: np.ndarray,
                 local: np.ndarray | None, held: int, batch_size: int, drop: int = 0) -> None:
        """``held``: rows of the batch being filled when the slice starts (its first batch takes
        ``batch_size - held`` rows of the slice, the later ones ``batch_size``)."""
        self.arrays, self.drop = arrays, drop
        present = [a for a in arrays if a is not None]
        self.fields = tuple(present[0]) if present else ()
        self.single = len(arrays) == 1
        self.n = len(streams)
        if self.single:  # one stream: its own order, no grouping
            self.labels, self.local = streams.astype(np.int64, copy=False), local
            self.joint: dict[str, _Joint] = {}
            return
        assert local is not None
        # the slice's positions in the order batches yield them: grouped by stream in each batch
        order = batch_grouped(streams.astype(np.min_scalar_type(max(len(arrays) - 1, 0))), held, batch_size)
        self.labels = streams[order].astype(np.int64, copy=False)  # once a slice, not once a batch
        self.local = local[order]
        self.joint = {f: j for f in self.fields if (j := _joint([None if a is None else a[f] for a in arrays],
                                                                   self.labels, self.local)) is not None}

    def rows(self, a: int, b: int) -> Rows:
        """Rows ``[a, b)`` of the slice in yield order (a batch, or the part of one in this slice:
        ``[a, b)`` must be one of the batches :meth:`__init__` grouped by)."""
        labels = self.labels[a:b]
        if self.single:
            window = self.arrays[0]
            assert window is not None
            return Rows(window_rows(dict(window), self.local, self.drop, a, b), labels)
        assert self.local is not None
        out: dict[str, BatchRows] = {}
        bounds: np.ndarray | None = None  # each stream's run in the batch: only arrays not joined need it
        local = self.local[a:b]
        for f in self.fields:
            j = self.joint.get(f)
            if j is None:
                if bounds is None:
                    bounds = np.searchsorted(labels, np.arange(len(self.arrays) + 1))
                out[f] = self._by_stream(f, local, bounds)
            elif j.arena is None:
                out[f] = j.values[a:b].copy()  # a batch never shares memory with the slice
            else:
                out[f] = j.arena.take_offsets(j.values[a:b])
        return Rows(out, labels)

    def _by_stream(self, field: str, local: np.ndarray, bounds: np.ndarray) -> BatchRows:
        """One array's rows, stream by stream (``local[bounds[k]:bounds[k + 1]]``: stream
        ``k``'s), gathered into one buffer (per-token rows: joined)."""
        runs = [(k, int(bounds[k]), int(bounds[k + 1])) for k in range(len(self.arrays)) if bounds[k] < bounds[k + 1]]
        if not runs:  # no rows: the array's empty rows, of its dtype and shape
            first = next(a[field] for a in self.arrays if a is not None)
            return window_rows({field: first}, local, 0, 0, 0)[field]
        parts: list[RaggedRows] = []
        out: np.ndarray | None = None
        for k, lo, hi in runs:
            window = self.arrays[k]
            assert window is not None  # a stream with rows in the slice was read
            v = window[field]
            if len(runs) == 1:
                return window_rows({field: v}, local, 0, 0, len(local))[field]
            if isinstance(v, np.ndarray):  # straight into the buffer: no copy in between
                if out is None:
                    out = np.empty((len(local), *v.shape[1:]), dtype=v.dtype)
                np.take(v, local[lo:hi], axis=0, out=out[lo:hi])
                continue
            got = window_rows({field: v}, local[lo:hi], 0, 0, hi - lo)[field]
            if isinstance(got, RaggedRows):
                parts.append(got)
                continue
            if out is None:
                out = np.empty((len(local), *got.shape[1:]), dtype=got.dtype)
            out[lo:hi] = got
        if parts:
            return RaggedRows.concat(parts)
        assert out is not None
        return out


def batch_grouped(labels: np.ndarray, held: int, batch_size: int) -> np.ndarray:
    """The positions of a slice whose rows have stream ``labels``, in the order batches yield
    them: each batch's rows (the first batch's ``batch_size - held``, then ``batch_size`` each)
    grouped by stream, stably. One stable sort per row of a ``[batches, batch_size]`` view (small
    integer labels: radix sorts), not one call per batch."""
    n = len(labels)
    first = min(n, (batch_size - held) if held else 0)
    order = np.empty(n, dtype=np.int64)
    order[:first] = np.argsort(labels[:first], kind="stable")
    whole = (n - first) // batch_size * batch_size
    if whole:
        grid = np.argsort(labels[first:first + whole].reshape(-1, batch_size), axis=1, kind="stable")
        grid += (first + np.arange(0, whole, batch_size))[:, None]
        order[first:first + whole] = grid.ravel()
    order[first + whole:] = first + whole + np.argsort(labels[first + whole:], kind="stable")
    return order


def joined(parts: list[Rows], streams: int) -> Rows:
    """A batch made of parts from consecutive slices (of ``streams`` streams), its rows grouped
    by stream again (stream 0's rows of every part first, each stream's in yield order)."""
    if len(parts) == 1:
        return parts[0]
    labels = np.concatenate([p.labels for p in parts])
    arrays = {f: _concat([p.arrays[f] for p in parts]) for f in parts[0].arrays}
    if streams == 1:
        return Rows(arrays, labels)
    order = np.argsort(labels, kind="stable")
    return Rows({f: _taken(v, order) for f, v in arrays.items()}, labels[order])


def _concat(parts: list[BatchRows]) -> BatchRows:
    """Rows of consecutive parts, one after another."""
    ragged = [p for p in parts if isinstance(p, RaggedRows)]
    if ragged:
        return RaggedRows.concat(ragged)
    return np.concatenate([p for p in parts if isinstance(p, np.ndarray)])


def _taken(rows: BatchRows, order: np.ndarray) -> BatchRows:
    """``rows`` in ``order``."""
    if isinstance(rows, RaggedRows):
        return RaggedWindow([rows]).take(order)
    taken: np.ndarray = rows[order]
    return taken


def _joint(rows: list[SpanRows | None], labels: np.ndarray, local: np.ndarray) -> _Joint | None:
    """One array of every stream's window, addressed jointly for the slice (None: it cannot be).
    Each stream's offsets (or rows) are laid end to end, stream 0's first, so that the slice's
    are one gather at (the stream's start + its local row): no pass per stream."""
    present = [v for v in rows if v is not None]
    first = present[0]
    if isinstance(first, ArenaRows) and all(isinstance(v, ArenaRows) and first.shares_rows(v) for v in present):
        return _Joint(_gathered([v.offsets if isinstance(v, ArenaRows) else None for v in rows], labels, local), first)
    if isinstance(first, np.ndarray) and first.dtype.itemsize * int(np.prod(first.shape[1:])) <= JOINT_ROW_BYTES \
            and all(isinstance(v, np.ndarray) and v.dtype == first.dtype and v.shape[1:] == first.shape[1:]
                    for v in present):
        return _Joint(_gathered([v if isinstance(v, np.ndarray) else None for v in rows], labels, local), None)
    return None


def _gathered(parts: list[np.ndarray | None], labels: np.ndarray, local: np.ndarray) -> np.ndarray:
    """Row ``local[i]`` of ``parts[labels[i]]`` for every ``i`` (a stream whose part is None
    has no rows in the slice)."""
    starts = run_starts([0 if p is None else len(p) for p in parts])
    rows: np.ndarray = np.concatenate([p for p in parts if p is not None])[starts[labels] + local]
    return rows
