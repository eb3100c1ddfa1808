"""Reading one shard's rows in a process: mapped in place, the shared decoded cache, the node's
disk tier, the arena; this process's mapped objects (:func:`process_maps`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from featstore.read._arena import Arena, Slot, process_arena
from featstore.read._memory_cache import CacheOptions, MappedFiles, SharedCache, default_root
from featstore.read._disk_cache import ENTRY_TRAILER
from featstore.read._disk_tier import DiskObjects
from featstore.errors import CorruptChunk
from featstore.format._shard_decoder import (ChunkRef, ShardFormat, decode_shard_rows, mapped_chunks, shard_format,
                                             shard_index_bytes)
from featstore.read._gather import ArenaRows, InPlace
from featstore.codecs._ragged import (TOKEN_LENGTH, TOKEN_START, RaggedRows)
from featstore.read._assignment import Piece
from featstore.versions._committed import StoredVersion, missing_data_error

T = TypeVar("T")



#: costs about as much as copying them, so a version up to this size is mapped once per process.
MAPPED_BYTES = 256 * 2**20
_MAPS: tuple[int, MappedFiles] | None = None
_MAPS_LOCK = threading.Lock()


def process_maps() -> MappedFiles:
    """This process's mapped shard objects, shared by all its readers (so each chunk's crc32c
    is checked once per process); a forked child starts its own (a lock may have been held
    by another thread at the fork)."""
    global _MAPS
    with _MAPS_LOCK:
        if _MAPS is None or _MAPS[0] != os.getpid():
            _MAPS = (os.getpid(), MappedFiles(MAPPED_BYTES))
        return _MAPS[1]


class ProcessState:
    """What one process reads with: its own storage (an fsspec filesystem is neither fork- nor
    loop-safe), the shard formats, mapped shard objects,
    and its handle on the shared cache."""

    def __init__(self, version: StoredVersion) -> None:
        self.pid = os.getpid()
        self.storage = version.storage.reopen()
        self.formats: dict[str, ShardFormat | None] = {}
        self.maps = process_maps()
        self.cache: SharedCache | None = None
        self.disk: DiskObjects | None = None


def default_cache_bytes() -> int:
    """Half the free space where the shared cache lives."""
    st = os.statvfs(default_root())
    return max(1, st.f_bavail * st.f_frsize // 2)
class ShardReads:
    """How a :class:`FeatureDataset` reads one shard's rows, in this process: mapped in place
    (local, uncompressed), through the shared decoded-shard cache, the node's disk tier, the
    arena, or a plain read; every chunk checked. A part of :class:`FeatureDataset` (its
    ``version``, ``options`` and process state), kept apart because it is its own job."""

    @property
    def _proc(self) -> ProcessState:
        if self._state is None or self._state.pid != os.getpid():
            self._state = ProcessState(self.version)
        return self._state

    def _shard_format(self, field: str) -> ShardFormat | None:
        """The field's shard format when the fast path can read it (cached per process)."""
        formats = self._proc.formats
        if field not in formats:
            # every view has the same layout: one format per field
            formats[field] = shard_format(self._viewing.reading.array(field))
        return formats[field]

    def _in_place(self, field: str) -> bool:
        """Whether the field's pieces are read where they lie (a mapped local object, an
        uncompressed object as fetched, or the shared cache) rather than copied into a window
        buffer."""
        fmt = self._shard_format(field)
        return (fmt is not None and not self.version.manifest.arrays[field].ragged
                and (self._memory or not fmt.compressed))

    def _shared_cache(self) -> SharedCache:
        st = self._proc
        if st.cache is None:
            storage = self.version.storage
            where = os.path.abspath(storage.root) if storage.is_local else storage.url
            identity = f"{where}|{self.version.key}|{self.version.id}"
            st.cache = SharedCache.open(CacheOptions(self._cache_bytes), identity)
            st.cache.trim(self._cache_bytes)
        return st.cache

    def _disk_objects(self) -> DiskObjects | None:
        """This process's reads through the disk tier, or None (no disk tier, or a local store)."""
        if self._disk is None:
            return None
        st = self._proc
        if st.disk is None:
            st.disk = DiskObjects(self.version, st.storage, *self._disk, st.maps)
        return st.disk

    def clear_cache(self) -> None:
        """Empty this version's caches for every process on the machine: the shared memory
        (``cache="memory"``) and the disk tier's entries (``cache="disk"``); the next reads
        decode from storage again (a process keeps what it has mapped).

        >>> ds = store.dataset("cnn-a/train", cache="memory", cache_bytes=8 * 2**30)
        >>> ds.clear_cache()
        """
        if self._memory:
            self._shared_cache().clear()
        disk = self._disk_objects()
        if disk is not None:
            disk.cache.clear()

    def _with_object(self, ref: ChunkRef, shard: int, use: Callable[[Any], T], keep: bool = True) -> T:
        """``use(bytes)`` of one shard object: through the disk tier when there is one (a damaged
        cache entry is fetched again), else :meth:`_object`."""
        disk = self._disk_objects()
        if disk is None:
            return use(self._object(ref, shard, keep))
        fmt = self._shard_format(ref.array)
        assert fmt is not None
        return disk.use(self._object_key(ref, shard), ref, fmt, use, keep)

    def _object(self, ref: ChunkRef, shard: int, keep: bool = True) -> Any:
        """One shard object's bytes: mapped for a local store (no copy), else read whole.
        ``keep=False``: read once (decoded into the shared cache), so not kept mapped."""
        st = self._proc
        key = self._object_key(ref, shard)
        if st.storage.is_local:
            try:
                data: Any = st.maps.get(st.storage.path(key), keep)
            except FileNotFoundError:
                data = None
        else:
            data = st.storage.read_bytes(key)
        if data is None or len(data) == 0:
            raise missing_data_error(self.version, ref, data)
        return data

    def _object_key(self, ref: ChunkRef, shard: int) -> str:
        # a base's folder for an inherited shard; this epoch's view's group with views
        return self._viewing.reading.object_key(ref.array, shard)

    def _source(self, piece: Piece, field: str, data: Any = None) -> np.ndarray:
        """The piece's whole shard as ``(chunks, chunk_rows, *row)``: mapped in place (local,
        uncompressed) or decoded once per machine into the shared cache.

        A mapped chunk's crc32c is checked once per map, not on every epoch (that cost ~0.12 of
        a read-only epoch, docs/benchmarks.md): a file rewritten or replaced since is mapped
        afresh and checked again; what a map no longer covers is a damage below the page cache
        after the check, which ``verify()`` finds."""
        fmt = self._shard_format(field)
        assert fmt is not None
        ref = ChunkRef(self.version.ref, field, self._viewing.reading.chunk_key(field, piece.shard))
        start, stop = self.version.manifest.layout.shard_range(piece.shard)
        n = -(-(stop - start) // fmt.chunk_rows)
        if not fmt.compressed and not self._memory and not self._proc.storage.is_local:
            return self._fetched(piece, field, fmt, n, ref, data)
        if self._proc.storage.is_local and not fmt.compressed:
            data = self._object(ref, piece.shard)
            checked = self._proc.maps.checked(self._proc.storage.path(self._object_key(ref, piece.shard)), data)
            todo = [c for c in range(piece.lo // fmt.chunk_rows, -(-piece.hi // fmt.chunk_rows)) if c not in checked]
            arr = mapped_chunks(data, fmt, n, todo, ref)
            if arr is not None:
                checked.update(todo)
                return arr
        return self._cached(fmt, n, ref, piece.shard)

    def _arena_rows(self, window: tuple[Piece, ...], field: str, held: list[str] | None = None) -> ArenaRows | InPlace:
        """A window's pieces of an array held in this process's arena (one ``index_select`` per
        batch, :mod:`featstore.read`): the stored objects of an uncompressed array (a local
        store's files, or the disk tier's entries), else the decoded shards of the shared cache.
        Shard by shard (:meth:`_source`) when a shard does not fit a slot, is not laid out back
        to back, or cannot be cached."""
        fmt = self._shard_format(field)
        assert fmt is not None
        disk = None if self._memory else self._disk_objects()
        stored = not fmt.compressed and (self._proc.storage.is_local or disk is not None)
        per_chunk = fmt.stored_stride if stored else fmt.chunk_rows * fmt.row_bytes
        tail = shard_index_bytes(fmt) + (ENTRY_TRAILER if disk is not None else 0)
        arena = process_arena(fmt.chunks_per_shard * per_chunk + tail * stored, MAPPED_BYTES)
        # the disk tier's entry of each piece (``held``: known to be there), or the bytes fetched
        # for one that could not be kept
        entries: list[Any] | None = held or (
            [disk.entry(*self._entry_args(p, field, fmt)) for p in window] if stored and disk else None)
        if arena is not None and (entries is None or all(isinstance(e, str) for e in entries)):
            slots: list[Slot] = []
            try:
                for i, piece in enumerate(window):
                    slot = (self._pin_cached(arena, piece, field, fmt) if not stored
                            else self._pin(arena, piece, field, fmt, None if entries is None else entries[i]))
                    if slot is None:
                        break
                    slots.append(slot)
                else:
                    return ArenaRows(arena, slots, window, fmt, stored)
            except BaseException:
                for slot in slots:
                    arena.unpin(slot)
                raise
            for slot in slots:  # a shard that cannot be held: this window is read shard by shard
                arena.unpin(slot)
        fetched = [None if entries is None or isinstance(e, str) else e for e in entries or window]
        return InPlace([self._source(p, field, data) for p, data in zip(window, fetched, strict=True)],
                       window, fmt.chunk_rows)

    def _disk_holds(self, todo: list[tuple[int, int, tuple[Piece, ...]]]) -> bool:
        """Whether the disk tier holds every shard object these windows read (then an epoch reads
        no storage, as from a local store)."""
        disk = self._disk_objects()
        if disk is None or any(self._shard_format(f) is None or self.version.manifest.arrays[f].ragged
                               for f in self.fields):
            return False
        shards = sorted({p.shard for _, _, window in todo for p in window})
        return all(disk.holds(self._viewing.reading.object_key(f, s)) for f in self.fields for s in shards)

    def _entries_held(self, window: tuple[Piece, ...], field: str) -> list[str] | None:
        """The disk tier's file of every piece's shard object of ``field``, or None when it does
        not hold them all now."""
        disk = self._disk_objects()
        assert disk is not None
        paths = [disk.holds(self._viewing.reading.object_key(field, p.shard)) for p in window]
        return paths if all(paths) else None  # type: ignore[return-value]

    def _entry_args(self, piece: Piece, field: str, fmt: ShardFormat) -> tuple[str, ChunkRef, ShardFormat]:
        ref = ChunkRef(self.version.ref, field, self._viewing.reading.chunk_key(field, piece.shard))
        return self._object_key(ref, piece.shard), ref, fmt

    def _pin_cached(self, arena: Arena, piece: Piece, field: str, fmt: ShardFormat) -> Slot | None:
        """The piece's decoded shard, from the shared cache (decoded and inserted on a miss),
        held in ``arena``; None when it cannot be cached (then read shard by shard)."""
        ref = ChunkRef(self.version.ref, field, self._viewing.reading.chunk_key(field, piece.shard))
        cache = self._shared_cache()
        key = self._cache_key(ref, piece.shard)
        for attempt in range(2):
            try:
                slot = arena.pin(cache.path(key))
            except FileNotFoundError:  # a miss (or evicted by another process meanwhile)
                slot = None
            except OSError:  # no memory map left: read shard by shard
                return None
            if slot is not None:
                cache.touch(key)
                return slot
            if attempt == 0:
                start, stop = self.version.manifest.layout.shard_range(piece.shard)
                self._cached(fmt, -(-(stop - start) // fmt.chunk_rows), ref, piece.shard)
                arena.drop_stale()  # what the insert evicted: free its memory in this process too
        return None

    def _pin(self, arena: Arena, piece: Piece, field: str, fmt: ShardFormat, entry: str | None = None) -> Slot | None:
        """The piece's shard object (a local store's file, or ``entry``: its disk tier file) held
        in ``arena``, its layout and the piece's chunks checked (crc32c once per mapping, as in
        :meth:`_source`); None: read it shard by shard (that path says why a missing object is
        missing, and fetches a damaged disk entry again)."""
        ref = ChunkRef(self.version.ref, field, self._viewing.reading.chunk_key(field, piece.shard))
        try:
            slot = arena.pin(entry or self._proc.storage.path(self._object_key(ref, piece.shard)))
        except OSError:  # missing (that path says why), or no memory map left: read shard by shard
            return None
        if slot is None:
            return None
        try:
            view = arena.view(slot)
            if entry is not None:  # the trailer off (None: torn); a damaged entry is fetched again
                view = self._disk_objects().body(view, self._object_key(ref, piece.shard))  # type: ignore[union-attr]
            todo = [c for c in range(piece.lo // fmt.chunk_rows, -(-piece.hi // fmt.chunk_rows))
                    if c not in slot.checked]
            if view is not None and (todo or not slot.checked):
                start, stop = self.version.manifest.layout.shard_range(piece.shard)
                if mapped_chunks(view, fmt, -(-(stop - start) // fmt.chunk_rows), todo, ref) is None:
                    view = None  # not laid out back to back
            if view is None:
                arena.unpin(slot)
                return None
            slot.checked.update(todo)
        except CorruptChunk:
            arena.unpin(slot)
            if entry is None:
                raise
            self._disk_objects().discard(self._object_key(ref, piece.shard))  # type: ignore[union-attr]
            return None
        except BaseException:
            arena.unpin(slot)
            raise
        return slot

    def _fetched(self, piece: Piece, field: str, fmt: ShardFormat, n: int, ref: ChunkRef,
                 data: Any = None) -> np.ndarray:
        """An uncompressed shard of a remote store as ``(chunks, chunk_rows, *row)``: batches
        gather straight from the fetched object's bytes once the piece's chunks pass their
        crc32c (no copy into a window buffer). A piece needing only a few of the shard's chunks
        reads just those (:meth:`Version.read_shard_rows`) into an array of the shard's shape
        whose other rows are never touched."""
        c0, c1 = piece.lo // fmt.chunk_rows, -(-piece.hi // fmt.chunk_rows)
        full = np.empty((n * fmt.chunk_rows, *fmt.row_shape), dtype=fmt.dtype)
        if data is None and self._disk is None and 2 * (c1 - c0) <= fmt.chunks_per_shard:  # a few chunks, by range
            self._read_field(piece, field, full[piece.lo:piece.hi])
            return full.reshape(n, fmt.chunk_rows, *fmt.row_shape)

        def gather(data: Any) -> np.ndarray:
            if (arr := mapped_chunks(data, fmt, n, range(c0, c1), ref)) is not None:
                return arr
            # fetched whole, chunks not back to back: decoded from those bytes
            decode_shard_rows(data, fmt, piece.lo, piece.hi, full[piece.lo:piece.hi], ref)
            return full.reshape(n, fmt.chunk_rows, *fmt.row_shape)

        return gather(data) if data is not None else self._with_object(ref, piece.shard, gather)

    def _cache_key(self, ref: ChunkRef, shard: int) -> str:
        return f"{ref.array}.{shard}" + ("" if self._viewing.view is None else f".v{self._viewing.view}")

    def _cached(self, fmt: ShardFormat, n: int, ref: ChunkRef, shard: int) -> np.ndarray:
        """The shard decoded, from the shared cache (decoded and inserted on a miss; kept by
        this process alone when it cannot fit)."""
        shape = (n, fmt.chunk_rows, *fmt.row_shape)
        dtype = np.dtype(fmt.dtype)

        cache = self._shared_cache() if self._memory else None

        def decode(out: np.ndarray) -> None:  # raises on a bad crc32c: nothing is cached then
            # With the cache, the stored object is read to be decoded once per machine: its
            # mapping is dropped with the last reference, not kept resident in this process.
            self._with_object(ref, shard, lambda data: decode_shard_rows(
                data, fmt, 0, n * fmt.chunk_rows, out.reshape(n * fmt.chunk_rows, *fmt.row_shape), ref),
                keep=cache is None)

        key = self._cache_key(ref, shard)
        view = cache.get(key) if cache is not None else None
        if view is None and cache is not None:
            view = cache.put(key, int(np.prod(shape)) * dtype.itemsize,
                             lambda buf: decode(np.frombuffer(buf, dtype=dtype).reshape(shape)), self._cache_bytes)
        if view is None:
            out = np.empty(shape, dtype=dtype)
            decode(out)
            return out
        return np.frombuffer(view, dtype=dtype).reshape(shape)

    def _read_field(self, piece: Piece, field: str, out: np.ndarray, tokens: bool = False) -> None:
        """Rows of one piece of one array, stored dtype, written into ``out``.

        Fast path: the shard object read whole (one GET on S3), or by range when the piece
        needs only a few of its chunks (see :meth:`Version.read_shard_rows`), decoded here, in the
        calling reader thread, so decoding runs in parallel across threads (zstd and crc32c
        release the GIL) instead of queueing on zarr's single event-loop thread. Arrays in any
        other layout are read through zarr.
        """
        start = piece.shard * self.version.manifest.layout.samples_per_shard
        fmt = self._shard_format(field)
        reading = self._viewing.reading  # this epoch's view (the version itself without views)
        if fmt is None and not tokens:
            out[...] = reading.read_rows(field, start + piece.lo, start + piece.hi)
            return
        if not self._proc.storage.is_local and self._disk is None:  # whole object, or by range for a few chunks
            reading.read_shard_rows(self._proc.storage, field, fmt, piece.shard, piece.lo, piece.hi, out)
            return
        ref = ChunkRef(self.version.ref, field, reading.chunk_key(field, piece.shard))
        self._with_object(ref, piece.shard, lambda data: decode_shard_rows(data, fmt, piece.lo, piece.hi, out, ref))

    def _read_tokens(self, piece: Piece, fields: tuple[str, ...]) -> dict[str, RaggedRows]:
        """A piece's token rows of each per-token array in ``fields``: the piece's samples'
        tokens are one run of rows in their shard, found once from the piece's
        ``token_start``/``token_length``."""
        spec = self.version.manifest.arrays
        lengths = np.empty(piece.size, dtype=spec[TOKEN_LENGTH].dtype)
        starts = np.empty(piece.size, dtype=spec[TOKEN_START].dtype)
        self._read_field(piece, TOKEN_LENGTH, lengths)
        self._read_field(piece, TOKEN_START, starts)
        out = {}
        for field in fields:
            first = piece.shard * spec[field].tokens[0]
            lo = int(starts[0]) - first if piece.size else 0
            hi = lo + int(lengths.sum(dtype=np.int64))
            rows = np.empty((hi - lo, *spec[field].shape), dtype=spec[field].dtype)
            if hi > lo and self._shard_format(field) is None:
                rows[...] = self._viewing.reading.read_rows(field, first + lo, first + hi)
            elif hi > lo:
                self._read_field(Piece(piece.shard, lo, hi), field, rows, tokens=True)
            out[field] = RaggedRows(rows, lengths)
        return out
