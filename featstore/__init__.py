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
from .errors import (ComputeFailed, ConditionalWritesUnsupported, CorruptChunk, DatasetMismatch, DeviceSetupError,
                     EmptyDataset, FeatstoreError, IncompatibleFormat, InvalidInput, InvalidName, MissingInputKey,
                     NondeterministicAugment, NonFiniteOutput, OutputMismatch, SourceMismatch, StoreConflict, StoreFull,
                     StorePermissionDenied, StoreUnavailable, VersionNotFound)
from .ragged import Tokens
from .store import FeatureStore, Version, open_store
from .writer import ComputeOptions

__all__ = [
    "ComputeFailed", "ComputeOptions", "ConditionalWritesUnsupported", "CorruptChunk", "DatasetMismatch",
    "DeviceSetupError", "EmptyDataset",
    "FeatureDataset",
    "FeatureStore", "FeatstoreError", "IncompatibleFormat", "InvalidInput", "InvalidName",
    "MissingInputKey", "NondeterministicAugment", "NonFiniteOutput", "OutputMismatch", "ReaderOptions",
    "SourceMismatch", "StoreConflict", "StoreFull", "StorePermissionDenied", "StoreUnavailable", "Tokens", "Version",
    "VersionNotFound", "open_store", "__version__",
]
