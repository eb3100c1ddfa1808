"""The generic backend: any fsspec filesystem (memory, GCS, Azure, HTTP...), and the base the
local and S3 backends refine.

Creates on a filesystem without a conditional put are an exists-check and a write under a lock:
atomic among this process's threads, racy across processes (documented in the README).
"""

from __future__ import annotations

import contextlib
import posixpath
import threading
from typing import TYPE_CHECKING

import fsspec

from featstore.storage._base import ObjectInfo, Storage, StorageOptions, strip_url
from featstore.storage._errors import backend_errors

if TYPE_CHECKING:
    from zarr.abc.store import Store as ZarrStore

#: Serialises the exists-check and the write of :meth:`FsspecStorage.create` on backends without a
#: conditional put (fsspec's memory filesystem, ...): atomic among this process's threads only.
_CREATE_LOCK = threading.Lock()


class FsspecStorage(Storage, protocols=("*",)):
    """A store root on an fsspec filesystem (``memory://feats``, ``gs://bucket/x``, ...)."""

    def __init__(self, url: str, storage_options: StorageOptions | None = None) -> None:
        self.url = strip_url(str(url))
        self._options = self._filled_options(dict(storage_options or {}))
        with backend_errors(self.url):
            self.fs, root = fsspec.core.url_to_fs(self.url, **self._options)
        self.root = strip_url(root)

    def _filled_options(self, options: StorageOptions) -> StorageOptions:
        """The options a backend adds to the user's (none here)."""
        return options

    def check_reachable(self, create: bool = True) -> None:
        """Fail fast with :class:`StoreUnavailable` if the root cannot be listed."""
        with backend_errors(self.url):
            try:
                self.fs.ls(self.root, detail=False, refresh=True)
            except FileNotFoundError:
                self._root_missing()

    def _root_missing(self) -> None:
        """What a missing root means here: nothing yet (its first write creates it)."""

    def read_bytes(self, key: str, *, metadata: bool = False) -> bytes | None:
        """The object's bytes, or ``None`` if it does not exist."""
        path = self.path(key)
        with backend_errors(self.url, path):
            # s3fs answers "not found" from a cached listing of the parent folder (its size
            # lookup before a GET): a manifest another process just committed would read as
            # absent. Drop the cached listings on the way first (local, no request).
            self.fs.invalidate_cache(path)
            try:
                return bytes(self.fs.cat_file(path))  # fsspec is untyped
            except FileNotFoundError:
                return None

    def read_range(self, key: str, start: int, stop: int | None = None) -> bytes | None:
        """Bytes ``[start, stop)`` of an object, or ``None`` if it does not exist."""
        path = self.path(key)
        with backend_errors(self.url):
            self.fs.invalidate_cache(path)
            try:
                return bytes(self.fs.cat_file(path, start=start, end=stop))
            except FileNotFoundError:
                return None

    def write_bytes(self, key: str, data: bytes) -> None:
        """Write (or overwrite) an object (one PUT: readers see the old or the new)."""
        path = self.path(key)
        with backend_errors(self.url, path):
            self.fs.pipe_file(path, data)

    def create(self, key: str, data: bytes) -> bool:
        """Write ``data`` only if ``key`` does not exist (under a process-wide lock)."""
        path = self.path(key)
        with backend_errors(self.url, path), _CREATE_LOCK:
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, data)
        return True

    def list_dirs(self, key: str) -> list[str]:
        """Names of the entries directly under ``key`` (empty if it does not exist)."""
        path = self.path(key)
        with backend_errors(self.url, path):
            try:
                self.fs.invalidate_cache(path)
                entries = self.fs.ls(path, detail=False)
            except (FileNotFoundError, NotADirectoryError):
                return []
        return sorted({posixpath.basename(e.rstrip("/")) for e in entries} - {""})

    def objects(self, key: str) -> dict[str, ObjectInfo]:
        """Every object under ``key``. Folders are not objects: a server that keeps an emptied
        folder for a while (SeaweedFS cleans them up later) lists it as a prefix, and s3fs's
        ``find`` then returns the folder itself."""
        path = self.path(key)
        with backend_errors(self.url, path):
            self.fs.invalidate_cache(path)
            try:
                found = self.fs.find(path, detail=True)
            except FileNotFoundError:
                return {}
        root = self.root.rstrip("/") + "/"
        return {p[len(root):] if p.startswith(root) else p: info for p, info in found.items()
                if info.get("type") != "directory"}

    def exists(self, key: str) -> bool:
        """Whether an object exists at ``key``."""
        with backend_errors(self.url):
            self.fs.invalidate_cache(self.path(key))
            return bool(self.fs.exists(self.path(key)))

    def delete(self, key: str, *, recursive: bool = False) -> None:
        """Delete an object (or everything under ``key`` with ``recursive=True``)."""
        path = self.path(key)
        with backend_errors(self.url, path):
            try:
                self.fs.rm(path, recursive=recursive)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(path)

    def delete_many(self, keys: list[str]) -> None:
        """Delete many objects at once (on S3 one DeleteObjects request per 1,000 keys)."""
        if not keys:
            return
        paths = [self.path(k) for k in keys]
        with backend_errors(self.url):
            try:
                self.fs.rm(paths)
            except FileNotFoundError:  # some filesystems (memory) refuse a list with a missing key
                for path in paths:
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm(path)
            self.fs.invalidate_cache()

    def zarr_store(self, key: str, *, read_only: bool) -> ZarrStore:
        """A Zarr v3 ``FsspecStore`` rooted at ``key``."""
        import zarr.storage  # here, not at the top: the quick commands never open a Zarr store

        from featstore.storage._zarr_errors import BackendErrorStore

        path = self.path(key)
        with backend_errors(self.url, path):
            store = zarr.storage.FsspecStore.from_url(
                self.child_url(key), storage_options=dict(self._options) or None, read_only=read_only)
        return BackendErrorStore(store, self.url, path)
