"""How a batch takes its rows from a window (the reader's innermost loop).

A window's arrays are either buffers (decoded rows, in window order), :class:`RaggedWindow`
(per-token rows), or rows left where they lie: :class:`InPlace` (per-shard arrays on mapped
objects or in the shared cache, gathered shard by shard with numpy) and :class:`ArenaRows`
(every shard of the window mapped into one :class:`~featstore.read.Arena`, so a batch of an
array is one ``torch.index_select``: docs/benchmarks.md measures a shuffled read-only epoch
1.85x faster than with the numpy gather). Batches are always copies: nothing a caller keeps points into a mapping.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from featstore.codecs import RaggedRows, RaggedWindow, gather_rows
from featstore.format import ShardFormat
from featstore.read.plans import Piece
from featstore.read.shards._arena import Arena, Slot


def window_rows(arrays: dict[str, SpanRows], order: np.ndarray | None, drop: int, a: int,
                b: int) -> dict[str, BatchRows]:
    """Rows ``[a, b)`` of a window in epoch order: a slice, or one gather through ``order``;
    fields left in place (:class:`InPlace`, :class:`ArenaRows`) are gathered straight into the
    batch."""
    pos = np.arange(drop + a, drop + b) if order is None else order[a:b]
    groups = None
    out: dict[str, BatchRows] = {}
    for k, v in arrays.items():
        if isinstance(v, ArenaRows | RaggedWindow):
            out[k] = v.take(pos)
        elif isinstance(v, InPlace) and order is None:
            out[k] = v.span(drop + a, drop + b)
        elif isinstance(v, InPlace):
            groups = groups if groups is not None else v.groups(pos)
            out[k] = v.take(groups, len(pos))
        else:
            out[k] = v[drop + a:drop + b] if order is None else v[pos]
    return out


class _Pieces:
    """Window positions -> (piece, row in the piece's shard) for a window's pieces."""

    def __init__(self, pieces: tuple[Piece, ...]) -> None:
        sizes = np.array([p.size for p in pieces], dtype=np.int64)
        self.ends = np.cumsum(sizes)
        self.starts = self.ends - sizes
        self.los = np.array([p.lo for p in pieces], dtype=np.int64)

    def shard_rows(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pid = np.searchsorted(self.ends, pos, side="right")
        return pid, pos - self.starts[pid] + self.los[pid]


@dataclass(frozen=True, slots=True)
class PieceRows:
    """The rows a batch takes from one piece of a window: at batch positions ``slots`` (None:
    the whole batch, in order), rows ``row`` of chunks ``chunk`` of the piece's shard."""

    piece: int
    slots: np.ndarray | None
    chunk: np.ndarray
    row: np.ndarray


class InPlace(_Pieces):
    """One field of a window left where it lies: piece ``i``'s rows are rows ``lo_i..`` of
    ``sources[i]``, a ``(chunks, chunk_rows, *row)`` array on a mapped shard object or a shard
    in the shared cache. A batch gathers its rows from there: one copy, as from a tensor."""

    def __init__(self, sources: list[np.ndarray], pieces: tuple[Piece, ...], chunk_rows: int) -> None:
        super().__init__(pieces)
        self.sources, self.chunk_rows = sources, chunk_rows

    def groups(self, pos: np.ndarray) -> list[PieceRows]:
        """Window positions -> the rows each piece gives (computed once per batch: every
        in-place field of the window shares them)."""
        pid, rows = self.shard_rows(pos)
        chunk, row = np.divmod(rows, self.chunk_rows)
        if len(pid) == 0 or pid[0] == pid[-1] and (pid == pid[0]).all():
            return [PieceRows(int(pid[0]) if len(pid) else 0, None, chunk, row)]
        slots = np.argsort(pid, kind="stable")
        bounds = np.searchsorted(pid[slots], np.arange(len(self.sources) + 1))
        return [PieceRows(p, sel, chunk[sel], row[sel]) for p in range(len(self.sources))
                if len(sel := slots[bounds[p]:bounds[p + 1]])]

    def span(self, lo: int, hi: int) -> np.ndarray:
        """Window rows ``[lo, hi)`` in order: one block copy per chunk they cross (an unshuffled
        batch reads sequentially, not row by row)."""
        first = self.sources[0]
        out = np.empty((hi - lo, *first.shape[2:]), dtype=first.dtype)
        at = lo
        while at < hi:
            p = int(np.searchsorted(self.ends, at, side="right"))
            stop = min(hi, int(self.ends[p]))
            row = at - int(self.starts[p]) + int(self.los[p])
            while at < stop:
                c, r = divmod(row, self.chunk_rows)
                k = min(stop - at, self.chunk_rows - r)
                out[at - lo:at - lo + k] = self.sources[p][c, r:r + k]
                at, row = at + k, row + k
        return out

    def take(self, groups: list[PieceRows], n: int) -> np.ndarray:
        """The ``n`` rows of a batch, from :meth:`groups` of its window positions."""
        if len(groups) == 1 and groups[0].slots is None:
            g = groups[0]
            rows: np.ndarray = self.sources[g.piece][g.chunk, g.row]
            return rows
        first = self.sources[groups[0].piece]
        out = np.empty((n, *first.shape[2:]), dtype=first.dtype)
        for g in groups:
            out[g.slots] = self.sources[g.piece][g.chunk, g.row]
        return out


class ArenaRows(_Pieces):
    """One array of a window whose shards are held in an :class:`Arena`: ``slots[i]`` holds
    piece ``i``'s shard, ``fmt.chunk_rows``-row chunks back to back (``stored``: an uncompressed
    stored object, each chunk followed by its crc32c; else a decoded shard of the shared cache).
    A batch's rows are one ``index_select`` of their unit offsets in the arena. :meth:`release`
    lets the arena reuse the slots once the window is consumed."""

    def __init__(self, arena: Arena, slots: list[Slot], pieces: tuple[Piece, ...], fmt: ShardFormat,
                 stored: bool) -> None:
        super().__init__(pieces)
        self.arena, self.slots, self.fmt = arena, slots, fmt
        self.dtype = np.dtype(fmt.dtype)
        row_bytes = fmt.row_bytes
        stride = fmt.stored_stride if stored else fmt.chunk_rows * row_bytes
        # rows are addressed in the largest unit every offset is a multiple of
        unit = next(u for u in (8, 4, 2, 1) if stride % u == 0 and row_bytes % u == 0)
        base = np.array([s.index * (arena.slot_bytes // unit) for s in slots], dtype=np.int64)
        # every window row's offset, once per window: a batch is then one lookup and one copy
        pid, rows = self.shard_rows(np.arange(int(self.ends[-1]) if len(pieces) else 0))
        chunk, row = np.divmod(rows, fmt.chunk_rows)
        self.offsets = base[pid] + chunk * (stride // unit) + row * (row_bytes // unit)
        self.src = arena.rows(unit, row_bytes // unit)

    def take(self, pos: np.ndarray) -> np.ndarray:
        """Window rows ``pos`` (in that order) as a new array."""
        return self.take_offsets(self.offsets[pos])

    def take_offsets(self, offsets: np.ndarray) -> np.ndarray:
        """The rows at these unit offsets (from :attr:`offsets`, of this window or of another
        that :meth:`shares_rows` with it) as a new array: one ``index_select``."""
        rows = torch.index_select(self.src, 0, torch.from_numpy(offsets)).numpy()
        return rows.view(self.dtype).reshape(len(offsets), *self.fmt.row_shape)

    def shares_rows(self, other: ArenaRows) -> bool:
        """Whether ``other``'s offsets address the same rows view of the same arena with the same
        row format, so that one ``index_select`` can take rows of both windows."""
        return (self.src is other.src and self.dtype == other.dtype
                and tuple(self.fmt.row_shape) == tuple(other.fmt.row_shape))

    def release(self) -> None:
        """Give the slots back (once; the rows gathered before stay valid: they are copies)."""
        slots, self.slots = self.slots, []
        for s in slots:
            self.arena.unpin(s)


#: One array of a window as a source hands it over: decoded rows in window order, rows left
#: where they lie (:class:`InPlace`, :class:`ArenaRows`), or per-token rows.
SpanRows = np.ndarray | InPlace | ArenaRows | RaggedWindow
#: One array of a batch: its rows, or with per-token arrays each sample's token rows.
BatchRows = np.ndarray | RaggedRows


def sample_tokens(fields: Sequence[str], starts: np.ndarray, lengths: np.ndarray,
                  take: Callable[[str, np.ndarray | slice], np.ndarray]) -> dict[str, RaggedRows]:
    """The token rows of some samples in each per-token array of ``fields``: sample ``i``'s
    tokens are token rows ``[starts[i], starts[i] + lengths[i])``, and ``take(field, rows)``
    gives those rows (a ``slice`` where the samples' runs follow each other: a piece read in
    order; else row numbers) of the stored array, or of a shard as Model A computed it. The one
    place per-token rows are cut by sample: the stored sources, the online source and random access."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    rows: np.ndarray | slice
    if not len(lengths):
        rows = slice(0, 0)
    elif bool((starts[1:] == starts[:-1] + lengths[:-1]).all()):
        rows = slice(int(starts[0]), int(starts[-1] + lengths[-1]))
    else:
        rows = gather_rows(starts, lengths)
    return {f: RaggedRows(take(f, rows), lengths) for f in fields}
