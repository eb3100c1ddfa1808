"""Where one process gets a version's shard objects (:class:`ShardObjects`: a local store's files
mapped in place, a remote store's objects fetched, or those kept in the node's disk cache), and
the shards an array is gathered from where they lie (:class:`PlacedShards`: the stored objects of
an uncompressed array, or the decoded shards in the node's memory cache).

Every chunk is checked: a mapped chunk's crc32c once per mapping (not on every epoch: that cost
~0.12 of a read-only epoch, docs/benchmarks.md), a fetched or decoded one on every read. A file
rewritten or replaced since is mapped afresh and checked again; what a map no longer covers is
a damage below the page cache after the check, which ``verify()`` finds.
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import TypeVar

import numpy as np

from featstore._json import canonical_json
from featstore.errors import CorruptChunk
from featstore.format import ChunkRef, ShardFormat, decode_shard_rows, mapped_chunks, shard_index_bytes, shard_intact
from featstore.read.shards._arena import Arena, Slot
from featstore.read.plans._assignment import Piece
from featstore.read.shards._cache import ENTRY_TRAILER, MappedFiles, NodeCache, digest, process_local
from featstore.storage import Storage
from featstore.versions import StoredVersion, missing_data_error

T = TypeVar("T")
Buffer = bytes | memoryview

#: Bytes of local shard objects one process keeps mapped: faulting a mapping's pages in again
#: costs about as much as copying them, so a version up to this size is mapped once per process.
MAPPED_BYTES = 256 * 2**20


def process_maps() -> MappedFiles:
    """This process's mapped shard objects, shared by all its readers (so each chunk's crc32c
    is checked once per process)."""
    return process_local(("maps",), lambda: MappedFiles(MAPPED_BYTES))


def scope_identity(version: StoredVersion) -> str:
    """What names one commit of one version of one store in the node's caches, and nothing
    else: the store's URL and endpoint, the version's key and id, and its manifest's digest (a
    version deleted and recomputed under the same id has another manifest)."""
    digest = hashlib.sha256(canonical_json(version.manifest.to_json())).hexdigest()
    return f"{version.storage.identity}|{version.key}|{version.id}|{digest}"


def entry_name(key: str) -> str:
    """The disk cache entry's name of the object at store key ``key`` (inside its version's scope)."""
    return digest(key, 40)


@dataclass(frozen=True, eq=False)
class ShardObject:
    """One shard object of one array as this epoch reads it: ``version`` is bound to the
    epoch's view (``view``), so its key and the name errors give are that view's."""

    version: StoredVersion
    field: str
    shard: int
    fmt: ShardFormat
    view: int | None = None

    @cached_property
    def key(self) -> str:
        return self.version.object_key(self.field, self.shard)

    @cached_property
    def ref(self) -> ChunkRef:
        return ChunkRef(self.version.ref, self.field, self.version.chunk_key(self.field, self.shard))

    @cached_property
    def chunks(self) -> int:
        """Chunks that hold the shard's rows."""
        start, stop = self.version.manifest.layout.shard_range(self.shard)
        return -(-(stop - start) // self.fmt.chunk_rows)

    def chunk_range(self, piece: Piece) -> range:
        return range(piece.lo // self.fmt.chunk_rows, -(-piece.hi // self.fmt.chunk_rows))

    @property
    def shape(self) -> tuple[int, ...]:
        """The shard as ``(chunks, chunk_rows, *row)``."""
        return (self.chunks, self.fmt.chunk_rows, *self.fmt.row_shape)

    def empty(self) -> np.ndarray:
        """An uninitialised array of :attr:`shape` and the stored dtype."""
        return np.empty(self.shape, dtype=self.fmt.dtype)


# -- where the objects come from ------------------------------------------------------------------
@dataclass(eq=False)
class ShardObjects(ABC):
    """Where one process gets a version's shard objects, whole: decided once per process."""

    version: StoredVersion
    storage: Storage

    #: the objects are files of this node (a local store's): no latency to hide
    local = False
    #: whether a piece needing a few of a shard's chunks reads just those (by range) in place
    ranged = False
    #: bytes a file of :meth:`file` holds beyond the object (the disk cache's trailer)
    extra = 0

    @abstractmethod
    def use(self, obj: ShardObject, fn: Callable[[Buffer], T], keep: bool = True) -> T:
        """``fn(the object's bytes)``; a missing object is :func:`missing_data_error`'s.
        ``keep=False``: bytes read once (decoded into the memory cache) are not kept mapped."""

    def decode(self, obj: ShardObject, lo: int, hi: int, out: np.ndarray) -> None:
        """Rows ``[lo, hi)`` of the object decoded into ``out``, in the calling thread (zstd and
        crc32c release the GIL, so reader threads decode in parallel)."""
        self.use(obj, lambda data: decode_shard_rows(data, obj.fmt, lo, hi, out, obj.ref))

    def near(self, objs: Iterable[ShardObject]) -> bool:
        """Whether reading these needs no remote storage (then, with no core to spare, reads
        run in the consuming thread: there is no latency to hide)."""
        return self.local

    @property
    def files(self) -> bool:
        """Whether :meth:`file` can give objects as files (to map into the arena)."""
        return self.local

    def file(self, obj: ShardObject) -> str | None:
        """The object as a file on this node now (to map into the arena), else None."""
        return None

    def body(self, view: memoryview, obj: ShardObject) -> memoryview | None:
        """The object in a mapped :meth:`file` (None: torn, and removed)."""
        return view

    def discard(self, obj: ShardObject) -> bool:
        """A :meth:`file` failed its checks: drop that copy, to be fetched again (False: the
        file is the store's own object: nothing to drop)."""
        return False

    def checked(self, obj: ShardObject, data: Buffer) -> set[int]:
        """The chunks of ``data`` (from :meth:`use`) already checked in this process; the
        caller adds those it checks. Bytes not kept mapped get a fresh set."""
        return set()

    def _fetch(self, obj: ShardObject) -> Buffer:
        data = self.storage.read_buffer(obj.key)
        if not data:
            raise missing_data_error(self.version, obj.ref, data)
        return data


@dataclass(eq=False)
class LocalObjects(ShardObjects):
    """A local store's shard objects, mapped in place (no read, no copy)."""

    maps: MappedFiles
    local = True

    def use(self, obj: ShardObject, fn: Callable[[Buffer], T], keep: bool = True) -> T:
        try:
            data: Buffer | None = self.maps.get(self.storage.path(obj.key), keep)[0]
        except FileNotFoundError:
            data = None
        if not data:
            raise missing_data_error(self.version, obj.ref, data)
        return fn(data)

    def file(self, obj: ShardObject) -> str:
        return self.storage.path(obj.key)

    def checked(self, obj: ShardObject, data: Buffer) -> set[int]:
        return self.maps.checked(self.storage.path(obj.key), data)  # type: ignore[arg-type]


class RemoteObjects(ShardObjects):
    """A remote store's shard objects, fetched whole (one GET), or by range for a few chunks."""

    ranged = True

    def use(self, obj: ShardObject, fn: Callable[[Buffer], T], keep: bool = True) -> T:
        return fn(self._fetch(obj))

    def decode(self, obj: ShardObject, lo: int, hi: int, out: np.ndarray) -> None:
        obj.version.read_shard_rows(self.storage, obj.field, obj.fmt, obj.shard, lo, hi, out)


@dataclass(eq=False)
class DiskObjects(ShardObjects):
    """A remote store's shard objects through the node's disk cache: cached whole (a piece that
    needs a few chunks still fetches its object once: the consumer next to it reads the rest,
    the next epoch all of it), and only a whole object that passes every crc32c. Bytes from the
    cache that fail the decoder's checks are dropped and fetched again: only the store's own
    copy failing raises :class:`CorruptChunk`."""

    cache: NodeCache
    extra = ENTRY_TRAILER

    def use(self, obj: ShardObject, fn: Callable[[Buffer], T], keep: bool = True) -> T:
        name = entry_name(obj.key)
        data, cached = self._get(obj, name, keep)
        if cached:
            try:
                return fn(data)
            except CorruptChunk:  # damaged or torn on the node's disk: never served
                self.cache.discard(name)
            data, _ = self._get(obj, name, keep)
        return fn(data)

    def _get(self, obj: ShardObject, name: str, keep: bool) -> tuple[Buffer, bool]:
        """The object from the cache (True), or fetched (False) and kept when whole and it fits.
        A miss takes the fetch lock and looks again first: one GET per object on the node."""
        view = self.cache.get(name, keep)
        if view is not None:
            return view, True
        with self.cache.fetch_lock(name):
            view = self.cache.get(name, keep)
            if view is not None:
                return view, True
            data = self._fetch(obj)
            if shard_intact(data, obj.fmt):
                self.cache.put(name, len(data), lambda buf: buf.__setitem__(slice(None), data))
        return data, False

    def near(self, objs: Iterable[ShardObject]) -> bool:
        return all(self.cache.holds(entry_name(o.key)) for o in objs)

    @property
    def files(self) -> bool:
        # under "lru" an entry could go between its fetch and its mapping, and be fetched twice
        return self.cache.policy == "keep"

    def file(self, obj: ShardObject) -> str | None:
        return self.cache.holds(entry_name(obj.key))

    def body(self, view: memoryview, obj: ShardObject) -> memoryview | None:
        return self.cache.body(view, entry_name(obj.key))

    def discard(self, obj: ShardObject) -> bool:
        self.cache.discard(entry_name(obj.key))
        return True


# -- shards gathered where they lie ---------------------------------------------------------------
@dataclass(eq=False)
class PlacedShards(ABC):
    """An array's shards gathered where they lie, never copied into a window buffer: each as a
    ``(chunks, chunk_rows, *row)`` array (:meth:`array`), or its file mapped into the arena
    (:meth:`pin`), so a batch of the array is one ``index_select`` over its window's shards."""

    objects: ShardObjects

    #: slots hold stored objects (each chunk followed by its crc32c), else decoded shards
    stored = True

    @abstractmethod
    def array(self, obj: ShardObject, piece: Piece) -> np.ndarray:
        """The piece's shard as ``(chunks, chunk_rows, *row)``, its rows checked."""

    @abstractmethod
    def pin(self, arena: Arena, obj: ShardObject, piece: Piece) -> Slot | np.ndarray | None:
        """The piece's shard held in ``arena`` (its rows checked); or the rows, read, that could
        not be held; None: read it with :meth:`array` (that path says why)."""

    @abstractmethod
    def slot_bytes(self, fmt: ShardFormat) -> int:
        """Bytes of an arena slot that holds one shard."""

    def ready(self, objs: Iterable[ShardObject]) -> bool:
        """Whether these shards can be pinned without waiting for storage."""
        return True


class StoredShards(PlacedShards):
    """The stored objects of an uncompressed array: a local store's files or the disk cache's
    entries mapped, or a remote store's objects as fetched."""

    def array(self, obj: ShardObject, piece: Piece) -> np.ndarray:
        chunks = obj.chunk_range(piece)
        if self.objects.ranged and 2 * len(chunks) <= obj.fmt.chunks_per_shard:
            full = obj.empty()  # a few chunks, by range; the shard's other rows are never touched
            self.objects.decode(obj, piece.lo, piece.hi, full.reshape(-1, *obj.fmt.row_shape)[piece.lo:piece.hi])
            return full

        def gather(data: Buffer) -> np.ndarray:
            checked = self.objects.checked(obj, data)
            todo = [c for c in chunks if c not in checked]
            arr = mapped_chunks(data, obj.fmt, obj.chunks, todo, obj.ref)
            if arr is not None:
                checked.update(todo)
                return arr
            full = obj.empty()  # chunks not back to back: decoded from those bytes
            decode_shard_rows(data, obj.fmt, piece.lo, piece.hi,
                              full.reshape(-1, *obj.fmt.row_shape)[piece.lo:piece.hi], obj.ref)
            return full

        return self.objects.use(obj, gather)

    def pin(self, arena: Arena, obj: ShardObject, piece: Piece) -> Slot | None:
        path = self.objects.file(obj)
        try:
            slot = arena.pin(path) if path is not None else None
        except OSError:  # missing (the other path says why), or no memory map left
            return None
        if slot is None:
            return None
        try:
            view = self.objects.body(arena.view(slot), obj)
            todo = [c for c in obj.chunk_range(piece) if c not in slot.checked]
            if view is not None and (todo or not slot.checked) and \
                    mapped_chunks(view, obj.fmt, obj.chunks, todo, obj.ref) is None:
                view = None  # not laid out back to back
        except BaseException as exc:
            arena.unpin(slot)
            # a cached copy is fetched again; the store's own is damaged
            if not isinstance(exc, CorruptChunk) or not self.objects.discard(obj):
                raise
            return None
        if view is None:
            arena.unpin(slot)
            return None
        slot.checked.update(todo)
        return slot

    def slot_bytes(self, fmt: ShardFormat) -> int:
        return fmt.chunks_per_shard * fmt.stored_stride + shard_index_bytes(fmt) + self.objects.extra

    def ready(self, objs: Iterable[ShardObject]) -> bool:
        return all(self.objects.file(o) is not None for o in objs)


@dataclass(eq=False)
class MemoryShards(PlacedShards):
    """Decoded shards in the node's memory cache (``/dev/shm``): one file per shard, decoded
    once per machine and mapped by every process; a shard that does not fit is decoded for
    this process alone."""

    cache: NodeCache
    stored = False

    @staticmethod
    def name(obj: ShardObject) -> str:
        return f"{obj.field}.{obj.shard}" + ("" if obj.view is None else f".v{obj.view}")

    def array(self, obj: ShardObject, piece: Piece | None = None) -> np.ndarray:
        rows = obj.chunks * obj.fmt.chunk_rows

        def decode(out: np.ndarray) -> None:  # raises on a bad crc32c: nothing is cached then
            # read to be decoded once per machine: the stored object is not kept mapped here
            self.objects.use(obj, lambda data: decode_shard_rows(
                data, obj.fmt, 0, rows, out.reshape(rows, *obj.fmt.row_shape), obj.ref), keep=False)

        shape, dtype = obj.shape, np.dtype(obj.fmt.dtype)
        name = self.name(obj)
        view = self.cache.get(name) or self.cache.put(
            name, rows * obj.fmt.row_bytes, lambda buf: decode(np.frombuffer(buf, dtype=dtype).reshape(shape)))
        if view is not None:
            return np.frombuffer(view, dtype=dtype).reshape(shape)
        decode(out := obj.empty())  # it does not fit: for this process alone
        return out

    def pin(self, arena: Arena, obj: ShardObject, piece: Piece) -> Slot | np.ndarray | None:
        path = self.cache.path(self.name(obj))
        for attempt in range(2):
            try:
                return arena.pin(path)
            except FileNotFoundError:  # a miss (or evicted by another process meanwhile)
                if attempt:
                    return None
                rows = self.array(obj)  # decoded and inserted (or, when it cannot fit, for us alone)
                if not os.path.exists(path):
                    return rows
                arena.drop_stale()  # what the insert evicted: free its memory in this process too
            except OSError:  # no memory map left: read shard by shard
                return None
        return None

    def slot_bytes(self, fmt: ShardFormat) -> int:
        return fmt.chunks_per_shard * fmt.chunk_rows * fmt.row_bytes
