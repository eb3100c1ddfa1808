"""The compute side: the request (:class:`ComputeRequest`, the keywords ``store.compute`` and
``featstore.Teacher`` share), the one planner (:func:`decide` -> :class:`ComputePlan`), the
driver (:func:`compute`: plan, probe, run the shard tasks, commit) and where its tasks run
(:class:`ShardRunner`: Dask, or ``client="in-process"``), the shard task and one shard's rows
computed in-process (:func:`compute_shard`, what the teacher in the loop uses), connecting to
or starting the cluster, devices, host/device transfers, malloc settings while Model A runs on
CPU, and extending a parent version.

The names are imported when first used: most of this package's modules import torch and Dask.
"""

from featstore._lazy import lazy_exports

_NAMES = {
    "ComputeOptions": "_options", "OBJECT_STORE_SHARD_BYTES": "_options", "LOCAL_SHARD_BYTES": "_options",
    "ComputeRequest": "_request", "ComputeCall": "_request", "IN_PROCESS": "_request",
    "ComputePlan": "_decision", "decide": "_decision", "choose_layout": "_layout",
    "compute": "_driver", "commit_run": "_driver",
    "ShardRunner": "_runners", "DaskRunner": "_runners", "InProcessRunner": "_runners",
    "TaskSpec": "_task_spec", "Probe": "_task_spec", "ArrayProbe": "_task_spec",
    "probe": "_shard_task", "run_shards": "_shard_task", "worker_model": "_shard_task",
    "ShardRows": "_shard_rows", "compute_shard": "_shard_rows", "shard_batches": "_shard_rows",
    "open_arrays": "_shard_writing", "write_shard": "_shard_writing",
    "Cluster": "_cluster", "connect": "_cluster", "worker_devices": "_devices", "tuned": "_malloc",
    "collate_batch": "_batches", "DatasetPrefix": "_extends",
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
