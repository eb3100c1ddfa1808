"""Local files: atomic creates with ``os.link``, writes as fsynced temp files renamed into place,
``sync`` fsyncs files and folders (Zarr never fsyncs its chunk files), Zarr's ``LocalStore``."""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import TYPE_CHECKING

from featstore.errors import InvalidInput, StoreNotFound
from featstore.storage._errors import backend_errors
from featstore.storage._base import StorageOptions
from featstore.storage._fsspec import FsspecStorage

if TYPE_CHECKING:
    from zarr.abc.store import Store as ZarrStore


class LocalStorage(FsspecStorage, protocols=(None, "file", "local")):
    """A store root in a local folder (a path or a ``file://`` URL)."""

    is_local = True

    def __init__(self, url: str, storage_options: StorageOptions | None = None) -> None:
        super().__init__(url, storage_options)
        self.root = os.path.abspath(self.root)

    def check_reachable(self, create: bool = True) -> None:
        """Create the root folder (unless ``create=False``: then a missing one is
        :class:`StoreNotFound`); a path that is a file is :class:`InvalidInput`."""
        with backend_errors(self.url):
            self._check_local_root(create)

    def _check_local_root(self, create: bool) -> None:
        if os.path.isdir(self.root):
            return
        if os.path.lexists(self.root) or not create:
            parent = next((p for p in _parents(self.root) if os.path.lexists(p)), None)
            if parent is not None and not os.path.isdir(parent):
                where = "is a file" if parent == self.root else f"lies under {parent}, which is a file"
                raise InvalidInput(f"the store {self.url} {where}, not a folder; give the path of a folder (it is "
                                   "created if it does not exist).")
            raise StoreNotFound(f"there is no store at {self.url} (no such folder); check the URL. A store is "
                                "created by its first compute (featstore compute URL NAME ..., or "
                                "featstore.open_store(URL)); read-only commands never create one.")
        try:
            os.makedirs(self.root, exist_ok=True)
        except (FileExistsError, NotADirectoryError):  # a file on the way to the root
            self._check_local_root(create=False)

    def write_bytes(self, key: str, data: bytes) -> None:
        """Write (or overwrite) an object; atomic for readers (temp + rename)."""
        path = self.path(key)
        with backend_errors(self.url, path):
            os.replace(_durable_temp(path, data), path)

    def create(self, key: str, data: bytes) -> bool:
        """Write ``data`` only if ``key`` does not exist: ``os.link`` of a fsynced temp file,
        atomic against every other writer on this file system."""
        path = self.path(key)
        with backend_errors(self.url, path):
            tmp = _durable_temp(path, data)
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)

    def sync(self, key: str) -> None:
        """fsync every file and folder under ``key``: the writer calls this before the commit,
        so a committed version survives a power loss.

        Another writer of the same folder (a concurrent compute of the same fingerprint) may
        create and rename its ``*.partial`` temp files while this walks: those are skipped, and a
        file that is gone by the time it is opened was renamed or removed by its writer, whose
        own fsync covers it."""
        with backend_errors(self.url, self.path(key)):
            for folder, _, files in os.walk(self.path(key)):
                for name in files:
                    if not name.endswith(".partial"):
                        _fsync(os.path.join(folder, name))
                _fsync(folder)

    def delete_many(self, keys: list[str]) -> None:
        """Delete many files; files that do not exist are ignored."""
        if not keys:
            return
        with backend_errors(self.url):
            for path in (self.path(k) for k in keys):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            self.fs.invalidate_cache()

    def zarr_store(self, key: str, *, read_only: bool) -> ZarrStore:
        """A Zarr v3 ``LocalStore`` rooted at ``key`` (its folder made for a writer)."""
        import zarr.storage  # here, not at the top: the quick commands never open a Zarr store

        from featstore.storage._zarr_errors import BackendErrorStore

        path = self.path(key)
        with backend_errors(self.url, path):
            if not read_only:
                os.makedirs(path, exist_ok=True)
            store = zarr.storage.LocalStore(path, read_only=read_only)
        return BackendErrorStore(store, self.url, path)


def _fsync(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # removed or renamed by a concurrent writer after the listing
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _parents(path: str) -> list[str]:
    """``path`` and each folder above it, nearest first."""
    out = [path]
    while os.path.dirname(out[-1]) != out[-1]:
        out.append(os.path.dirname(out[-1]))
    return out


def _durable_temp(path: str, data: bytes) -> str:
    """Write ``data`` fsynced to a unique ``*.partial`` file beside ``path``; return its name.

    Readers never see a partial object: the caller renames or links it into place, and a
    killed writer leaves only the ``.partial`` file, which :meth:`FeatureStore.gc` removes.
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}.partial"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp
