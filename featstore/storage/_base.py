"""The storage interface: the small surface everything featstore stores goes through.

Everything featstore writes besides Zarr chunks (manifests, receipts, tags) goes through a
:class:`Storage`, which maps backend errors onto the featstore error tree and offers one atomic
primitive, :meth:`Storage.create`: write an object only if it does not exist yet. A backend
implements the abstract methods below (one backend per module: :mod:`._local` local files,
:mod:`._fsspec` any fsspec filesystem, :mod:`._s3` S3 with s3fs writes and obstore reads); the
JSON helpers, paths, pickling and the credential rules are written once, here. The contract
every backend keeps is :class:`featstore.testing.StorageTests`.

``Storage(url, storage_options)`` picks the backend for the URL (:func:`backend_for`).
Credentials given in ``storage_options`` are kept in memory only: never logged, never shown in
a repr, never written to the store (they do travel, pickled, to the worker processes that need
them: see docs/s3.md, section "Credentials").
"""

from __future__ import annotations

import posixpath
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeAlias, TypedDict

import fsspec

from featstore._json import JSONObject, canonical_json, load_json
from featstore.errors import FeatstoreError, StoreConflict

if TYPE_CHECKING:  # zarr only where a Zarr store is opened: the quick commands never do
    from zarr.abc.store import Store as ZarrStore

#: fsspec's ``storage_options`` as the user gives them (credentials, ``client_kwargs``,
#: ``config_kwargs``, ...): each filesystem reads its own, with values of any kind.
StorageOptions: TypeAlias = Mapping[str, Any]
#: What a listing says of one object (fsspec's ``info``: size, type, a modification time, ...).
ObjectInfo: TypeAlias = dict[str, Any]

_WRITE_ID = "_write_id"

#: Option names whose values are credentials: masked in every repr featstore makes.
SECRET_OPTIONS = frozenset({"key", "secret", "token", "password", "username", "aws_access_key_id",
                            "aws_secret_access_key", "aws_session_token", "session_token",
                            "sas_token", "account_key", "client_secret", "credentials"})


def redact(options: StorageOptions) -> dict[str, object]:
    """``options`` with every credential value replaced by ``'***'`` (nested dicts too).

    >>> redact({"key": "AKIA...", "client_kwargs": {"endpoint_url": "http://x"}})
    {'key': '***', 'client_kwargs': {'endpoint_url': 'http://x'}}
    """
    return {k: "***" if k.lower() in SECRET_OPTIONS and v is not None
            else redact(v) if isinstance(v, Mapping) else v
            for k, v in options.items()}


class _State(TypedDict):
    """What a pickled :class:`Storage` carries: how to open it again."""

    url: str
    options: StorageOptions


def strip_url(url: str) -> str:
    """``url`` without a trailing '/' (the root '/' kept)."""
    return url.rstrip("/") if len(url) > 1 else url


#: protocol -> backend class, filled as each backend module defines its class (``protocols=``);
#: ``"*"`` is the backend for every other fsspec protocol. ``featstore.storage`` imports them all.
_BACKENDS: dict[str | None, type[Storage]] = {}


def backend_for(url: str) -> type[Storage]:
    """The backend class for a store URL: local files, S3, or any other fsspec filesystem.

    >>> backend_for("s3://bucket/feats").__name__
    'S3Storage'
    """
    protocol = fsspec.core.split_protocol(strip_url(str(url)))[0]
    return _BACKENDS.get(protocol) or _BACKENDS["*"]


class Storage(ABC):
    """One store root: the required surface (abstract) and what is written once on top of it.

    >>> s = Storage("/tmp/feats")        # or "s3://bucket/prefix", storage_options={...}
    >>> type(s).__name__
    'LocalStorage'
    >>> s.write_json("a/b.json", {"x": 1}); s.read_json("a/b.json")
    {'x': 1}
    """

    #: Whether keys are files on this machine (the reader maps them in place).
    is_local = False
    url: str
    root: str
    _options: StorageOptions

    def __init_subclass__(cls, protocols: tuple[str | None, ...] = (), **kw: object) -> None:
        super().__init_subclass__(**kw)
        for protocol in protocols:
            _BACKENDS[protocol] = cls

    def __new__(cls, url: str | None = None, storage_options: StorageOptions | None = None) -> Storage:
        if cls is Storage:  # Storage(url) picks the backend, as featstore always called it
            cls = backend_for(url if url is not None else "")
        return super().__new__(cls)

    @abstractmethod
    def __init__(self, url: str, storage_options: StorageOptions | None = None) -> None:
        """Open the store root at ``url`` (what :meth:`reopen` and unpickling call too)."""

    def __repr__(self) -> str:  # never the storage options: they may hold secrets
        return f"Storage({self.url!r})"

    @property
    def options(self) -> dict[str, object]:
        """The storage options with credentials masked (safe to log or show)."""
        return redact(self._options)

    @property
    def identity(self) -> str:
        """What tells this store from every other for a node-local cache (never a credential)."""
        return self.url

    def reopen(self) -> Storage:
        """A new Storage on the same URL and options, with its own filesystem object (use one
        per process: fsspec filesystems are neither fork- nor event-loop-safe)."""
        return type(self)(self.url, self._options)

    def __getstate__(self) -> _State:
        # Reopen by URL after unpickling: a filesystem object is not fork- or loop-safe. The
        # options go along, credentials included: a worker without its own credential chain
        # needs them. That is why the README recommends the chain over secrets in options.
        return {"url": self.url, "options": self._options}

    def __setstate__(self, state: _State) -> None:
        type(self).__init__(self, state["url"], state["options"])

    # -- paths --------------------------------------------------------------------------
    def path(self, key: str) -> str:
        """The backend path of ``key``; keys are validated names joined by '/', never '..'."""
        if key.startswith("/") or ".." in key.split("/") or "\\" in key:
            raise FeatstoreError(f"internal error: unsafe key {key!r}")
        return posixpath.join(self.root, key) if key else self.root

    def child_url(self, key: str) -> str:
        """A full URL for ``key`` (what Zarr and worker processes open)."""
        return posixpath.join(self.url, key)

    # -- the required surface -------------------------------------------------------------
    @abstractmethod
    def check_reachable(self, create: bool = True) -> None:
        """Fail fast with :class:`StoreUnavailable` if the root cannot be reached (a local root
        is created unless ``create=False``: then a missing one is :class:`StoreNotFound`)."""

    @abstractmethod
    def read_bytes(self, key: str, *, metadata: bool = False) -> bytes | None:
        """The object's bytes, or ``None`` if it does not exist. ``metadata=True`` marks small
        metadata objects (manifests, receipts, tags, ``zarr.json``)."""

    def read_buffer(self, key: str) -> bytes | memoryview | None:
        """A shard object's bytes as a read-only buffer for the reader to decode, or ``None`` if
        it does not exist. A backend that can lend its receive buffer overrides this: on S3 the
        copy into ``bytes`` was a quarter of a cold epoch's client CPU (docs/benchmarks.md)."""
        return self.read_bytes(key)

    @abstractmethod
    def read_range(self, key: str, start: int, stop: int | None = None) -> bytes | None:
        """Bytes ``[start, stop)`` of an object, or ``None`` if it does not exist. A negative
        ``start`` with no ``stop`` reads the last ``-start`` bytes."""

    @abstractmethod
    def write_bytes(self, key: str, data: bytes) -> None:
        """Write (or overwrite) an object; readers see the old bytes or the new, never a part."""

    @abstractmethod
    def create(self, key: str, data: bytes) -> bool:
        """Write ``data`` only if ``key`` does not exist; return whether this call created it.
        Atomic against concurrent writers where the backend can be (see each backend)."""

    @abstractmethod
    def list_dirs(self, key: str) -> list[str]:
        """Names of the entries directly under ``key`` (empty if it does not exist)."""

    @abstractmethod
    def objects(self, key: str) -> dict[str, ObjectInfo]:
        """``{key relative to the root: info}`` of every object under ``key`` (no folders);
        ``info`` may carry a modification time (``mtime``, ``LastModified``...)."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object exists at ``key``."""

    @abstractmethod
    def delete(self, key: str, *, recursive: bool = False) -> None:
        """Delete an object (or everything under ``key`` with ``recursive=True``); absent is fine."""

    @abstractmethod
    def delete_many(self, keys: list[str]) -> None:
        """Delete many objects at once; keys that do not exist are ignored."""

    @abstractmethod
    def zarr_store(self, key: str, *, read_only: bool) -> ZarrStore:
        """A Zarr v3 store rooted at ``key``, its backend errors mapped (``BackendErrorStore``)."""

    def sync(self, key: str) -> None:  # noqa: B027 - a no-op where a write is durable once answered
        """Make every object under ``key`` durable (a no-op where a write is durable once
        answered, as an S3 PUT is; local files are fsynced)."""

    # -- written once on top --------------------------------------------------------------
    def create_json(self, key: str, obj: JSONObject) -> JSONObject:
        """Create a JSON object exactly once and return the object that is stored.

        A write-id is stamped into the object, so a conditional write whose reply was lost
        (the retry sees "exists") is recognised as ours by reading it back. Raises
        :class:`StoreConflict` when another writer's object is there.
        """
        stamped: JSONObject = {**obj, _WRITE_ID: uuid.uuid4().hex}
        if self.create(key, canonical_json(stamped)):
            return stamped
        stored = self.read_json(key)
        if stored is not None and stored.get(_WRITE_ID) == stamped[_WRITE_ID]:
            return stored
        raise StoreConflict(f"{self.child_url(key)} was already written by another writer.")

    def read_json(self, key: str) -> JSONObject | None:
        """Parse a JSON object (never a pickle); ``None`` if absent."""
        data = self.read_bytes(key, metadata=True)
        return None if data is None else load_json(data, self.child_url(key))

    def write_json(self, key: str, obj: JSONObject) -> None:
        """Write a JSON object (overwrite allowed: used for tags and receipts)."""
        self.write_bytes(key, canonical_json(obj))

    def find(self, key: str) -> list[str]:
        """Every object under ``key``, as keys relative to the root."""
        return sorted(self.objects(key))

    def find_modified(self, key: str) -> dict[str, float]:
        """``{key: modification time (epoch seconds)}`` for every object under ``key``."""
        out = {}
        for p, info in self.objects(key).items():
            t = next((info[k] for k in ("mtime", "LastModified", "last_modified") if k in info), 0.0)
            out[p] = t if isinstance(t, (int, float)) else t.timestamp()
        return out
