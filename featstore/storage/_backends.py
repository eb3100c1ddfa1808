"""The fsspec adapter: a store URL becomes a :class:`Storage` with a tiny surface.

Everything featstore writes besides Zarr chunks (manifests, receipts, tags) goes through
:class:`Storage`, which maps backend errors onto the featstore error tree and offers one atomic
primitive, :meth:`Storage.create`: write an object only if it does not exist yet
(``os.link`` locally, ``If-None-Match: *`` on S3, on a server checked to honour it: see
:mod:`featstore.s3create`). Credentials given in ``storage_options`` are
kept in memory only: never logged, never shown in a repr, never written to the store (they do
travel, pickled, to the worker processes that need them: see the README section "Credentials").

On S3, transient faults (503 SlowDown, 500 InternalError, connection resets, read timeouts) are
retried by botocore with jittered exponential backoff, configured here explicitly so the policy
does not depend on ``~/.aws/config`` (see :func:`s3_options`); a fault that outlasts the retries
becomes :class:`StoreUnavailable`, in featstore's own calls and in Zarr's chunk reads and writes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import threading
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import fsspec
import zarr.abc.store
import zarr.storage

from featstore.errors import (FeatstoreError, InvalidInput, StoreConflict, StoreFull, StoreNotFound,
                              StorePermissionDenied, StoreUnavailable)
from featstore.format._manifests import canonical_json, load_json
from featstore.storage._s3_config import plan
from featstore.storage._s3_create import check_honoured, put_if_absent
from featstore.storage._s3_reads import S3Getter, shared_getter

_WRITE_ID = "_write_id"
#: Serialises the exists-check and the write of :meth:`Storage.create` on backends without a
#: conditional put (fsspec's memory filesystem, ...): atomic among this process's threads only.
_CREATE_LOCK = threading.Lock()

#: botocore attempts per S3 request (the first one included) when the user sets no policy.
#: s3fs retries SlowDown and connection errors again around botocore (5 times), but not 500
#: InternalError: so a request survives 4 consecutive faults of any kind, a persistent 500
#: fails after 5 attempts (~8 s of backoff), a persistent 503/reset after at most 25 (~40 s).
S3_MAX_ATTEMPTS = 5

#: Option names whose values are credentials: masked in every repr featstore makes.
SECRET_OPTIONS = frozenset({"key", "secret", "token", "password", "username", "aws_access_key_id",
                            "aws_secret_access_key", "aws_session_token", "session_token",
                            "sas_token", "account_key", "client_secret", "credentials"})


def s3_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``storage_options`` for an S3 URL with featstore's retry policy filled in.

    Only when the user set none (no ``config_kwargs["retries"]``, no ``AWS_MAX_ATTEMPTS`` or
    ``AWS_RETRY_MODE``): botocore's "standard" mode with :data:`S3_MAX_ATTEMPTS` attempts, which
    retries 500/502/503/504, throttling, connection errors and read timeouts. These options
    travel with the store to Dask and DataLoader workers and into Zarr's FsspecStore, so every
    process and every chunk read/write gets the same policy.
    """
    out = dict(options)
    # One GET per object: with max_concurrency > 1 s3fs first asks the object's size (a HEAD,
    # or a stale listing cache that says "not found" for an object another process just
    # wrote). Listings are always fresh: other processes write the store.
    out.setdefault("max_concurrency", 1)
    out.setdefault("use_listings_cache", False)
    config = dict(out.get("config_kwargs") or {})
    if "retries" not in config and not ({"AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"} & set(os.environ)):
        config["retries"] = {"mode": "standard", "total_max_attempts": S3_MAX_ATTEMPTS}
        out["config_kwargs"] = config
    return out


def redact(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with every credential value replaced by ``'***'`` (nested dicts too)."""
    return {k: "***" if k.lower() in SECRET_OPTIONS and v is not None
            else redact(v) if isinstance(v, Mapping) else v
            for k, v in options.items()}


def _strip(url: str) -> str:
    return url.rstrip("/") if len(url) > 1 else url


#: errno values that mean "the disk or quota is full" and "this access is not allowed".
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_DENIED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


def _is_local_url(url: str) -> bool:
    return fsspec.core.split_protocol(url)[0] in (None, "file", "local")


@contextlib.contextmanager
def backend_errors(url: str, where: str | None = None) -> Iterator[None]:
    """Map backend errors onto the featstore tree, naming the path (``where``, or the file the
    error names) and the cause: a full disk is :class:`StoreFull`, a refused access
    :class:`StorePermissionDenied`, a connection or credential problem :class:`StoreUnavailable`."""
    try:
        yield
    except FeatstoreError:
        raise
    except (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - botocore and aiohttp raise many unrelated types
        mapped = _mapped(exc, url, where)
        if mapped is None:
            raise
        raise mapped from exc


def _mapped(exc: Exception, url: str, where: str | None) -> FeatstoreError | None:
    """The featstore error for a backend error, or None to let it through unchanged."""
    name, code = type(exc).__name__, getattr(exc, "errno", None)
    target = getattr(exc, "filename", None) or where or url
    cause = getattr(exc, "strerror", None) or str(exc) or name
    if code in _FULL:
        return StoreFull(f"the store at {url} is full: writing {target} failed ({cause}). Free some space "
                         "(or raise the quota, or use another store), then rerun compute: nothing was "
                         "committed and the finished shards are kept.")
    if code in _DENIED or isinstance(exc, PermissionError):
        fix = ("Check the owner and mode of that folder, and that its file system is not mounted "
               "read-only." if _is_local_url(url) else "Check the credentials (environment, profile or "
               "role) and the bucket policy.")
        return StorePermissionDenied(f"permission denied at {target} ({name}: {cause}). {fix}")
    if _is_local_url(url) and isinstance(exc, OSError):
        return StoreUnavailable(f"the local store at {url} failed at {target} ({name}: {exc}). Check the "
                                "disk and the path.")
    if ("Credential" in name or "Connect" in name or "Timeout" in name or "HTTPClientError" in name
            or isinstance(exc, (OSError, TimeoutError))):
        return StoreUnavailable(
            f"cannot reach the store at {url} ({name}: {exc}). Check the URL, the endpoint "
            "and that credentials are available (AWS_ACCESS_KEY_ID/AWS_PROFILE or a role); "
            "see the README section 'Credentials'.")
    return None


class Storage:
    """One store root on any fsspec filesystem.

    >>> s = Storage("/tmp/feats")        # or "s3://bucket/prefix", storage_options={...}
    >>> s.write_json("a/b.json", {"x": 1}); s.read_json("a/b.json")
    {'x': 1}
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = _strip(str(url))
        self._options = dict(storage_options or {})
        if fsspec.core.split_protocol(self.url)[0] in ("s3", "s3a"):
            self._options = s3_options(self._options)
        with backend_errors(self.url):
            self.fs, root = fsspec.core.url_to_fs(self.url, **self._options)
        self.root = _strip(root)
        self.is_local = "file" in _protocols(self.fs)
        if self.is_local:
            self.root = os.path.abspath(self.root)
        self._is_s3 = bool({"s3", "s3a"} & set(_protocols(self.fs)))
        #: (pid, getter or None): this process's obstore client for GETs, built on first use.
        self._getter: tuple[int, S3Getter | None] | None = None

    def __repr__(self) -> str:  # never the storage options: they may hold secrets
        return f"Storage({self.url!r})"

    @property
    def options(self) -> dict[str, Any]:
        """The storage options with credentials masked (safe to log or show)."""
        return redact(self._options)

    @property
    def identity(self) -> str:
        """What tells this store from every other for a node-local cache: the URL and, for S3,
        the endpoint (two servers can hold the same bucket name). Never a credential."""
        if not self._is_s3:
            return self.url
        opts = self._options
        endpoint = (opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
                    or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "")
        return f"{self.url} {endpoint}"

    def reopen(self) -> "Storage":
        """A new Storage on the same URL and options, with its own filesystem object (use one
        per process: fsspec filesystems are neither fork- nor event-loop-safe)."""
        return Storage(self.url, self._options)

    def __getstate__(self) -> dict[str, Any]:
        # Reopen by URL after unpickling: a filesystem object is not fork- or loop-safe. The
        # options go along, credentials included: a worker without its own credential chain
        # needs them. That is why the README recommends the chain over secrets in options.
        return {"url": self.url, "options": self._options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["options"])  # type: ignore[misc]

    # -- paths --------------------------------------------------------------------------
    def path(self, key: str) -> str:
        """The backend path of ``key``; keys are validated names joined by '/', never '..'."""
        if key.startswith("/") or ".." in key.split("/") or "\\" in key:
            raise FeatstoreError(f"internal error: unsafe key {key!r}")
        return posixpath.join(self.root, key) if key else self.root

    def child_url(self, key: str) -> str:
        """A full URL for ``key`` (what Zarr and worker processes open)."""
        return posixpath.join(self.url, key)

    # -- probing ------------------------------------------------------------------------
    def check_reachable(self, create: bool = True) -> None:
        """Fail fast with :class:`StoreUnavailable` if the root cannot be listed or created (a local
        root is created unless ``create=False``: then a missing one is :class:`StoreNotFound`; a
        path that is a file is :class:`InvalidInput`)."""
        with backend_errors(self.url):
            if self.is_local:
                self._check_local_root(create)
                return
            try:
                self.fs.ls(self.root, detail=False, refresh=True)
            except FileNotFoundError:
                bucket = self.root.split("/", 1)[0]
                if not self.fs.exists(bucket):
                    raise StoreUnavailable(
                        f"the bucket of {self.url} does not exist or is not visible with these "
                        "credentials; create it first or fix the URL."
                    ) from None

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

    # -- bytes --------------------------------------------------------------------------
    def _s3_getter(self) -> S3Getter | None:
        """This process's obstore client for S3 GETs, or None (not S3, not translatable, or
        ``FEATSTORE_S3_CLIENT=s3fs``: s3fs reads). Built lazily and again in every new process:
        a forked child must never use its parent's runtime and connections. No lock: a fork
        while another thread held one would deadlock the child; two threads racing here build
        two clients and one is dropped."""
        if not self._is_s3:
            return None
        held, pid = self._getter, os.getpid()
        if held is not None and held[0] == pid:
            return held[1]
        with backend_errors(self.url):
            getter = shared_getter(self.url, self._options, lambda: plan(self.url, self._options, self.fs))
        self._getter = (pid, getter)
        return getter

    def read_bytes(self, key: str, *, metadata: bool = False) -> bytes | None:
        """The object's bytes, or ``None`` if it does not exist (one GET on S3, through obstore
        where :mod:`featstore.s3get` can translate the options). ``metadata=True`` (manifests,
        receipts, tags, ``zarr.json``): through s3fs, so a process that only opened versions has
        not started obstore's runtime and its forked DataLoader workers can still use obstore."""
        path = self.path(key)
        getter = None if metadata else self._s3_getter()
        if getter is not None:
            return getter.get(path)
        with backend_errors(self.url, path):
            # s3fs answers "not found" from a cached listing of the parent folder (its size
            # lookup before a GET): a manifest another process just committed would read as
            # absent. Drop the cached listings on the way first (local, no request).
            self.fs.invalidate_cache(path)
            try:
                return self.fs.cat_file(path)
            except FileNotFoundError:
                return None

    def read_range(self, key: str, start: int, stop: int | None = None) -> bytes | None:
        """Bytes ``[start, stop)`` of an object (one ranged GET on S3), or ``None`` if it does not
        exist. A negative ``start`` with no ``stop`` reads the last ``-start`` bytes."""
        path = self.path(key)
        getter = self._s3_getter()
        if getter is not None and (start >= 0 or stop is None) and (stop is None or stop >= 0):
            return getter.get(path, start, stop)
        with backend_errors(self.url):
            self.fs.invalidate_cache(path)
            try:
                return self.fs.cat_file(path, start=start, end=stop)
            except FileNotFoundError:
                return None

    def write_bytes(self, key: str, data: bytes) -> None:
        """Write (or overwrite) an object; atomic for readers (temp + rename locally)."""
        path = self.path(key)
        with backend_errors(self.url, path):
            if self.is_local:
                os.replace(_durable_temp(path, data), path)
            else:
                self.fs.pipe_file(path, data)

    def sync(self, key: str) -> None:
        """Make every object under ``key`` durable (fsync files and folders locally; an S3 PUT
        is durable once answered). Zarr never fsyncs its chunk files, so the writer calls this
        before the commit: a committed version survives a power loss."""
        if not self.is_local:
            return
        with backend_errors(self.url, self.path(key)):
            for folder, _, files in os.walk(self.path(key)):
                for name in files:
                    fd = os.open(os.path.join(folder, name), os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                fd = os.open(folder, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def create(self, key: str, data: bytes) -> bool:
        """Write ``data`` only if ``key`` does not exist; return whether this call created it.

        Atomic against concurrent writers: ``os.link`` locally, ``If-None-Match: *`` on S3 (on a
        server found to honour it: else :class:`~featstore.errors.ConditionalWritesUnsupported`).
        """
        path = self.path(key)
        with backend_errors(self.url, path):
            if self.is_local:
                tmp = _durable_temp(path, data)
                try:
                    os.link(tmp, path)
                    return True
                except FileExistsError:
                    return False
                finally:
                    os.unlink(tmp)
            if self._is_s3:
                # The server must really honour If-None-Match (checked once per process and
                # store), and a 412 means "exists" whatever its body (see featstore.s3create).
                check_honoured(self.fs, self.root, self.url)
                return put_if_absent(self.fs, path, data)
            # Backends without a conditional put: an exists-check and a write under a lock,
            # atomic among this process's threads, racy across processes (documented).
            with _CREATE_LOCK:
                if self.fs.exists(path):
                    return False
                self.fs.pipe_file(path, data)
            return True

    def create_json(self, key: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create a JSON object exactly once and return the object that is stored.

        A write-id is stamped into the object, so a conditional write whose reply was lost
        (the retry sees "exists") is recognised as ours by reading it back. Raises
        :class:`StoreConflict` when another writer's object is there.
        """
        stamped = {**obj, _WRITE_ID: uuid.uuid4().hex}
        if self.create(key, canonical_json(stamped)):
            return stamped
        stored = self.read_json(key)
        if stored is not None and stored.get(_WRITE_ID) == stamped[_WRITE_ID]:
            return stored
        raise StoreConflict(f"{self.child_url(key)} was already written by another writer.")

    # -- JSON ---------------------------------------------------------------------------
    def read_json(self, key: str) -> dict[str, Any] | None:
        """Parse a JSON object (never a pickle); ``None`` if absent."""
        data = self.read_bytes(key, metadata=True)
        return None if data is None else load_json(data, self.child_url(key))

    def write_json(self, key: str, obj: dict[str, Any]) -> None:
        """Write a JSON object (overwrite allowed: used for tags and receipts)."""
        self.write_bytes(key, canonical_json(obj))

    # -- listing and deletion -----------------------------------------------------------
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

    def find(self, key: str) -> list[str]:
        """Every object under ``key``, as keys relative to the root."""
        return sorted(self._objects(key))

    def _objects(self, key: str) -> dict[str, dict[str, Any]]:
        """``{key relative to the root: info}`` of every object under ``key``. Folders are not
        objects: a server that keeps an emptied folder for a while (SeaweedFS cleans them up
        later) lists it as a prefix, and s3fs's ``find`` then returns the folder itself."""
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

    def find_modified(self, key: str) -> dict[str, float]:
        """``{key: modification time (epoch seconds)}`` for every object under ``key``."""
        out = {}
        for p, info in self._objects(key).items():
            t = info.get("mtime", info.get("LastModified", info.get("last_modified", 0.0)))
            out[p] = t if isinstance(t, (int, float)) else t.timestamp()
        return out

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
        """Delete many objects at once (on S3 one DeleteObjects request per 1,000 keys);
        keys that do not exist are ignored."""
        if not keys:
            return
        paths = [self.path(k) for k in keys]
        with backend_errors(self.url):
            if not self.is_local:
                self.fs.rm(paths)
            else:
                for path in paths:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(path)
            self.fs.invalidate_cache()

    # -- zarr ---------------------------------------------------------------------------
    def zarr_store(self, key: str, *, read_only: bool) -> zarr.abc.store.Store:
        """A Zarr v3 store rooted at ``key`` (LocalStore locally, FsspecStore elsewhere)."""
        path = self.path(key)
        with backend_errors(self.url, path):
            if self.is_local:
                if not read_only:
                    os.makedirs(path, exist_ok=True)
                store = zarr.storage.LocalStore(path, read_only=read_only)
            else:
                store = zarr.storage.FsspecStore.from_url(
                    self.child_url(key), storage_options=self._options or None, read_only=read_only)
        return BackendErrorStore(store, self.url, path)


class BackendErrorStore(zarr.storage.WrapperStore):
    """Zarr store wrapper: a backend fault that outlasted the retries becomes
    :class:`StoreUnavailable`, a full disk :class:`StoreFull`, a refused write
    :class:`StorePermissionDenied` (each naming the object and the cause) instead of a bare
    ``OSError`` that callers could mistake for corrupt data. Missing keys keep zarr's own meaning."""

    def __init__(self, store: Any, url: str, root: str = "") -> None:
        super().__init__(store)
        self._url, self._root = url, root

    def _with_store(self, store: Any) -> "BackendErrorStore":
        return type(self)(store, self._url, self._root)

    def _at(self, key: str) -> str:
        return posixpath.join(self._root, key) if self._root else key

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        with backend_errors(self._url, self._at(key)):
            return await self._store.get(key, prototype, byte_range)

    async def get_partial_values(self, prototype: Any, key_ranges: Any) -> Any:
        with backend_errors(self._url):
            return await self._store.get_partial_values(prototype, key_ranges)

    async def set(self, key: str, value: Any) -> None:
        with backend_errors(self._url, self._at(key)):
            return await self._store.set(key, value)

    async def set_if_not_exists(self, key: str, value: Any) -> None:
        with backend_errors(self._url, self._at(key)):
            return await self._store.set_if_not_exists(key, value)

    async def exists(self, key: str) -> bool:
        with backend_errors(self._url, self._at(key)):
            return await self._store.exists(key)

    async def delete(self, key: str) -> None:
        with backend_errors(self._url, self._at(key)):
            return await self._store.delete(key)

    async def getsize(self, key: str) -> int:
        with backend_errors(self._url, self._at(key)):
            return await self._store.getsize(key)


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


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)

