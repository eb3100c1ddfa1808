"""Where a window's rows come from, decided once per (version, array): :class:`ShardSource`
(one required method, :meth:`~ShardSource.read`), the stored sources, and the spans in flight.
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
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from featstore.codecs._ragged import TOKEN_LENGTH, TOKEN_START, RaggedRows, RaggedWindow
from featstore.format._shard_decoder import ShardFormat, shard_format
from featstore.read.plans import Piece
from featstore.read.shards import _objects
from featstore.read.shards._arena import Slot, process_arena
from featstore.read.shards._arena import supported as arena_supported
from featstore.read.shards._cache import DiskCacheOptions, NodeCache, Space, shm_root
from featstore.read.shards._gather import ArenaRows, InPlace, SpanRows, piece_tokens
from featstore.read.shards._objects import (DiskObjects, LocalObjects, MemoryShards, PlacedShards, RemoteObjects,
                                            ShardObject, ShardObjects, StoredShards, process_maps)
from featstore.versions._committed import StoredVersion

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

    def __init__(self, futures: list[Future], finish: Callable[[], dict[str, SpanRows]],
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
    """The per-token arrays: a piece's samples' tokens are one run of rows in their shard,
    found once per piece from its ``token_start``/``token_length``."""

    def __init__(self, reads: ProcessReads, fields: tuple[str, ...]) -> None:
        self.reads, self.fields = reads, fields

    def read(self, span: Span, reads: Executor) -> SpanRead:
        futs = [reads.submit(self.reads.read_tokens, self.fields, p) for p in span.pieces]
        return SpanRead(futs, lambda: {f: RaggedWindow([x.result()[f] for x in futs]) for f in self.fields})

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

    def get(self, key: tuple[str, int | None, int, int], decode: Callable[[], np.ndarray]) -> np.ndarray:
        got = self._chunks.get(key)
        if got is not None:
            self._chunks.move_to_end(key)
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
        array), stored dtype, decoded into ``out`` in the calling thread."""
        fmt = self.shard_format(field)
        if fmt is None:
            spec = self.version.manifest.arrays[field]
            first = shard * (spec.tokens[0] if spec.ragged else self.version.manifest.layout.samples_per_shard)
            out[...] = self.reading.read_rows(field, first + lo, first + hi)
        elif self.chunks is None:
            self.objects.decode(self.obj(field, shard), lo, hi, out)
        else:
            self._chunked(field, fmt, shard, lo, hi, out)

    def _chunked(self, field: str, fmt: ShardFormat, shard: int, lo: int, hi: int, out: np.ndarray) -> None:
        """:meth:`read_rows` through the decoded chunks kept (each inner chunk decoded whole, once)."""
        rows, view, chunks = fmt.chunk_rows, self.viewing.view, self.chunks
        assert chunks is not None  # read_rows' caller
        for c in range(lo // rows, -(-hi // rows)):
            a, b = c * rows, (c + 1) * rows

            def decode(a: int = a, b: int = b) -> np.ndarray:
                b = min(b, self._stored(field, shard))
                got = np.empty((b - a, *out.shape[1:]), dtype=out.dtype)
                self.objects.decode(self.obj(field, shard), a, b, got)
                return got
            chunk = chunks.get((field, view, shard, c), decode)
            out[max(lo, a) - lo:min(hi, b) - lo] = chunk[max(lo, a) - a:min(hi, b) - a]

    def _stored(self, field: str, shard: int) -> int:
        """Rows shard ``shard`` of ``field`` stores: its samples, or for a per-token array their tokens."""
        start, stop = self.version.manifest.layout.shard_range(shard)
        if not self.version.manifest.arrays[field].ragged:
            return stop - start
        key = (self.viewing.view, shard)
        if key not in self._token_rows:
            self._token_rows[key] = int(self.stored_rows(TOKEN_LENGTH, shard, 0, stop - start).sum(dtype=np.int64))
        return self._token_rows[key]

    def stored_rows(self, field: str, shard: int, lo: int, hi: int) -> np.ndarray:
        """Rows ``[lo, hi)`` of shard ``shard`` of ``field``, as a new array (see :meth:`read_rows`)."""
        spec = self.version.manifest.arrays[field]
        out = np.empty((hi - lo, *spec.shape), dtype=spec.dtype)
        if hi > lo:
            self.read_rows(field, shard, lo, hi, out)
        return out

    def read_tokens(self, fields: Sequence[str], piece: Piece) -> dict[str, RaggedRows]:
        """The token rows of ``piece``'s samples in each per-token array of ``fields``, found
        from their ``token_start``/``token_length`` (one run of rows in the shard), decoded in
        the calling thread: what :class:`TokenSource` reads, and the fill's stored shards."""
        spec = self.version.manifest.arrays
        lengths = self.stored_rows(TOKEN_LENGTH, piece.shard, piece.lo, piece.hi)
        first = 0
        if piece.size and fields:
            start = self.stored_rows(TOKEN_START, piece.shard, piece.lo, piece.lo + 1)
            first = int(start[0]) - piece.shard * spec[fields[0]].tokens[0]
        return piece_tokens(fields, lengths, first, lambda f, lo, hi: self.stored_rows(f, piece.shard, lo, hi))

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


# -- spans in flight -------------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamSources:
    """One stream's sources in this process (a version's arrays, or several teachers' under
    their labels), and what the rows' sample index is computed with."""

    sources: Sequence[ShardSource]
    samples_per_shard: int

    def index(self, span: Span) -> np.ndarray:
        """The sample index of each of ``span``'s rows, in read order."""
        spp = self.samples_per_shard
        return np.concatenate([np.zeros(0, dtype=np.int64)] + [np.arange(p.shard * spp + p.lo, p.shard * spp + p.hi,
                                                                         dtype=np.int64) for p in span.pieces])


#: Per stream, the span of one window to read (None: the window reads nothing of that stream).
Unit = tuple[Span | None, ...]
#: Per stream, the rows read of one unit (None where it read nothing), ``"index"`` among them.
UnitRows = list[dict[str, SpanRows] | None]


def spans_in_flight(streams: Sequence[StreamSources], reads: Executor, units: Iterable[Unit],
                    prefetch: int) -> Iterator[UnitRows]:
    """Keeps units (one window's spans of every stream) in flight over the streams' sources and
    yields each once all its reads are done (a window is permuted as a whole, so it is only
    usable once complete).

    Every (piece, array) is its own read, so one shard's arrays are fetched concurrently;
    ``reads`` (``prefetch`` pool threads) issues them. The next unit's reads are always in
    flight while the current one is consumed, so S3 latency hides behind Model B instead of
    adding up window by window. Every read decodes straight into its rows: no concatenation.
    """
    todo = iter(units)
    queue = deque[tuple[int, list[tuple[np.ndarray, list[SpanRead]] | None]]]()

    def fill() -> None:
        """Keep ``prefetch`` pieces in flight (the queued units'), and the next two units at least."""
        while sum(n for n, _ in queue) < prefetch or len(queue) < 2:
            unit = next(todo, None)
            if unit is None:
                return
            started = [None if span is None else (stream.index(span), [s.read(span, reads) for s in stream.sources])
                       for stream, span in zip(streams, unit, strict=True)]
            queue.append((sum(len(span.pieces) for span in unit if span is not None), started))

    current: list[SpanRead] = []
    try:
        fill()
        while queue:
            _, started = queue.popleft()
            rows: UnitRows = []
            current = [r for got in started if got is not None for r in got[1]]
            for got in started:
                arrays: dict[str, SpanRows] | None = None
                if got is not None:
                    arrays = {"index": got[0]}
                    for r in got[1]:
                        arrays.update(r.result())
                rows.append(arrays)
            fill()
            yield rows
            for r in current:  # the consumer has cut every batch of this unit
                r.close()
            current = []
    finally:
        for r in current:
            r.close()
        for _, queued in queue:  # an abandoned epoch: do not read what nobody will use
            for got in queued:
                for r in () if got is None else got[1]:
                    r.close()


def read_spans(streams: Sequence[StreamSources], epochs: Sequence[Epoch], units: Iterable[Unit],
               prefetch: int) -> Iterator[UnitRows]:
    """The epoch's units from the streams' sources (``epochs``: what each stream's sources learn
    when the iteration starts), read ahead on a pool of ``prefetch`` threads, or in the calling
    thread when no core is spare and nothing is remote: pool threads would only take turns with
    Model B's torch threads (measured slower)."""
    begun: list[ShardSource] = []
    finished = False
    try:
        for stream, epoch in zip(streams, epochs, strict=True):
            for s in stream.sources:
                s.begin(epoch)
                begun.append(s)
        here = spare_cores() < 1 and all(s.near(epoch.todo) for stream, epoch in zip(streams, epochs, strict=True)
                                         for s in stream.sources)
        with InThread() if here else ThreadPoolExecutor(prefetch, thread_name_prefix="featstore-read") as reads:
            yield from spans_in_flight(streams, reads, units, prefetch)
        finished = True
    finally:
        for s in begun:
            s.end(finished)


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
