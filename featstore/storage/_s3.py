"""S3: writes and listings through s3fs, data reads through obstore (:mod:`._s3_reads`),
conditional creates that mean the same on every server (:mod:`._s3_create`).

Transient faults (503 SlowDown, 500 InternalError, connection resets, read timeouts) are
retried by botocore with jittered exponential backoff, configured here explicitly so the policy
does not depend on ``~/.aws/config`` (see :func:`s3_options`); a fault that outlasts the retries
becomes :class:`StoreUnavailable`, in featstore's own calls and in Zarr's chunk reads and writes.
"""

from __future__ import annotations

import os
from featstore.errors import StoreUnavailable
from featstore.storage._base import StorageOptions
from featstore.storage._errors import backend_errors
from featstore.storage._fsspec import FsspecStorage
from featstore.storage._s3_config import plan
from featstore.storage._s3_create import check_honoured, put_if_absent
from featstore.storage._s3_reads import S3Getter, shared_getter

#: botocore attempts per S3 request (the first one included) when the user sets no policy.
#: s3fs retries SlowDown and connection errors again around botocore (5 times), but not 500
#: InternalError: so a request survives 4 consecutive faults of any kind, a persistent 500
#: fails after 5 attempts (~8 s of backoff), a persistent 503/reset after at most 25 (~40 s).
S3_MAX_ATTEMPTS = 5


def s3_options(options: StorageOptions) -> StorageOptions:
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


class S3Storage(FsspecStorage, protocols=("s3", "s3a")):
    """A store root in an S3 bucket (``s3://bucket/prefix``), on AWS or any S3-compatible server."""

    def __init__(self, url: str, storage_options: StorageOptions | None = None) -> None:
        super().__init__(url, storage_options)
        #: (pid, getter or None): this process's obstore client for GETs, built on first use.
        self._getter: tuple[int, S3Getter | None] | None = None

    def _filled_options(self, options: StorageOptions) -> StorageOptions:
        return s3_options(options)

    @property
    def identity(self) -> str:
        """The URL and the endpoint (two servers can hold the same bucket name); never a credential."""
        opts = self._options
        endpoint = (opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
                    or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "")
        return f"{self.url} {endpoint}"

    def _root_missing(self) -> None:
        bucket = self.root.split("/", 1)[0]
        if not self.fs.exists(bucket):
            raise StoreUnavailable(
                f"the bucket of {self.url} does not exist or is not visible with these "
                "credentials; create it first or fix the URL."
            ) from None

    def _s3_getter(self) -> S3Getter | None:
        """This process's obstore client for S3 GETs, or None (not translatable, or
        ``FEATSTORE_S3_CLIENT=s3fs``: s3fs reads). Built lazily and again in every new process:
        a forked child must never use its parent's runtime and connections. No lock: a fork
        while another thread held one would deadlock the child; two threads racing here build
        two clients and one is dropped."""
        held, pid = self._getter, os.getpid()
        if held is not None and held[0] == pid:
            return held[1]
        with backend_errors(self.url):
            getter = shared_getter(self.url, self._options, lambda: plan(self.url, self._options, self.fs))
        self._getter = (pid, getter)
        return getter

    def read_bytes(self, key: str, *, metadata: bool = False) -> bytes | None:
        """One GET, through obstore where :mod:`._s3_reads` can translate the options.
        ``metadata=True`` (manifests, receipts, tags, ``zarr.json``): through s3fs, so a process
        that only opened versions has not started obstore's runtime and its forked DataLoader
        workers can still use obstore."""
        getter = None if metadata else self._s3_getter()
        if getter is not None:
            return getter.get(self.path(key))
        return super().read_bytes(key, metadata=metadata)

    def read_buffer(self, key: str) -> bytes | memoryview | None:
        """One GET through obstore, its body lent as it arrived (no copy); else :meth:`read_bytes`."""
        getter = self._s3_getter()
        return getter.get_buffer(self.path(key)) if getter is not None else self.read_bytes(key)

    def read_range(self, key: str, start: int, stop: int | None = None) -> bytes | None:
        """One ranged GET."""
        getter = self._s3_getter()
        if getter is not None and (start >= 0 or stop is None) and (stop is None or stop >= 0):
            return getter.get(self.path(key), start, stop)
        return super().read_range(key, start, stop)

    def create(self, key: str, data: bytes) -> bool:
        """``If-None-Match: *``, on a server found to honour it (checked once per process and
        store; else :class:`~featstore.errors.ConditionalWritesUnsupported`); a 412 means
        "exists" whatever its body."""
        path = self.path(key)
        with backend_errors(self.url, path):
            check_honoured(self.fs, self.root, self.url)
            return put_if_absent(self.fs, path, data)
