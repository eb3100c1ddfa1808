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
from featstore.versions._alignment import LINK, Alignment, adopt_views, check_aligned, check_views_of, link, views_of
from featstore.versions._catalog import Catalog, Ref
from featstore.versions._commits import Claim, Commits
from featstore.versions._committed import HasStoredVersion, StoredVersion, missing_data_error, stored, verify_version
from featstore.versions._digests import (DIGEST_BYTES, DIGEST_FIELD, InputCheck, content_digest, item_digest,
                                         item_digests)
from featstore.versions._keys import (GC_MARK, IO_THREADS, MANIFEST, PENDING, RUN_EVERY, group_store, object_key,
                                      receipt_key, tag_key, version_key, view_key)
from featstore.versions._receipts import (ReceiptRuns, compact_receipts, finished_shards, forget_receipts,
                                          read_receipts, run_key, write_receipt)
from featstore.versions._views import (SEED_FIELD, SEED_POLICY, VIEW_FIELD, Augment, SourceJoin, ViewDataset, Views,
                                       check_replayable, check_view_mode, epoch_seeds, epoch_view, fresh_view,
                                       normalize_fields, replay, view_seed, view_seeds, views_arguments)

if TYPE_CHECKING:
    from featstore.versions._committed import Index as Index
    from featstore.versions._export import Exported, export_version, verify_export
    from featstore.versions._fingerprints import (dataset_digest, dataset_fingerprint, describe_key, fingerprint,
                                                  model_digest, sample_positions, sampled_digest)

# The export imports zarr, the fingerprints numpy: imported when first asked for.
_LAZY = {"Exported": "_export", "export_version": "_export", "verify_export": "_export"}
_LAZY.update({name: "_fingerprints" for name in ("dataset_digest", "dataset_fingerprint", "describe_key", "fingerprint",
                                                 "model_digest", "sample_positions", "sampled_digest")})
_lazy, __dir__ = lazy_exports(__name__, _LAZY)


def __getattr__(name: str) -> object:
    if name == "Version":  # the name before the user's Version and this plumbing were two classes
        warnings.warn("featstore.versions.Version is now featstore.versions.StoredVersion (a version as stored); "
                      "the user's class is featstore.Version.", DeprecationWarning, stacklevel=2)
        return StoredVersion
    return _lazy(name)


__all__ = ["DIGEST_BYTES", "DIGEST_FIELD", "GC_MARK", "IO_THREADS", "LINK", "MANIFEST", "PENDING", "RUN_EVERY",
           "SEED_FIELD", "SEED_POLICY", "VIEW_FIELD", "Alignment", "Augment", "Catalog", "Claim", "Commits",
           "Exported", "HasStoredVersion", "InputCheck", "ReceiptRuns", "Ref", "SourceJoin", "StoredVersion",
           "ViewDataset", "Views", "adopt_views", "check_aligned", "check_replayable", "check_view_mode",
           "check_views_of", "compact_receipts", "content_digest", "dataset_digest", "dataset_fingerprint",
           "describe_key", "epoch_seeds", "epoch_view", "export_version", "fingerprint", "finished_shards",
           "forget_receipts", "fresh_view", "group_store", "item_digest", "item_digests", "link", "missing_data_error",
           "model_digest", "normalize_fields", "object_key", "read_receipts", "receipt_key", "replay", "run_key",
           "sample_positions", "sampled_digest", "stored", "tag_key", "verify_export", "verify_version", "version_key",
           "view_key", "view_seed", "view_seeds", "views_arguments", "views_of", "write_receipt"]
