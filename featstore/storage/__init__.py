"""A store URL as a small storage surface: the :class:`Storage` interface and one backend per module.

>>> from featstore.storage import Storage
>>> type(Storage("/tmp/feats")).__name__, type(Storage("memory://feats")).__name__
('LocalStorage', 'FsspecStorage')

Backends: :class:`LocalStorage` (local files), :class:`FsspecStorage` (any fsspec filesystem),
:class:`S3Storage` (s3fs writes and listings, obstore reads). A new backend subclasses
:class:`Storage` and its tests subclass :class:`featstore.testing.StorageTests`.
"""

from typing import TYPE_CHECKING

from featstore._lazy import lazy_exports
from featstore.storage._base import SECRET_OPTIONS, Storage, StorageOptions, backend_for, redact
from featstore.storage._errors import backend_errors
from featstore.storage._fsspec import FsspecStorage
from featstore.storage._local import LocalStorage
from featstore.storage._s3 import S3_MAX_ATTEMPTS, S3Storage, s3_options
from featstore.storage._s3_reads import S3Getter

if TYPE_CHECKING:
    from featstore.storage._zarr_errors import BackendErrorStore

# BackendErrorStore subclasses a Zarr class: imported when first asked for, so that importing
# featstore.storage (every quick command does) does not import zarr.
__getattr__, __dir__ = lazy_exports(__name__, {"BackendErrorStore": "_zarr_errors"})

__all__ = ["S3_MAX_ATTEMPTS", "SECRET_OPTIONS", "BackendErrorStore", "FsspecStorage", "LocalStorage", "S3Getter",
           "S3Storage", "Storage", "StorageOptions", "backend_errors", "backend_for", "redact", "s3_options"]
