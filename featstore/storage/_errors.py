"""Backend errors mapped onto the featstore error tree, in featstore's own calls (and in Zarr's,
through :class:`featstore.storage._zarr_errors.BackendErrorStore`, kept apart so that this
module, on the path of the quick commands, does not import zarr).

A full disk is :class:`StoreFull`, a refused access :class:`StorePermissionDenied`, a connection
or credential problem (or a transient S3 fault that outlasted the retries) :class:`StoreUnavailable`,
each naming the object and the cause, instead of a bare ``OSError`` that callers could mistake
for corrupt data. Missing keys keep their own meaning (``FileNotFoundError``, Zarr's ``None``).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator

import fsspec

from featstore.errors import FeatstoreError, StoreFull, StorePermissionDenied, StoreUnavailable

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
            "see docs/s3.md, section 'Credentials'.")
    return None
