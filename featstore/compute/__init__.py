"""The compute side: the request (:class:`ComputeRequest`, the keywords ``store.compute`` and
``featstore.Teacher`` share), the one planner (:func:`decide` -> :class:`ComputePlan`), the
driver (:func:`compute`: plan, probe, run the shard tasks, commit) and where its tasks run
(:class:`ShardRunner`: Dask, or ``client="in-process"``), the shard task and one shard's rows
computed in-process (:func:`compute_shard`, what the teacher in the loop uses), connecting to
or starting the cluster, devices, host/device transfers, malloc settings while Model A runs on
CPU, and extending a parent version.

The names are imported when first used: most of this package's modules import torch and Dask.
"""

from typing import TYPE_CHECKING

from featstore._lazy import lazy_exports

if TYPE_CHECKING:  # the names as the type checker sees them (at runtime: imported on first use)
    from featstore.compute._batches import collate_batch as collate_batch
    from featstore.compute._cluster import Cluster as Cluster, connect as connect
    from featstore.compute._decision import ComputePlan as ComputePlan, decide as decide
    from featstore.compute._devices import worker_devices as worker_devices
    from featstore.compute._content import ComputeReport as ComputeReport
    from featstore.compute._driver import commit_run as commit_run, compute as compute, run_compute as run_compute
    from featstore.compute._extends import DatasetPrefix as DatasetPrefix
    from featstore.compute._layout import choose_layout as choose_layout
    from featstore.compute._malloc import tuned as tuned
    from featstore.compute._options import (ComputeOptions as ComputeOptions, LOCAL_SHARD_BYTES as LOCAL_SHARD_BYTES,
                                            OBJECT_STORE_SHARD_BYTES as OBJECT_STORE_SHARD_BYTES)
    from featstore.compute._request import (ComputeCall as ComputeCall, ComputeRequest as ComputeRequest,
                                            IN_PROCESS as IN_PROCESS)
    from featstore.compute._runners import (DaskRunner as DaskRunner, InProcessRunner as InProcessRunner,
                                            ShardRunner as ShardRunner)
    from featstore.compute._shard_rows import (compute_shard as compute_shard, shard_batches as shard_batches,
                                               ShardRows as ShardRows, Inputs as Inputs, read_inputs as read_inputs)
    from featstore.compute._shard_task import probe as probe, run_shards as run_shards, worker_model as worker_model
    from featstore.compute._shard_writing import open_arrays as open_arrays, write_shard as write_shard
    from featstore.compute._task_spec import ArrayProbe as ArrayProbe, Probe as Probe, TaskSpec as TaskSpec

_NAMES = {
    "ComputeOptions": "_options", "OBJECT_STORE_SHARD_BYTES": "_options", "LOCAL_SHARD_BYTES": "_options",
    "ComputeRequest": "_request", "ComputeCall": "_request", "IN_PROCESS": "_request",
    "ComputePlan": "_decision", "decide": "_decision", "choose_layout": "_layout",
    "compute": "_driver", "commit_run": "_driver", "run_compute": "_driver",
    "ShardRunner": "_runners", "DaskRunner": "_runners", "InProcessRunner": "_runners",
    "TaskSpec": "_task_spec", "Probe": "_task_spec", "ArrayProbe": "_task_spec",
    "probe": "_shard_task", "run_shards": "_shard_task", "worker_model": "_shard_task",
    "ShardRows": "_shard_rows", "compute_shard": "_shard_rows", "shard_batches": "_shard_rows",
    "Inputs": "_shard_rows", "read_inputs": "_shard_rows", "ComputeReport": "_content",
    "open_arrays": "_shard_writing", "write_shard": "_shard_writing",
    "Cluster": "_cluster", "connect": "_cluster", "worker_devices": "_devices", "tuned": "_malloc",
    "collate_batch": "_batches", "DatasetPrefix": "_extends",
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
