"""S3 GETs through obstore (a Rust client): the reader's shard objects.

s3fs fetched the reader's objects at 0.55 of obstore's rate with ~3x its CPU (issue 12), so
:class:`featstore.storage.Storage` sends its data reads here (:mod:`featstore.s3config` builds
the config); writes, listings, deletes, conditional creates and metadata reads stay on s3fs.
``FEATSTORE_S3_CLIENT=s3fs`` forces s3fs for every store.

obstore is not fork-safe: its tokio runtime is global and started by the first request, and a
process forked after that (a DataLoader worker with the "fork" start method) inherits a runtime
whose threads are gone: every obstore call there hangs, with a new client too. A process that
inherited a started runtime (:func:`usable`) reads through s3fs instead; metadata reads stay on
s3fs so that a parent which only opened versions forks workers that can still use obstore.
Bytes only, never unpickled; secrets are scrubbed from every message (:meth:`S3Getter._error`).
"""

from __future__ import annotations

import glob
import hashlib
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

from featstore.errors import StorePermissionDenied, StoreUnavailable
from featstore.storage._base import StorageOptions
from featstore.storage._s3_config import BACKOFF, CLIENT_ENV, Plan, credentials

if TYPE_CHECKING:
    from obstore import OffsetRange
    from obstore.store import RetryConfig

T = TypeVar("T")
#: The pid whose obstore runtime featstore started; a tokio runtime seen at a fork (any user).
_STARTED_IN: int | None = None
_FORKED_WITH_RUNTIME = False  # this process inherited a started runtime (so do its children)
_OWN = [False]  # the parent's own value, kept across the fork


def _before_fork() -> None:
    # Only when obstore is loaded can its runtime run (started by featstore or by the user's
    # own obstore calls: its threads are named tokio-*). The child keeps the flag; the parent
    # gets its own value back right after the fork.
    global _FORKED_WITH_RUNTIME
    _OWN[0] = _FORKED_WITH_RUNTIME
    if "obstore._obstore" in sys.modules and not _FORKED_WITH_RUNTIME:
        names = glob.glob("/proc/self/task/*/comm")
        _FORKED_WITH_RUNTIME = _STARTED_IN == os.getpid() or any(_comm(n).startswith("tokio-") for n in names)


def _after_fork_in_parent() -> None:
    global _FORKED_WITH_RUNTIME
    _FORKED_WITH_RUNTIME = _OWN[0]


def _comm(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the thread ended meanwhile
        return ""


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent)


def usable() -> bool:
    """Whether obstore can run in this process (no runtime inherited through a fork)."""
    return not _FORKED_WITH_RUNTIME and _STARTED_IN in (None, os.getpid())


#: This process's clients by store (a digest of the URL and options: no secret in a key). A
#: reader opens its store afresh per dataset and per DataLoader worker; building obstore's
#: client and resolving botocore's chain cost ~30 ms each time (a sixth of a read-only epoch of
#: 100 MB on the benchmark's moto).
_GETTERS: dict[str, "S3Getter | None"] = {}
_GETTERS_PID: list[int] = [0]


def shared_getter(url: str, options: StorageOptions, make_plan: Callable[[], Plan | None]) -> "S3Getter | None":
    """This process's client for ``url`` with ``options`` (built with ``make_plan()`` on first
    use), or None where obstore cannot be used (then s3fs reads)."""
    if not usable():
        return None
    pid = os.getpid()
    if _GETTERS_PID[0] != pid:  # a new process: nothing of the parent's is used
        _GETTERS.clear()
        _GETTERS_PID[0] = pid
    # The plan also reads the environment (retry budget, profile, credentials, endpoints).
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_") or k == CLIENT_ENV)
    key = hashlib.sha256(repr((url, sorted(options.items(), key=lambda kv: kv[0]), env)).encode()).hexdigest()
    if key not in _GETTERS:
        p = make_plan()
        _GETTERS[key] = S3Getter(p, url) if p is not None else None
    return _GETTERS[key]


class S3Getter:
    """One process's obstore client for one bucket: whole and ranged GETs, bytes only."""

    def __init__(self, plan: Plan, url: str) -> None:
        from obstore.store import S3Store

        self.pid, self._url, self._secrets = os.getpid(), url, plan.secrets
        retry: RetryConfig = {"max_retries": plan.attempts - 1, "backoff": BACKOFF,
                 # attempts decide, as in botocore: the time bound never cuts the budget short
                 "retry_timeout": timedelta(hours=24)}
        self._store = S3Store(plan.bucket, config=plan.config, client_options=plan.client_options, retry_config=retry,
                              credential_provider=None if plan.session is None else credentials(plan.session))

    def get(self, path: str, start: int | None = None, stop: int | None = None) -> bytes | None:
        """Bytes of ``bucket/key`` ``path`` (``[start, stop)``; a negative ``start`` alone: the
        last ``-start`` bytes); None when the object does not exist."""
        import obstore

        if start is None and stop is None:
            view = self.get_buffer(path)
            return None if view is None else bytes(view)

        def ranged(key: str) -> bytes:
            if start is not None and start < 0 and stop is None:
                return bytes(obstore.get(self._store, key, options={"range": {"suffix": -start}}).bytes())
            begin = start or 0
            if stop is not None and stop <= begin:  # an empty range: S3 has no such request
                obstore.head(self._store, key)
                return b""
            rng: OffsetRange | tuple[int, int] = {"offset": begin} if stop is None else (begin, stop)
            return bytes(obstore.get(self._store, key, options={"range": rng}).bytes())

        return self._request(path, ranged)

    def get_buffer(self, path: str) -> memoryview | None:
        """The whole object at ``path`` as obstore received it, lent without a copy (read-only);
        None when it does not exist."""
        import obstore

        return self._request(path, lambda key: memoryview(obstore.get(self._store, key).bytes()))

    def _request(self, path: str, send: Callable[[str], T]) -> T | None:
        """``send(key)`` for the object at ``path``: None when it does not exist, obstore's
        errors as featstore's (scrubbed of secrets)."""
        global _STARTED_IN
        _STARTED_IN = _STARTED_IN or self.pid  # this request starts obstore's runtime
        try:
            return send(path.split("/", 1)[1])
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - obstore raises its own tree and builtins
            raise self._error(exc, path) from None  # the cause may echo the request: not chained

    def _error(self, exc: Exception, path: str) -> StoreUnavailable:
        """The typed error, its message scrubbed of every secret this client was given."""
        from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

        detail = str(exc)
        for s in self._secrets + tuple(filter(None, (os.environ.get("AWS_SECRET_ACCESS_KEY"),
                                                      os.environ.get("AWS_SESSION_TOKEN")))):
            detail = detail.replace(s, "***")
        name = type(exc).__name__
        if isinstance(exc, (PermissionDeniedError, UnauthenticatedError, PermissionError)):
            return StorePermissionDenied(f"permission denied at {path} ({name}: {detail}). Check the "
                                         "credentials (environment, profile or role) and the bucket policy.")
        return StoreUnavailable(f"cannot reach the store at {self._url} reading {path} ({name}: {detail}). "
                                "Check the URL, the endpoint and that credentials are available "
                                "(AWS_ACCESS_KEY_ID/AWS_PROFILE or a role); see docs/s3.md, section "
                                "'Credentials'. FEATSTORE_S3_CLIENT=s3fs reads through s3fs instead.")
