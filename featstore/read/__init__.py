"""The read side: :class:`FeatureDataset` (a torch ``IterableDataset`` over one version), who
reads what (:func:`consumer_plan`, pure), shuffle windows, gathering rows, the arena, and the
caches (mapped shards and ``/dev/shm`` in memory, remote objects on the node's disk).

The names are imported when first used: this package's modules import torch.
"""

from typing import TYPE_CHECKING

from featstore._lazy import lazy_exports

if TYPE_CHECKING:  # the names as the type checker sees them (at runtime: imported on first use)
    from featstore.read.plans._assignment import (consumer_plan as consumer_plan, ConsumerPlan as ConsumerPlan,
                                            dropped_pieces as dropped_pieces, PARTITIONS as PARTITIONS, Piece as Piece,
                                            shard_order as shard_order, UniformShards as UniformShards)
    from featstore.read.shards._cache import (clear_disk_cache as clear_disk_cache, DiskCacheOptions as DiskCacheOptions,
                                       list_disk_cache as list_disk_cache)
    from featstore.read._dataset import FeatureDataset as FeatureDataset
    from featstore.read._multiread import MultiTeacherDataset as MultiTeacherDataset
    from featstore.read._options import CACHES as CACHES, ReaderOptions as ReaderOptions
    from featstore.read.plans._shuffle import ShardPermutation as ShardPermutation
    from featstore.read.shards._sources import (Epoch as Epoch, ProcessReads as ProcessReads, ShardSource as ShardSource,
                                         Window as Window, WindowRead as WindowRead, WindowRows as WindowRows)

_NAMES = {
    "FeatureDataset": "_dataset", "ReaderOptions": "_options", "CACHES": "_options",
    "DiskCacheOptions": "shards._cache", "clear_disk_cache": "shards._cache", "list_disk_cache": "shards._cache",
    "ConsumerPlan": "plans._assignment", "Piece": "plans._assignment", "UniformShards": "plans._assignment",
    "consumer_plan": "plans._assignment", "shard_order": "plans._assignment", "PARTITIONS": "plans._assignment",
    "ShardPermutation": "plans._shuffle", "MultiTeacherDataset": "_multiread", "dropped_pieces": "plans._assignment",
    # where a window's rows come from: what another source (featstore.online's) builds on
    "ShardSource": "shards._sources", "ProcessReads": "shards._sources", "Window": "shards._sources", "Epoch": "shards._sources",
    "WindowRead": "shards._sources", "WindowRows": "shards._sources",
    # several versions read as one weighted stream
    "mix": "_mix_dataset", "Stream": "_mix_dataset", "MixtureDataset": "_mix_dataset",
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
