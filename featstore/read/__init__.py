"""The read side: :class:`FeatureDataset` (a torch ``IterableDataset`` over one version), who
reads what (:func:`consumer_plan`, pure), shuffle windows, gathering rows, the arena, and the
caches (mapped shards and ``/dev/shm`` in memory, remote objects on the node's disk).

The names are imported when first used: this package's modules import torch.
"""

from featstore._lazy import lazy_exports

_NAMES = {
    "FeatureDataset": "_dataset", "ReaderOptions": "_options", "CACHES": "_options",
    "DiskCacheOptions": "_cache", "clear_disk_cache": "_cache", "list_disk_cache": "_cache",
    "ConsumerPlan": "_assignment", "Piece": "_assignment", "UniformShards": "_assignment",
    "consumer_plan": "_assignment", "shard_order": "_assignment", "PARTITIONS": "_assignment",
    "ShardPermutation": "_shuffle", "MultiTeacherDataset": "_multiread", "dropped_pieces": "_assignment",
    # where a window's rows come from: what another source (featstore.online's) builds on
    "ShardSource": "_sources", "ProcessReads": "_sources", "Window": "_sources", "Epoch": "_sources",
    "WindowRead": "_sources", "WindowRows": "_sources",
    # several versions read as one weighted stream
    "mix": "_mix_dataset", "Stream": "_mix_dataset", "MixtureDataset": "_mix_dataset",
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
