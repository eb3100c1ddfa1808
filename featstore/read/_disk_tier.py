"""The reader's disk tier: a remote version's shard objects through the node's disk cache
(:mod:`featstore.read`), ``cache="disk"`` or ``"memory+disk"``.

Objects are cached whole (a piece that needs a few chunks of a shard still fetches the shard
once: the consumer next to it reads the rest, and the next epoch all of it). Only a whole object
that passes every crc32c is kept. A read whose bytes came from the cache and fail the decoder's
checks discards the entry and fetches the object again; only the store's own copy failing
raises :class:`CorruptChunk`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any, TypeVar

from featstore.read._memory_cache import MappedFiles
from featstore.read._disk_cache import DiskCache, DiskCacheOptions, entry_body
from featstore.errors import CorruptChunk
from featstore.format._shard_decoder import ChunkRef, ShardFormat, shard_intact
from featstore._json import canonical_json
from featstore.storage import Storage
from featstore.versions._committed import StoredVersion, missing_data_error

T = TypeVar("T")


def scope_identity(version: StoredVersion) -> str:
    """What names one commit of one version of one store, and nothing else: the store's URL and
    endpoint, the version's key and id, and its manifest's digest (a version deleted and
    recomputed under the same id has another manifest)."""
    digest = hashlib.sha256(canonical_json(version.manifest.to_json())).hexdigest()
    return f"{version.storage.identity}|{version.key}|{version.id}|{digest}"


def entry_name(key: str) -> str:
    """The cache entry's name of the object at store key ``key`` (inside its version's scope)."""
    return hashlib.sha256(key.encode()).hexdigest()[:40]


class DiskObjects:
    """One process's reads of a version's shard objects through the disk cache."""

    def __init__(self, version: StoredVersion, storage: Storage, options: DiskCacheOptions, identity: str,
                 maps: MappedFiles) -> None:
        self.version, self.storage, self.maps = version, storage, maps
        self.cache = DiskCache.open(options, identity, {"store": storage.url, "version": version.ref})

    def use(self, key: str, ref: ChunkRef, fmt: ShardFormat, use: Callable[[Any], T], keep: bool = True) -> T:
        """``use(object bytes)`` for the shard object at ``key``, from the cache or fetched (and
        kept). ``keep=False``: a cached entry is mapped for this use alone."""
        name = entry_name(key)
        intact: Callable[[memoryview], bool] = lambda view: shard_intact(view, fmt)  # noqa: E731
        data, cached = self._fetch(name, key, ref, intact, keep)
        if cached:
            try:
                return use(data)
            except CorruptChunk:  # damaged or torn on the node's disk: never served
                self.cache.discard(name)
            data, _ = self._fetch(name, key, ref, intact, keep)
        return use(data)

    def entry(self, key: str, ref: ChunkRef, fmt: ShardFormat) -> Any:
        """The cache file of the shard object at ``key`` (fetched and kept first if needed), to
        be mapped by the caller; or the fetched bytes when they could not be kept (None: the
        object does not exist)."""
        return self.cache.ensure(entry_name(key), lambda: self.storage.read_bytes(key),
                                 lambda view: shard_intact(view, fmt))

    def holds(self, key: str) -> str | None:
        """The cache file of the shard object at ``key`` if it is on the node's disk now."""
        path = self.cache.path(entry_name(key))
        return path if os.path.exists(path) else None

    def body(self, view: memoryview, key: str) -> memoryview | None:
        """A mapped entry's object; None, with the entry removed, when it is torn."""
        body = entry_body(view)
        if body is None:
            self.discard(key)
        return body

    def discard(self, key: str) -> None:
        """Remove the entry of the object at ``key`` (it failed a check): fetched again next."""
        self.cache.discard(entry_name(key))

    def _fetch(self, name: str, key: str, ref: ChunkRef, intact: Callable[[memoryview], bool],
               keep: bool) -> tuple[Any, bool]:
        data, cached = self.cache.fetch(name, lambda: self.storage.read_bytes(key), intact, self.maps, keep)
        if data is None or len(data) == 0:
            raise missing_data_error(self.version, ref, data)
        return data, cached
