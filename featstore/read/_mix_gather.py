"""How a mixture's batch takes its rows from its versions' windows (the mixture reader's innermost loop).

A slice of a mixture's window has each version's rows read into that version's window arrays
(:mod:`featstore.read.shards._gather`), and a yield order (:func:`~featstore.read.plans._slices.slice_rows`):
for each position, its version (``streams``) and its row among that version's rows read
(``local``). A batch yields its rows grouped by version (version 0's first), each version's in
yield order, with each row's version beside them.

:class:`MixedSlice` does once per slice what does not depend on the batch, so that a batch costs
about what one version's does (one gather per array):

- per slice, for each array whose rows all the versions' windows can address jointly, one array
  for the whole slice in yield order: the unit offsets of windows mapped into the same arena
  (:class:`~featstore.read.shards._gather.ArenaRows` that :meth:`~featstore.read.shards._gather.ArenaRows.shares_rows`),
  or the rows themselves when they are at most :data:`JOINT_ROW_BYTES` (the sample index, a
  label: copying them costs what an offset would);
- per slice too, the order batches yield its rows (:func:`batch_grouped`: each batch grouped by
  version, one vectorised stable sort of small integer labels for all its batches);
- per batch, for each joint array a slice of it (and for arena rows one ``index_select``, as for
  one version); any other array (decoded window buffers, rows gathered shard by shard, windows in different arenas)
  is gathered version by version into one preallocated buffer, never joined from pieces.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from featstore.codecs._ragged import concat_rows
from featstore.errors import InvalidInput
from featstore.read.shards._gather import ArenaRows, BatchRows, WindowRows, window_rows
from featstore.read.plans._slices import run_starts

#: Rows at most this wide (bytes) are copied into one joint array per slice, like offsets.
JOINT_ROW_BYTES = 8


@dataclass(frozen=True)
class _Joint:
    """One array's rows of every version, addressed jointly in the slice's yield order: unit
    offsets into ``arena``'s rows, or (``arena`` None) the rows themselves."""

    values: np.ndarray
    arena: ArenaRows | None


@dataclass(frozen=True)
class MixedRows:
    """A batch's rows (or part of one) grouped by version, and each row's version."""

    arrays: dict[str, BatchRows]
    labels: np.ndarray


class MixedSlice:
    """One slice's rows of every version in the mixture's yield order (see the module docstring).

    ``arrays``: each version's window arrays for the slice (None: the slice reads none of it);
    ``streams``/``local``: each yielded position's version and its row among that version's
    rows read."""

    def __init__(self, arrays: Sequence[Mapping[str, WindowRows] | None], streams: np.ndarray,
                 local: np.ndarray, held: int, batch_size: int) -> None:
        """``held``: rows of the batch being filled when the slice starts (its first batch takes
        ``batch_size - held`` rows of the slice, the later ones ``batch_size``)."""
        self.arrays = arrays
        present = [a for a in arrays if a is not None]
        self.fields = tuple(present[0]) if present else ()
        # the slice's positions in the order batches yield them: grouped by version in each batch
        order = batch_grouped(streams.astype(np.min_scalar_type(max(len(arrays) - 1, 0))), held, batch_size)
        self.labels = streams[order]
        self.local = local[order]
        self.joint = {f: j for f in self.fields if (j := _joint([None if a is None else a[f] for a in arrays],
                                                                   self.labels, self.local)) is not None}

    def rows(self, a: int, b: int) -> MixedRows:
        """Rows ``[a, b)`` of the slice in yield order (a batch, or the part of one in this slice:
        ``[a, b)`` must be one of the batches :meth:`__init__` grouped by)."""
        labels = self.labels[a:b]
        out: dict[str, BatchRows] = {}
        bounds: np.ndarray | None = None
        for f in self.fields:
            j = self.joint.get(f)
            if j is None:
                if bounds is None:
                    bounds = np.searchsorted(labels, np.arange(len(self.arrays) + 1))
                out[f] = self._by_version(f, self.local[a:b], bounds)
            elif j.arena is None:
                out[f] = j.values[a:b].copy()  # a batch never shares memory with the slice
            else:
                out[f] = j.arena.take_offsets(j.values[a:b])
        return MixedRows(out, labels.astype(np.int64))

    def _by_version(self, field: str, local: np.ndarray, bounds: np.ndarray) -> np.ndarray:
        """One array's rows, version by version (``local[bounds[k]:bounds[k + 1]]``: version
        ``k``'s), gathered into one buffer."""
        runs = [(k, int(bounds[k]), int(bounds[k + 1])) for k in range(len(self.arrays)) if bounds[k] < bounds[k + 1]]
        out: np.ndarray | None = None
        for k, lo, hi in runs:
            window = self.arrays[k]
            assert window is not None  # a version with rows in the slice was read
            v = window[field]
            if len(runs) == 1:
                return _dense(window_rows({field: v}, local, 0, 0, len(local))[field])
            if isinstance(v, np.ndarray):  # straight into the buffer: no copy in between
                if out is None:
                    out = np.empty((len(local), *v.shape[1:]), dtype=v.dtype)
                np.take(v, local[lo:hi], axis=0, out=out[lo:hi])
                continue
            got = _dense(window_rows({field: v}, local[lo:hi], 0, 0, hi - lo)[field])
            if out is None:
                out = np.empty((len(local), *got.shape[1:]), dtype=got.dtype)
            out[lo:hi] = got
        if out is None:  # no rows: the array's empty rows, of its dtype and shape
            first = next(a[field] for a in self.arrays if a is not None)
            return _dense(window_rows({field: first}, local, 0, 0, 0)[field])
        return out


def batch_grouped(labels: np.ndarray, held: int, batch_size: int) -> np.ndarray:
    """The positions of a slice whose rows have version ``labels``, in the order batches yield
    them: each batch's rows (the first batch's ``batch_size - held``, then ``batch_size`` each)
    grouped by version, stably. One stable sort per row of a ``[batches, batch_size]`` view (small
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


def regrouped(parts: list[MixedRows]) -> MixedRows:
    """A batch made of parts from consecutive slices, its rows grouped by version again
    (version 0's rows of every part first, each version's in yield order)."""
    if len(parts) == 1:
        return parts[0]
    labels = np.concatenate([p.labels for p in parts])
    order = np.argsort(labels, kind="stable")
    arrays = {f: _dense(concat_rows([p.arrays[f] for p in parts]))[order] for f in parts[0].arrays}
    return MixedRows(arrays, labels[order])  # type: ignore[arg-type]


def _joint(rows: list[WindowRows | None], labels: np.ndarray, local: np.ndarray) -> _Joint | None:
    """One array of every version's window, addressed jointly for the slice (None: it cannot be).
    Each version's offsets (or rows) are laid end to end, version 0's first, so that the slice's
    are one gather at (the version's start + its local row): no pass per version."""
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
    """Row ``local[i]`` of ``parts[labels[i]]`` for every ``i`` (a version whose part is None
    has no rows in the slice)."""
    starts = run_starts([0 if p is None else len(p) for p in parts])
    return np.concatenate([p for p in parts if p is not None])[starts[labels] + local]


def _dense(rows: BatchRows) -> np.ndarray:
    if not isinstance(rows, np.ndarray):  # refused by featstore.mix before any read
        raise InvalidInput("a mixture reads per-sample arrays only; name others with arrays=[...].")
    return rows
