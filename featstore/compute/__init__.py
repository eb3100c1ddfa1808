"""The compute side: the driver (:func:`compute`: validate, plan, run the shard tasks, commit),
the shard task inside Dask, connecting to or starting the cluster, devices, host/device
transfers, malloc settings while Model A runs on CPU, and extending a parent version.

The names are imported when first used: this package's modules import torch and Dask.
"""

from featstore._lazy import lazy_exports

_NAMES = {
    "ComputeOptions": "_options", "compute": "_driver", "choose_layout": "_driver",
    "OBJECT_STORE_SHARD_BYTES": "_options", "LOCAL_SHARD_BYTES": "_options",
    "Cluster": "_cluster", "connect": "_cluster", "worker_devices": "_devices", "tuned": "_malloc",
    "collate_batch": "_batches",
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
