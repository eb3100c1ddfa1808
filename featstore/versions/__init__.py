"""Versions: every store key, a committed version as stored (:class:`StoredVersion`, and
:func:`stored` for the one behind a public :class:`featstore.Version`), the :class:`Catalog`
(list, resolve, tags, delete, gc) and its commit protocol (:class:`Commits`: claim, receipts,
records, commit), fingerprints, augmented views, export.

Layout under the store root and the lifecycle of a version are described in
:mod:`featstore.versions._catalog`. Builds on :mod:`featstore.format` and :mod:`featstore.storage`;
the compute and read sides build on it.

The export names are imported when first used: their module imports zarr, which the quick
commands (``featstore list``, ``info``, ...) never need.
"""

import warnings
from typing import TYPE_CHECKING

from featstore._lazy import lazy_exports
from featstore.versions._catalog import Catalog
from featstore.versions._commits import Claim, Commits
from featstore.versions._committed import StoredVersion, missing_data_error, stored, verify_version
from featstore.versions._digests import DIGEST_FIELD, InputCheck, content_digest, item_digest, item_digests
from featstore.versions._keys import (GC_MARK, IO_THREADS, MANIFEST, PENDING, RUN_EVERY, receipt_key, tag_key,
                                      version_key, view_key)
from featstore.versions._receipts import (compact_receipts, finished_shards, forget_receipts, read_receipts, run_key,
                                          write_receipt)
from featstore.versions._views import SEED_POLICY, Views, epoch_seeds, epoch_view, replay, view_seed, view_seeds

if TYPE_CHECKING:
    from featstore.versions._export import Exported, export_version, verify_export

_lazy, __dir__ = lazy_exports(__name__, {"Exported": "_export", "export_version": "_export",
                                         "verify_export": "_export"})


def __getattr__(name: str) -> object:
    if name == "Version":  # the name before the user's Version and this plumbing were two classes
        warnings.warn("featstore.versions.Version is now featstore.versions.StoredVersion (a version as stored); "
                      "the user's class is featstore.Version.", DeprecationWarning, stacklevel=2)
        return StoredVersion
    return _lazy(name)


__all__ = ["DIGEST_FIELD", "GC_MARK", "IO_THREADS", "MANIFEST", "PENDING", "RUN_EVERY", "SEED_POLICY", "Catalog",
           "Claim",
           "Commits", "Exported", "InputCheck", "StoredVersion", "Views", "compact_receipts", "content_digest",
           "epoch_seeds", "epoch_view", "export_version", "finished_shards", "forget_receipts", "item_digest",
           "item_digests", "missing_data_error", "read_receipts", "receipt_key", "replay", "run_key", "stored",
           "tag_key", "verify_export", "verify_version", "version_key", "view_key", "view_seed", "view_seeds",
           "write_receipt"]
