"""Versions: every store key, reading a committed :class:`Version`, the :class:`Catalog` (list,
resolve, tags, delete, gc, claim, receipts, commit), fingerprints, augmented views, export.

Layout under the store root and the lifecycle of a version are described in
:mod:`featstore.versions._catalog`. Builds on :mod:`featstore.format` and :mod:`featstore.storage`;
the compute and read sides build on it.

The export names are imported when first used: their module imports zarr, which the quick
commands (``featstore list``, ``info``, ...) never need.
"""

from typing import TYPE_CHECKING

from featstore._lazy import lazy_exports
from featstore.versions._catalog import Catalog
from featstore.versions._lifecycle import Claim
from featstore.versions._committed import Version, verify_version
from featstore.versions._keys import (GC_MARK, IO_THREADS, MANIFEST, PENDING, RUN_EVERY, receipt_key, tag_key,
                                      version_key, view_key)
from featstore.versions._receipts import (compact_receipts, finished_shards, forget_receipts, read_receipts, run_key,
                                          write_receipt)
from featstore.versions._views import SEED_POLICY, Views, epoch_seeds, epoch_view, replay, view_seed, view_seeds

if TYPE_CHECKING:
    from featstore.versions._export import Exported, export_version, verify_export

__getattr__, __dir__ = lazy_exports(__name__, {"Exported": "_export", "export_version": "_export",
                                               "verify_export": "_export"})

__all__ = ["GC_MARK", "IO_THREADS", "MANIFEST", "PENDING", "RUN_EVERY", "SEED_POLICY", "Catalog", "Claim", "Exported",
           "Version", "Views", "compact_receipts", "epoch_seeds", "epoch_view", "export_version", "finished_shards",
           "forget_receipts", "read_receipts", "receipt_key", "replay", "run_key", "tag_key", "verify_export",
           "verify_version", "version_key", "view_key", "view_seed", "view_seeds", "write_receipt"]
