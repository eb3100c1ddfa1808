"""featstore: compute a frozen Model A's outputs once, store them in versioned Zarr v3, and
stream them into Model B's training loop.

>>> import featstore
>>> store = featstore.open_store("./feats")
>>> version = store.compute("cnn-a/train", model=model_a, dataset=train_set,
...                         outputs={"features": "float16"})
>>> ds = store.dataset("cnn-a/train", batch_size=256, shuffle=True, seed=0)
"""

from ._version import __version__
from .advise import Advice, Costs, Workload, advise
from .dataset import FeatureDataset, ReaderOptions
from .diskcache import clear_disk_cache, list_disk_cache
from .errors import (ClusterUnavailable, ComputeFailed, ConditionalWritesUnsupported, CorruptChunk, DatasetMismatch,
                     DeviceSetupError, DistributedSetupError, EmptyDataset, FeatstoreError, FeatstoreWarning,
                     FingerprintWarning, IncompatibleFormat, InvalidInput, InvalidName, MissingInputKey,
                     NonFiniteOutput, NondeterministicAugment, OutputMismatch, SourceMismatch, StoreConflict, StoreFull,
                     StoreNotFound, StorePermissionDenied, StoreUnavailable, VersionNotFound)
from .online import Teacher
from .ragged import Tokens
from .store import FeatureStore, Version, open_store
from .writer import ComputeOptions

__all__ = [
    "Advice", "advise", "clear_disk_cache", "Costs", "Workload",
    "ClusterUnavailable", "ComputeFailed", "ComputeOptions", "ConditionalWritesUnsupported",
    "CorruptChunk", "DatasetMismatch", "DeviceSetupError", "DistributedSetupError", "EmptyDataset", "FeatstoreError",
    "FeatstoreWarning", "FeatureDataset", "FeatureStore", "FingerprintWarning", "IncompatibleFormat", "InvalidInput",
    "InvalidName", "list_disk_cache", "MissingInputKey", "NondeterministicAugment", "NonFiniteOutput", "open_store",
    "OutputMismatch", "ReaderOptions", "SourceMismatch", "StoreConflict", "StoreFull", "StoreNotFound",
    "StorePermissionDenied", "StoreUnavailable", "Teacher", "Tokens", "Version", "VersionNotFound", "__version__",
]
