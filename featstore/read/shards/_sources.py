"""Where a window's rows come from, decided once per (version, array): :class:`ShardSource`
(one required method, :meth:`~ShardSource.read`) and the stored sources (the spans in flight:
:mod:`featstore.read.shards._flight`).
:meth:`ProcessReads.sources` picks each array's source once per process:

- uncompressed, and its objects files of this node (a local store's, or the disk cache's under
  ``"keep"``), or through the memory cache (the decoded shards): :class:`ArenaSource`, the
  window's shards mapped back to back so a batch is one ``index_select``;
- other uncompressed arrays: :class:`InPlaceSource`, gathered from the fetched objects' bytes;
- compressed ones, or not in featstore's layout: :class:`DecodedSource`, into window buffers;
  per-token arrays: :class:`TokenSource`.

Where the objects come from is the process's :class:`~featstore.read.shards._objects.ShardObjects`.
The online reader (:mod:`featstore.online`) supplies a source that computes rows on a miss.
"""

from __future__ import annotations

import os
import sys
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from featstore.codecs import TOKEN_LENGTH, TOKEN_START, RaggedRows, RaggedWindow
from featstore.format import ShardFormat, shard_format
from featstore.read.plans import Piece
from featstore.read.shards import _objects
from featstore.read.shards._arena import Slot, process_arena
from featstore.read.shards._arena import supported as arena_supported
from featstore.read.shards._cache import DiskCacheOptions, NodeCache, Space, shm_root
from featstore.read.shards._gather import ArenaRows, BatchRows, InPlace, SpanRows, sample_tokens
from featstore.read.shards._objects import (DiskObjects, LocalObjects, MemoryShards, PlacedShards, RemoteObjects,
                                            ShardObject, ShardObjects, StoredShards, process_maps)
from featstore.versions import StoredVersion

T = TypeVar("T")


@dataclass(frozen=True)
class Span:
    """What a source reads of one window of a consumer's plan (:class:`featstore.read.plans.Window`):
    the window's number in the plan, the shard pieces of its stream, the epoch position of its
    first row (where the consumer's own span of the epoch starts: what the online fill's
    ownership of shards is decided by), and how many of its rows were already seen (a resumed
    epoch's first window)."""

    number: int
    pieces: tuple[Piece, ...]
    at: int = 0
    drop: int = 0

    @property
    def size(self) -> int:
        return sum(p.size for p in self.pieces)


@dataclass(frozen=True)
class Epoch:
    """What a source learns when a consumer's iteration starts: the epoch, the consumer, the
    order's seed and shuffle, and every span of its stream in the consumer's plan
    (``todo``: those this iteration reads, the rows already seen dropped)."""

    number: int
    consumer: int
    consumers: int
    partition: str
    seed: int
    shuffle: bool
    spans: tuple[Span, ...]
    todo: tuple[Span, ...]


class SpanRead:
    """One source's reads of one window, in flight: ``futures`` (errors are raised by
    :meth:`result`), then ``finish()`` gives the window's rows of the source's arrays.
    ``give_back(rows)`` takes back what a consumed window held (buffers to reuse)."""

    def __init__(self, futures: list[Future[Any]], finish: Callable[[], dict[str, SpanRows]],
                 give_back: Callable[[dict[str, SpanRows]], None] | None = None) -> None:
        self.futures, self._finish, self._give_back = futures, finish, give_back
        self.rows: dict[str, SpanRows] | None = None

    @classmethod
    def joined(cls, reads: Sequence["SpanRead"]) -> "SpanRead":
        """Several sources' reads of one window as one."""
        def finish() -> dict[str, SpanRows]:
            return {k: v for r in reads for k, v in r.result().items()}

        def give_back(_: dict[str, SpanRows]) -> None:
            for r in reads:
                r.close()
        return cls([f for r in reads for f in r.futures], finish, give_back)

    def result(self) -> dict[str, SpanRows]:
        for f in self.futures:
            f.result()
        self.rows = self._finish()
        return self.rows

    def close(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        """Give back what the window holds once consumed (or abandoned: nothing more is read):
        the arena slots of its rows, and its buffers."""
        if _finalizing():  # an iterator abandoned until exit: the module's names are gone, the process's memory goes
            return
        done = []
        for f in self.futures:
            if not f.cancel() and f.done() and f.exception() is None:
                done.append(f.result())
        for v in [*(self.rows or {}).values(), *done]:
            if isinstance(v, ArenaRows):
                v.release()
        if self.rows is not None and self._give_back is not None:
            self._give_back(self.rows)
        self.rows, self._give_back = None, None


class ShardSource(ABC):
    """Where the rows of some arrays (:attr:`fields`) of one version come from, in one process.
    Made once per process, it reads a window at a time from the consuming thread: ``reads``
    runs what blocks (a pool, or the calling thread when no core is spare), and the
    :class:`SpanRead`'s rows are what batches are cut from (:mod:`featstore.read.shards._gather`)."""

    fields: tuple[str, ...]

    @abstractmethod
    def read(self, span: Span, reads: Executor) -> SpanRead:
        """Start reading ``span``'s rows of :attr:`fields`."""

    def near(self, spans: Sequence[Span]) -> bool:
        """Whether these spans' reads need no remote storage (then, with no core to spare,
        they run in the consuming thread: there is no latency to hide)."""
        return False

    def take(self, samples: np.ndarray) -> dict[str, BatchRows] | None:
        """Random access: the rows of ``samples`` (in that order) of :attr:`fields`, read
        directly; None (the default): read them as a span of shard pieces."""
        return None

    def begin(self, epoch: Epoch) -> None:  # noqa: B027 - most sources keep nothing per epoch
        """A consumer's iteration starts (before any :meth:`read`)."""

    def end(self, finished: bool) -> None:  # noqa: B027 - likewise
        """The iteration ended: read to its end (``finished``), or abandoned or failed."""


class DecodedSource(ShardSource):
    """An array decoded into window buffers, piece by piece on the pool: compressed and not
    through the memory cache, or not in featstore's layout (read through zarr). A consumed
    shuffled window's buffer is reused for a later one: no fresh pages to fault in for every
    window (~15% of the read cost); unshuffled batches are views of it, which a caller may keep."""

    def __init__(self, reads: ProcessReads, field: str) -> None:
        self.reads, self.fields = reads, (field,)
        self.spec = reads.version.manifest.arrays[field]
        self.spare: list[np.ndarray] | None = [] if reads.reuse_buffers else None

    def read(self, span: Span, reads: Executor) -> SpanRead:
        (field,) = self.fields
        out = self._buffer(span.size)
        futs, off = [], 0
        for p in span.pieces:
            futs.append(reads.submit(self.reads.read_rows, field, p.shard, p.lo, p.hi, out[off:off + p.size]))
            off += p.size
        return SpanRead(futs, lambda: {field: out}, self._give_back)

    def _buffer(self, n: int) -> np.ndarray:
        while self.spare:
            got = self.spare.pop()
            if len(got) == n:
                return got
        return np.empty((n, *self.spec.shape), dtype=self.spec.dtype)

    def _give_back(self, rows: dict[str, SpanRows]) -> None:
        if self.spare is not None:
            self.spare.append(rows[self.fields[0]])  # type: ignore[arg-type]

    def near(self, spans: Sequence[Span]) -> bool:
        return self.reads.near(self.fields[0], spans)


class InPlaceSource(ShardSource):
    """An array gathered where its shards lie (:class:`~featstore.read.shards._objects.PlacedShards`),
    shard by shard with numpy (:class:`~featstore.read.shards._gather.InPlace`)."""

    def __init__(self, reads: ProcessReads, field: str, shards: PlacedShards, here: bool = False) -> None:
        """``here``: read in the calling thread (mapping a local shard is bookkeeping, ~0.2 ms,
        not work for a pool thread that would wait for a core behind Model B's torch threads)."""
        self.reads, self.fields, self.shards, self.here = reads, (field,), shards, here

    def read(self, span: Span, reads: Executor) -> SpanRead:
        run = now if self.here else reads.submit
        (field,) = self.fields
        futs = [run(self.shards.array, self.reads.obj(field, p.shard), p) for p in span.pieces]
        chunk_rows = self.reads.version.manifest.layout.chunk_rows
        return SpanRead(futs, lambda: {field: InPlace([f.result() for f in futs], span.pieces, chunk_rows)})

    def near(self, spans: Sequence[Span]) -> bool:
        return self.reads.near(self.fields[0], spans)


class ArenaSource(InPlaceSource):
    """An array whose window's shards are mapped back to back into the process's arena, so a
    batch is one ``index_select`` (:class:`~featstore.read.shards._gather.ArenaRows`); a window whose
    shards cannot all be held is gathered shard by shard (:class:`InPlaceSource`)."""

    def read(self, span: Span, reads: Executor) -> SpanRead:
        (field,) = self.fields
        objs = [self.reads.obj(field, p.shard) for p in span.pieces]
        if not self.shards.ready(objs):
            # the disk cache does not hold them all yet: fetched piece by piece on the pool
            # (pinning here would fetch them one at a time)
            return super().read(span, reads)
        fut = now(self._rows, span, objs)  # bookkeeping only, in this thread
        return SpanRead([fut], lambda: {field: fut.result()})

    def _rows(self, span: Span, objs: list[ShardObject]) -> ArenaRows | InPlace:
        fmt = objs[0].fmt
        arena = process_arena(self.shards.slot_bytes(fmt), _objects.MAPPED_BYTES)
        got: list[Slot | np.ndarray | None] = []
        if arena is not None:
            try:
                for obj, piece in zip(objs, span.pieces, strict=True):
                    got.append(self.shards.pin(arena, obj, piece))
            except BaseException:
                for g in got:
                    if isinstance(g, Slot):
                        arena.unpin(g)
                raise
            slots = [g for g in got if isinstance(g, Slot)]
            if len(slots) == len(objs):
                return ArenaRows(arena, slots, span.pieces, fmt, self.shards.stored)
            for s in slots:  # a shard that cannot be held: this window is read shard by shard
                arena.unpin(s)
        got += [None] * (len(objs) - len(got))
        return InPlace([g if isinstance(g, np.ndarray) else self.shards.array(o, p)
                        for g, o, p in zip(got, objs, span.pieces, strict=True)], span.pieces, fmt.chunk_rows)


class TokenSource(ShardSource):
    """The per-token arrays: the samples' tokens are runs of rows in their shard, found from its
    ``token_start``/``token_length``; consecutive pieces of one shard are read together."""

    def __init__(self, reads: ProcessReads, fields: tuple[str, ...]) -> None:
        self.reads, self.fields = reads, fields

    def read(self, span: Span, reads: Executor) -> SpanRead:
        if self.reads.chunks is not None:  # random access: every sample in one pass over the chunks kept
            runs = [list(span.pieces)]
        else:  # a window: consecutive pieces of one shard together, the shards concurrently
            runs = []
            for p in span.pieces:
                if runs and runs[-1][0].shard == p.shard:
                    runs[-1].append(p)
                else:
                    runs.append([p])
        futs = [reads.submit(self.reads.read_tokens, self.fields, run) for run in runs]
        return SpanRead(futs, lambda: {f: RaggedWindow([x.result()[f] for x in futs]) for f in self.fields})

    def take(self, samples: np.ndarray) -> dict[str, BatchRows] | None:
        return dict(self.reads.sample_tokens(self.fields, samples))

    def near(self, spans: Sequence[Span]) -> bool:
        return self.reads.objects.local


class Labelled(ShardSource):
    """One teacher's source in a stream of several (aligned versions read on the same rows): its
    arrays are ``<label>/<array>`` in the stream's windows."""

    def __init__(self, label: str, inner: ShardSource) -> None:
        self.label, self.inner = label, inner
        self.fields = tuple(f"{label}/{f}" for f in inner.fields)

    def read(self, span: Span, reads: Executor) -> SpanRead:
        got = self.inner.read(span, reads)
        return SpanRead(got.futures, lambda: {f"{self.label}/{k}": v for k, v in got.result().items()},
                        lambda _: got.close())

    def near(self, spans: Sequence[Span]) -> bool:
        return self.inner.near(spans)

    def begin(self, epoch: Epoch) -> None:
        self.inner.begin(epoch)

    def end(self, finished: bool) -> None:
        self.inner.end(finished)


# -- one process's reads of one version -----------------------------------------------------------
@dataclass(frozen=True)
class Caches:
    """A dataset's caches, resolved once when it is made (workers opening them later must not
    see a smaller budget because the caches themselves took shared memory or disk meanwhile)."""

    identity: str = ""
    memory_bytes: int = 0  # 0: no memory tier
    disk: DiskCacheOptions | None = None  # resolved; None: no disk tier


class Viewed(Protocol):
    """Which view of a version with views a process reads now (None: the version has none); a
    reader's stream changes it at each epoch."""

    @property
    def view(self) -> int | None: ...


@dataclass(frozen=True)
class FixedView:
    """One view for good (a random access of ``version.view(v)[rows]``)."""

    view: int | None = None


class DecodedChunks:
    """Decoded inner chunks kept in one process, least recently used out past ``budget`` bytes:
    random access (a map-style dataset's batches are random samples) would otherwise decode a
    chunk for every sample it reads, and zstd is the cost."""

    def __init__(self, budget: int) -> None:
        self.budget, self.held = budget, 0
        self._chunks: OrderedDict[tuple[str, int | None, int, int], np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._chunks)

    def kept(self, key: tuple[str, int | None, int, int]) -> np.ndarray | None:
        """The chunk ``key`` if it is kept (then the most recently used), else None."""
        got = self._chunks.get(key)
        if got is not None:
            self._chunks.move_to_end(key)
        return got

    def get(self, key: tuple[str, int | None, int, int], decode: Callable[[], np.ndarray]) -> np.ndarray:
        """The chunk ``key``, decoded by ``decode()`` and kept if it was not."""
        got = self.kept(key)
        if got is not None:
            return got
        got = self._chunks[key] = decode()
        self.held += got.nbytes
        while len(self._chunks) > 1 and self.held > self.budget:
            self.held -= self._chunks.popitem(last=False)[1].nbytes
        return got


class ProcessReads:
    """What one process reads a version with: its own storage (an fsspec filesystem is neither
    fork- nor loop-safe), its :class:`~featstore.read.shards._objects.ShardObjects`, its handles on
    the node's caches, the arrays' shard formats and the sources chosen for them.

    ``viewing``: the view read now; ``reuse_buffers``: a consumed window's decoded buffer is
    reused for a later one (shuffled batches are gathered copies; unshuffled ones are views of
    it); ``chunk_bytes``: decoded inner chunks kept in this process (:class:`DecodedChunks`; 0:
    none, what a streaming reader reads once an epoch)."""

    def __init__(self, version: StoredVersion, fields: tuple[str, ...], viewing: Viewed = FixedView(),
                 caches: Caches = Caches(), reuse_buffers: bool = False, chunk_bytes: int = 0) -> None:
        self.pid = os.getpid()
        self.version, self.fields, self.viewing, self.reuse_buffers = version, fields, viewing, reuse_buffers
        self.chunks = DecodedChunks(chunk_bytes) if chunk_bytes else None
        self._token_rows: dict[tuple[int | None, int], int] = {}
        self._grouped: tuple[np.ndarray, int, list[tuple[int, int, np.ndarray, np.ndarray]]] | None = None
        self.storage = version.storage.reopen()
        maps = process_maps()
        self.memory = NodeCache.open(Space.for_memory(caches.identity), caches.identity, caches.memory_bytes) \
            if caches.memory_bytes else None
        if self.memory is not None:
            self.memory.trim(caches.memory_bytes)
        self.disk = caches.disk.open(caches.identity, {"store": self.storage.url, "version": version.ref}, maps) \
            if caches.disk is not None else None
        self.objects: ShardObjects = (
            LocalObjects(version, self.storage, maps) if self.storage.is_local
            else DiskObjects(version, self.storage, self.disk) if self.disk is not None
            else RemoteObjects(version, self.storage))
        self._formats: dict[str, ShardFormat | None] = {}

    @property
    def reading(self) -> StoredVersion:
        """The version bound to the view read now."""
        view = self.viewing.view
        return self.version if view is None else self.version.view(view)

    def shard_format(self, field: str) -> ShardFormat | None:
        """The array's shard format when featstore's own decoder reads it (else zarr does)."""
        if field not in self._formats:  # every view has the same layout: one format per array
            self._formats[field] = shard_format(self.reading.array(field))
        return self._formats[field]

    def obj(self, field: str, shard: int) -> ShardObject:
        """Shard ``shard`` of ``field`` as this epoch reads it (its view's object)."""
        fmt = self.shard_format(field)
        assert fmt is not None
        return ShardObject(self.reading, field, shard, fmt, self.viewing.view)

    def read_rows(self, field: str, shard: int, lo: int, hi: int, out: np.ndarray) -> None:
        """Rows ``[lo, hi)`` of shard ``shard`` of ``field`` (its token rows for a per-token
        array), stored dtype, decoded into ``out`` in the calling thread (through the decoded
        chunks kept, with ``chunk_bytes``)."""
        if self.chunks is not None:
            self._chunked(field, shard, lo, hi, out)
        else:
            self._decode(field, shard, lo, hi, out)

    def _decode(self, field: str, shard: int, lo: int, hi: int, out: np.ndarray) -> None:
        if self.shard_format(field) is None:  # not in featstore's layout: zarr reads it
            spec = self.version.manifest.arrays[field]
            first = shard * (spec.tokens[0] if spec.ragged else self.version.manifest.layout.samples_per_shard)
            out[...] = self.reading.read_rows(field, first + lo, first + hi)
        else:
            self.objects.decode(self.obj(field, shard), lo, hi, out)

    def _chunk_rows(self, field: str) -> int:
        """Rows of one inner chunk of ``field``."""
        spec, fmt = self.version.manifest.arrays[field], self.shard_format(field)
        return fmt.chunk_rows if fmt is not None else spec.tokens[1] if spec.ragged \
            else self.version.manifest.layout.chunk_rows

    def _chunk(self, field: str, shard: int, c: int) -> np.ndarray:
        """Inner chunk ``c`` of shard ``shard`` of ``field``, decoded whole once (then kept)."""
        chunks, rows = self.chunks, self._chunk_rows(field)
        assert chunks is not None  # the callers'

        def decode() -> np.ndarray:
            spec = self.version.manifest.arrays[field]
            a, b = c * rows, min((c + 1) * rows, self._stored(field, shard))
            got = np.empty((b - a, *spec.shape), dtype=spec.dtype)
            self._decode(field, shard, a, b, got)
            got.flags.writeable = False  # handed out as views: nobody writes into what is kept
            return got
        return chunks.get((field, self.viewing.view, shard, c), decode)

    def _in_one_chunk(self, field: str, shard: int, lo: int, hi: int) -> np.ndarray | None:
        rows = self._chunk_rows(field)
        c = lo // rows
        return None if (hi - 1) // rows != c else self._chunk(field, shard, c)[lo - c * rows:hi - c * rows]

    def _chunked(self, field: str, shard: int, lo: int, hi: int, out: np.ndarray) -> None:
        """:meth:`read_rows` through the decoded chunks kept (each inner chunk decoded whole, once)."""
        rows = self._chunk_rows(field)
        for c in range(lo // rows, -(-hi // rows)):
            a, b = c * rows, (c + 1) * rows
            out[max(lo, a) - lo:min(hi, b) - lo] = self._chunk(field, shard, c)[max(lo, a) - a:min(hi, b) - a]

    def _stored(self, field: str, shard: int) -> int:
        """Rows shard ``shard`` of ``field`` stores: its samples, or for a per-token array their tokens."""
        start, stop = self.version.manifest.layout.shard_range(shard)
        if not self.version.manifest.arrays[field].ragged:
            return stop - start
        key = (self.viewing.view, shard)
        if key not in self._token_rows:
            self._token_rows[key] = int(self._token_index(shard)[1].sum())
        return self._token_rows[key]

    def stored_rows(self, field: str, shard: int, lo: int, hi: int) -> np.ndarray:
        """Rows ``[lo, hi)`` of shard ``shard`` of ``field`` (see :meth:`read_rows`): a new array,
        or with decoded chunks kept, rows of one chunk as a read-only view of it."""
        if self.chunks is not None and hi > lo:
            view = self._in_one_chunk(field, shard, lo, hi)
            if view is not None:
                return view
        spec = self.version.manifest.arrays[field]
        out = np.empty((hi - lo, *spec.shape), dtype=spec.dtype)
        if hi > lo:
            self.read_rows(field, shard, lo, hi, out)
        return out

    def read_tokens(self, fields: Sequence[str], pieces: Sequence[Piece]) -> dict[str, RaggedRows]:
        """The token rows of the pieces' samples, in order, in each per-token array of ``fields``
        (:func:`~featstore.read.shards._gather.sample_tokens`), decoded in the calling thread:
        what :class:`TokenSource` reads, random access, and the fill's stored shards."""
        if len(pieces) == 1:
            starts, lengths = self._token_index(pieces[0].shard)
            p = pieces[0]
            return sample_tokens(fields, starts[p.lo:p.hi], lengths[p.lo:p.hi], self.token_rows)
        index = {s: self._token_index(s) for s in {p.shard for p in pieces}}
        starts = np.concatenate([index[p.shard][0][p.lo:p.hi] for p in pieces])
        lengths = np.concatenate([index[p.shard][1][p.lo:p.hi] for p in pieces])
        return sample_tokens(fields, starts, lengths, self.token_rows)

    def sample_tokens(self, fields: Sequence[str], samples: np.ndarray) -> dict[str, RaggedRows]:
        """The token rows of ``samples`` (in that order; repeats allowed) in each per-token array
        of ``fields``: random access, every sample in one pass over the chunks it touches."""
        spp = self.version.manifest.layout.samples_per_shard
        shard = samples // spp
        starts, lengths = np.empty(len(samples), dtype=np.int64), np.empty(len(samples), dtype=np.int64)
        for s in np.unique(shard).tolist():
            at = np.flatnonzero(shard == s)
            st, ln = self._token_index(s)
            starts[at], lengths[at] = st[samples[at] - s * spp], ln[samples[at] - s * spp]
        return sample_tokens(fields, starts, lengths, self.token_rows)

    def token_rows(self, field: str, rows: np.ndarray | slice) -> np.ndarray:
        """Token rows ``rows`` of a per-token array (the version's own numbering: shard ``s``'s
        rows from ``s`` times its tokens per shard): a run of one shard's, or any rows, read
        shard by shard (with decoded chunks kept: chunk by chunk)."""
        per_shard = self.version.manifest.arrays[field].tokens[0]
        if isinstance(rows, slice):
            shard = rows.start // per_shard if rows.stop > rows.start else 0
            return self.stored_rows(field, shard, rows.start - shard * per_shard, rows.stop - shard * per_shard)
        spec = self.version.manifest.arrays[field]
        out = np.empty((len(rows), *spec.shape), dtype=spec.dtype)
        if self.chunks is not None:  # each chunk touched: its rows copied out of the decoded chunk kept
            chunks, view = self.chunks, self.viewing.view
            for s, k, at, local in self._by_chunk(rows, per_shard, self._chunk_rows(field)):
                kept = chunks.kept((field, view, s, k))  # the common case, without building a decoder
                out[at] = (self._chunk(field, s, k) if kept is None else kept)[local]
            return out
        shard = rows // per_shard
        for s in np.unique(shard).tolist():  # one read of each shard's rows the samples span
            at = np.flatnonzero(shard == s)
            lo, hi = int(rows[at].min()) - s * per_shard, int(rows[at].max()) + 1 - s * per_shard
            out[at] = self.stored_rows(field, s, lo, hi)[rows[at] - s * per_shard - lo]
        return out

    def _by_chunk(self, rows: np.ndarray, per_shard: int, unit: int) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        """``rows`` by the inner chunk holding them: ``(shard, chunk, positions, rows in the
        chunk)`` each; kept for the next array of the same rows and chunk size (the parts of an
        output are read one after another with the same rows)."""
        if self._grouped is not None and self._grouped[0] is rows and self._grouped[1] == unit:
            return self._grouped[2]
        per = -(-per_shard // unit)
        chunk = rows // per_shard * per + rows % per_shard // unit  # the version's chunk numbering
        out = []
        for c in np.unique(chunk).tolist():
            at = np.flatnonzero(chunk == c)
            s, k = divmod(c, per)
            out.append((s, k, at, rows[at] - s * per_shard - k * unit))
        self._grouped = (rows, unit, out)
        return out

    def _token_index(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """Where each sample of shard ``shard`` starts among the version's token rows, and its
        tokens (kept with the decoded chunks, for random access)."""
        def index() -> np.ndarray:
            start, stop = self.version.manifest.layout.shard_range(shard)
            return np.stack([self.stored_rows(TOKEN_START, shard, 0, stop - start).astype(np.int64),
                             self.stored_rows(TOKEN_LENGTH, shard, 0, stop - start).astype(np.int64)])
        got = index() if self.chunks is None else self.chunks.get((TOKEN_START, self.viewing.view, shard, -1), index)
        return got[0], got[1]

    def near(self, field: str, spans: Sequence[Span]) -> bool:
        """Whether reading these spans of ``field`` needs no remote storage."""
        if self.objects.local or self.shard_format(field) is None:
            return self.objects.local
        return self.objects.near(self.obj(field, p.shard) for w in spans for p in w.pieces)

    @cached_property
    def sources(self) -> list[ShardSource]:
        """Each array's source, chosen once (see the module docstring)."""
        ragged = tuple(f for f in self.fields if self.version.manifest.arrays[f].ragged)
        tokens: list[ShardSource] = [TokenSource(self, ragged)] if ragged else []
        return [self._source(f) for f in self.fields if f not in ragged] + tokens

    def _source(self, field: str) -> ShardSource:
        fmt = self.shard_format(field)
        if fmt is None:
            return DecodedSource(self, field)
        shards: PlacedShards
        local_raw = self.objects.local and not fmt.compressed  # the page cache holds it once already
        if self.memory is not None and not local_raw:
            shards = MemoryShards(self.objects, self.memory)
        elif not fmt.compressed:
            shards = StoredShards(self.objects)
        else:
            return DecodedSource(self, field)
        if arena_supported() and (not shards.stored or self.objects.files):
            return ArenaSource(self, field, shards)
        return InPlaceSource(self, field, shards, here=local_raw)

    def clear_cache(self) -> None:
        """Empty this version's entries in the node's caches (both tiers)."""
        for cache in (self.memory, self.disk):
            if cache is not None:
                cache.clear()


def default_cache_bytes() -> int:
    """Half the free space where the memory cache lives."""
    st = os.statvfs(shm_root())
    return max(1, st.f_bavail * st.f_frsize // 2)


class InThread(Executor):
    """An executor that runs each call in the calling thread (a finished future)."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return now(fn, *args, **kwargs)


def spare_cores() -> int:
    """Cores this process may use beyond its torch intra-op threads."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores - torch.get_num_threads()


def now(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
    """``fn(*args)`` run in the calling thread, as a finished future (its error kept in it)."""
    fut: Future[T] = Future()
    try:
        fut.set_result(fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - re-raised where the result is taken, as from a pool
        fut.set_exception(exc)
    return fut
