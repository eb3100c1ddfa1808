"""The one row path: the rows of given samples of a version's arrays, from a process's sources.

:func:`rows_of` reads samples ``indices`` of a (version, arrays) the way the reader reads a window:
the samples as shard pieces (:class:`~featstore.read.plans.Piece`: runs of consecutive samples in
one shard), read by the process's sources of those arrays (mapped in place, through the node's
caches, decoded; per-token arrays by their one token source), then gathered in the order asked
(:func:`~featstore.read.shards.window_rows`, the reader's own gather). What uses it:

- ``Version[...]`` and ``Version.load()`` (:func:`version_rows`: decoded, with ``"index"``);
- :class:`featstore.hf.SoftLabels` (a batch's per-token soft labels, by sample);
- the reader itself reads its windows through the same sources and gather, ahead on a pool.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from featstore.codecs import OFFSETS, TOKEN_FIELDS, RaggedRows, assemble, offsets
from featstore.read.plans import Piece
from featstore.read.shards import BatchRows, FixedView, InThread, ProcessReads, ShardSource, Span, window_rows
from featstore.versions import StoredVersion

if TYPE_CHECKING:
    from featstore.versions import Index

#: Versions whose reads a process keeps for random access (their storage, mapped objects, formats).
KEPT = 8


def pieces_of(indices: np.ndarray, samples_per_shard: int) -> tuple[list[Piece], np.ndarray]:
    """``indices`` as shard pieces (each sample once, runs of consecutive samples in one shard
    as one piece), and where each index's row stands among the pieces' rows."""
    unique, where = np.unique(np.asarray(indices, dtype=np.int64), return_inverse=True)
    if not len(unique):
        return [], where.astype(np.int64)
    shard = unique // samples_per_shard
    breaks = np.flatnonzero((np.diff(unique) != 1) | (np.diff(shard) != 0)) + 1
    starts, stops = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(unique)]])
    pieces = [Piece(int(shard[a]), int(unique[a] - shard[a] * samples_per_shard),
                    int(unique[b - 1] - shard[a] * samples_per_shard) + 1) for a, b in zip(starts, stops, strict=True)]
    return pieces, where.astype(np.int64)


def rows_of(reads: ProcessReads, indices: np.ndarray,
            sources: Sequence[ShardSource] | None = None) -> dict[str, BatchRows]:
    """The stored rows of samples ``indices`` (in that order; repeats allowed) of ``reads``'
    arrays, stored dtypes, through ``sources`` (None: the stored ones, ``reads.sources``)."""
    samples = np.asarray(indices, dtype=np.int64).reshape(-1)
    out: dict[str, BatchRows] = {}
    spanned = []
    for s in reads.sources if sources is None else sources:
        direct = s.take(samples)  # a source that reads given samples itself (per-token rows)
        if direct is None:
            spanned.append(s)
            continue
        out.update(direct)
    if not spanned:
        return out
    pieces, pos = pieces_of(samples, reads.version.manifest.layout.samples_per_shard)
    span = Span(0, tuple(pieces))
    got = [s.read(span, InThread()) for s in spanned]
    try:
        out.update(window_rows({k: v for g in got for k, v in g.result().items()}, pos, 0, 0, len(pos)))
        return out
    finally:
        for g in got:
            g.close()


class _Kept:
    """This process's reads of the versions it reads at random, the last :data:`KEPT` of them."""

    def __init__(self) -> None:
        self.pid = -1
        self.reads: OrderedDict[tuple[StoredVersion, int | None], ProcessReads] = OrderedDict()

    def get(self, version: StoredVersion) -> ProcessReads:
        if self.pid != os.getpid():  # a forked child opens its own
            self.pid, self.reads = os.getpid(), OrderedDict()
        key = (version, version.read_view)
        if key not in self.reads:
            # every array but the per-token bookkeeping and the input digests (featstore's own, not a user's row)
            arrays = version.manifest.arrays
            fields = tuple(f for f, a in arrays.items() if f not in TOKEN_FIELDS and a.source != "digest")
            self.reads[key] = ProcessReads(version, fields, FixedView(version.read_view))
            while len(self.reads) > KEPT:
                self.reads.popitem(last=False)
        self.reads.move_to_end(key)
        return self.reads[key]


_KEPT = _Kept()


def version_rows(version: StoredVersion, index: Index) -> dict[str, torch.Tensor]:
    """Random access: a dict of tensors (one per array) plus ``index``, for ``version[index]``
    (an int, a slice, or a list or array of rows; ``(view, rows)`` for a version with views,
    which adds ``view``). A per-token array's rows are each sample's tokens, flat with
    ``<output>.offsets``; an int index gives one sample (its tokens whole)."""
    if isinstance(index, tuple) and len(index) == 2 and version.views is not None:
        viewed = version_rows(version.view(index[0]), index[1])
        viewed["view"] = torch.full(viewed["index"].shape, int(index[0]), dtype=torch.int64)
        return viewed
    n = len(version)
    if isinstance(index, (int, np.integer)):
        i = int(index) + (n if index < 0 else 0)
        if not 0 <= i < n:
            raise IndexError(f"index {index} out of range for {n} samples")
        batch = version_rows(version, slice(i, i + 1))
        ragged = {f for f, a in version.manifest.arrays.items() if a.ragged}
        return {k: v if k in ragged else v[0] for k, v in batch.items() if not k.endswith(f".{OFFSETS}")}
    if isinstance(index, slice):
        start, stop, step = index.indices(n)
        rows = np.arange(start, stop, step, dtype=np.int64)
    else:
        rows = np.asarray(index, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < -n or rows.max() >= n):
            raise IndexError(f"indices out of range for {n} samples")
        rows = np.where(rows < 0, rows + n, rows)
    stored = rows_of(_KEPT.get(version), rows)
    out: dict[str, torch.Tensor] = {}
    for f, v in stored.items():
        if isinstance(v, RaggedRows):
            out[f] = version.decode(f, v.flat)
            out[f"{version.manifest.arrays[f].output or f}.{OFFSETS}"] = torch.from_numpy(offsets(v.lengths))
        else:
            out[f] = version.decode(f, v)
    out["index"] = torch.from_numpy(rows)
    return assemble(version.manifest.arrays, out)
