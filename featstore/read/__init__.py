"""The read side: :class:`FeatureDataset`, the one reader (a torch ``IterableDataset``) over typed
streams (:class:`Stream`: a version, several teachers' aligned versions, a weight, a join, where
the rows come from), :func:`mix`, the reader's options, and the one row path for random access
(:func:`rows_of`, what ``Version[...]``, ``load()`` and ``featstore.hf.SoftLabels`` read with).

Inside, by concept: :mod:`featstore.read.plans` (who reads what, pure), :mod:`featstore.read.state`
(epochs, placement, the one resume state), :mod:`featstore.read.shards` (bytes and caches: where a
shard's bytes come from, the caches, the sources of a window's rows).

The names are imported when first used: this package's modules import torch.
"""

import warnings
from typing import TYPE_CHECKING, Any

from featstore._lazy import lazy_exports

if TYPE_CHECKING:  # the names as the type checker sees them (at runtime: imported on first use)
    from featstore.read._mix import mix as mix
    from featstore.read._options import (CACHES as CACHES, ReadCall as ReadCall, ReaderOptions as ReaderOptions,
                                         ReadKeywords as ReadKeywords, read_call as read_call)
    from featstore.read._reader import Batch as Batch, FeatureDataset as FeatureDataset, SOURCE as SOURCE
    from featstore.read._rows import rows_of as rows_of, version_rows as version_rows
    from featstore.read._options import Join as Join
    from featstore.read._streams import RowsFrom as RowsFrom, Stream as Stream, Versionish as Versionish
    from featstore.read._views import check_source as check_source
    from featstore.read.plans import (ConsumerPlan as ConsumerPlan, dropped_pieces as dropped_pieces,
                                      PARTITIONS as PARTITIONS, Piece as Piece, ShardPermutation as ShardPermutation,
                                      UniformShards as UniformShards, consumer_plan as consumer_plan,
                                      shard_order as shard_order)
    from featstore.read.shards import (clear_disk_cache as clear_disk_cache, DiskCacheOptions as DiskCacheOptions,
                                       Epoch as Epoch, list_disk_cache as list_disk_cache,
                                       ProcessReads as ProcessReads, ShardSource as ShardSource, Span as Span,
                                       SpanRead as SpanRead, SpanRows as SpanRows)

_NAMES = {
    "FeatureDataset": "_reader", "Batch": "_reader", "SOURCE": "_reader", "mix": "_mix",
    "Stream": "_streams", "Join": "_options", "RowsFrom": "_streams", "Versionish": "_streams",
    "ReaderOptions": "_options", "ReadKeywords": "_options", "ReadCall": "_options", "read_call": "_options",
    "CACHES": "_options", "rows_of": "_rows", "version_rows": "_rows", "check_source": "_views",
    # the plan (pure)
    "ConsumerPlan": "plans", "Piece": "plans", "UniformShards": "plans", "consumer_plan": "plans",
    "shard_order": "plans", "PARTITIONS": "plans", "ShardPermutation": "plans", "dropped_pieces": "plans",
    # bytes and caches: where a window's rows come from (what featstore.online's source builds on)
    "DiskCacheOptions": "shards", "clear_disk_cache": "shards", "list_disk_cache": "shards",
    "ShardSource": "shards", "ProcessReads": "shards", "Span": "shards", "Epoch": "shards", "SpanRead": "shards",
    "SpanRows": "shards",
}
#: The reader's names before there was one reader: each is :class:`FeatureDataset` now.
DEPRECATED = {"MixtureDataset": "featstore.mix(streams, ...) or FeatureDataset([Stream, ...])",
              "MultiTeacherDataset": "FeatureDataset({label: version}) or store.dataset({label: ref})"}
__all__ = sorted(_NAMES)
_lazy, __dir__ = lazy_exports(__name__, _NAMES)


def __getattr__(name: str) -> Any:
    if name in DEPRECATED:
        warnings.warn(f"featstore.read.{name} is deprecated: there is one reader, FeatureDataset ({DEPRECATED[name]} "
                      "makes the same).", DeprecationWarning, stacklevel=2)
        return _lazy("FeatureDataset")
    return _lazy(name)
