"""featstore: compute a frozen Model A's outputs once, store them in versioned Zarr v3, and
stream them into Model B's training loop.

>>> import featstore
>>> store = featstore.open_store("./feats")
>>> version = store.compute("cnn-a/train", model=model_a, dataset=train_set,
...                         outputs={"features": "float16"})
>>> ds = store.dataset("cnn-a/train", batch_size=256, shuffle=True, seed=0)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from featstore._version import __version__
from featstore.errors import (ClusterUnavailable, ComputeFailed, ConditionalWritesUnsupported, CorruptChunk,
                              DatasetMismatch, DeviceSetupError, DistributedSetupError, EmptyDataset, FeatstoreError,
                              FeatstoreWarning, FingerprintWarning, IncompatibleFormat, InvalidInput, InvalidName,
                              MissingInputKey, NondeterministicAugment, NonFiniteOutput, OutputMismatch,
                              SourceMismatch, StoreConflict, StoreFull, StoreNotFound, StorePermissionDenied,
                              StoreUnavailable, VersionNotFound, VersionsMisaligned)

#: The public names that live in modules importing torch or Dask, by module: imported on first
#: use (PEP 562), so ``import featstore`` (and the quick commands of ``featstore``) stay fast.
_LAZY = {
    "FeatureDataset": "featstore.read", "ReaderOptions": "featstore.read",
    "clear_disk_cache": "featstore.read", "list_disk_cache": "featstore.read",
    "Tokens": "featstore.codecs", "Views": "featstore.versions",
    "FeatureStore": "featstore.store", "Version": "featstore.store", "open_store": "featstore.store",
    "ComputeOptions": "featstore.compute", "ComputeReport": "featstore.compute",
    "Teacher": "featstore.online", "advise": "featstore.online", "Advice": "featstore.online",
    "Costs": "featstore.online", "Workload": "featstore.online",
    "StatefulLoader": "featstore.stateful",
    "mix": "featstore.read", "Stream": "featstore.read", "Join": "featstore.read",
    "MixtureDataset": "featstore.read",  # deprecated: FeatureDataset (featstore.read warns)
}

if TYPE_CHECKING:
    from featstore.codecs import Tokens
    from featstore.compute import ComputeOptions, ComputeReport
    from featstore.read import FeatureDataset, Join, ReaderOptions, Stream, clear_disk_cache, list_disk_cache, mix
    from featstore.stateful import StatefulLoader
    from featstore.store import FeatureStore, Version, open_store
    from featstore.online import Advice, Costs, Teacher, Workload, advise
    from featstore.versions import Views


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'featstore' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    if name != "MixtureDataset":  # a deprecated name warns at every use
        globals()[name] = value  # later uses are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Advice", "advise", "Costs", "Teacher", "Workload", "clear_disk_cache", "ClusterUnavailable", "ComputeFailed",
    "ComputeOptions", "ComputeReport", "ConditionalWritesUnsupported", "CorruptChunk", "DatasetMismatch",
    "DeviceSetupError",
    "DistributedSetupError", "EmptyDataset", "FeatstoreError", "FeatstoreWarning", "FeatureDataset", "FeatureStore",
    "FingerprintWarning", "IncompatibleFormat", "InvalidInput", "InvalidName", "Join", "list_disk_cache", "mix",
    "MissingInputKey", "NondeterministicAugment", "NonFiniteOutput", "open_store",
    "OutputMismatch", "ReaderOptions", "SourceMismatch", "StatefulLoader", "StoreConflict", "Stream", "StoreFull",
    "StoreNotFound", "StorePermissionDenied", "StoreUnavailable", "Tokens", "Version", "VersionNotFound", "Views",
    "VersionsMisaligned", "__version__",
]
