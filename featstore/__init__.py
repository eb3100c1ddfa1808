"""featstore: compute a frozen Model A's outputs once, store them in versioned Zarr v3, and
stream them into Model B's training loop.

>>> import featstore
>>> store = featstore.open_store("./feats")
>>> version = store.compute("cnn-a/train", model=model_a, dataset=train_set,
...                         outputs={"features": "float16"})
>>> ds = store.dataset("cnn-a/train", batch_size=256, shuffle=True, seed=0)
"""

from ._version import __version__
from .dataset import FeatureDataset, ReaderOptions
from .diskcache import clear_disk_cache, list_disk_cache
from .errors import (ClusterUnavailable, ComputeFailed, CorruptChunk, DatasetMismatch, DeviceSetupError,
                     DistributedSetupError, EmptyDataset, FeatstoreError, FeatstoreWarning, FingerprintWarning,
                     IncompatibleFormat, InvalidInput, InvalidName, MissingInputKey, NondeterministicAugment,
                     NonFiniteOutput, OutputMismatch,
                     SourceMismatch, StoreConflict, StoreFull, StoreNotFound, StorePermissionDenied, StoreUnavailable,
                     VersionNotFound)
from .ragged import Tokens
from .store import FeatureStore, Version, open_store
from .writer import ComputeOptions

__all__ = [
    "ClusterUnavailable", "FeatstoreWarning", "FingerprintWarning", "StoreNotFound",
    "ComputeFailed", "ComputeOptions", "CorruptChunk", "DatasetMismatch", "DeviceSetupError", "DistributedSetupError",
    "EmptyDataset",
    "FeatureDataset",
    "FeatureStore", "FeatstoreError", "IncompatibleFormat", "InvalidInput", "InvalidName",
    "MissingInputKey", "NondeterministicAugment", "NonFiniteOutput", "OutputMismatch", "ReaderOptions",
    "SourceMismatch", "StoreConflict", "StoreFull", "StorePermissionDenied", "StoreUnavailable", "Tokens", "Version",
    "VersionNotFound", "clear_disk_cache", "list_disk_cache", "open_store", "__version__",
]
