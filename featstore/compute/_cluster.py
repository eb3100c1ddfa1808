"""Where compute tasks run: the embedded ``LocalCluster``, or a cluster the user brings.

The embedded default is one worker process per GPU, each seeing only its own GPU (dask-cuda's
``LocalCUDACluster`` when it is installed, else a ``LocalCluster`` with a ``CUDA_VISIBLE_DEVICES``
per worker; :mod:`featstore.compute` holds the decisions) and advertising a ``GPU`` resource,
or, on a machine without GPUs, one worker thread inside the calling process (measured
1.4-1.9x faster compute on 2 cores than a worker process: no start-up, no pickling of Model A
and the dataset). The dashboard listens on loopback only: it shows task names and can run code.
The embedded scheduler preloads :mod:`featstore.dashboard` (the featstore page and its plugin),
by name, so this module never imports it; a failed task's Dask traceback stays off the console
(:mod:`featstore.compute`).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import urllib.parse
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import torch

from featstore.errors import ClusterUnavailable, InvalidInput
from featstore.compute._devices import GPU, ClusterPlan, gpu_worker_specs, plan_cluster, visible_gpu_ids
from featstore.monitor import PAGE, PLUGIN
from featstore.compute._dask_logs import quiet_task_failures

if TYPE_CHECKING:
    from distributed import Client, Scheduler
    from distributed.deploy import Cluster as DaskCluster

#: Where the tasks run as ``store.compute(client=...)`` names it (see :func:`connect`).
ClusterSpec: TypeAlias = "Client | DaskCluster | str | None"

#: The scheduler preload that adds featstore's dashboard page (``dask scheduler --preload ...``).
DASHBOARD_PRELOAD = "featstore.dashboard"
#: The embedded cluster's dashboard port (Dask's default); another is taken when it is in use.
DASHBOARD_PORT = 8787


@dataclass
class Cluster:
    """A Dask client and what featstore started for it (closed by :meth:`close`)."""

    client: Client
    owned: list[Client | DaskCluster] = field(default_factory=list)  # closed last to first
    in_process: bool = False  # an embedded cluster whose worker is a thread of this process

    @property
    def dashboard_link(self) -> str:
        """The dashboard's URL; our own dashboard listens on loopback, so say 127.0.0.1."""
        link = self.client.dashboard_link
        return re.sub(r"//[^/:]+", "//127.0.0.1", link, count=1) if self.owned else link

    def page_link(self) -> str | None:
        """The featstore page's URL, or None when the scheduler lacks featstore's preload."""
        return self.dashboard_base + PAGE if _has_plugin(self.client) else None

    @property
    def dashboard_base(self) -> str:
        """The dashboard's root URL (without ``/status``)."""
        return self.dashboard_link.rsplit("/", 1)[0]

    @property
    def serial_forward(self) -> bool:
        """Whether the tasks of one worker take turns at Model A's forward: in the embedded
        in-process CPU worker, whose two threads each run a shard task so that one task's
        fetch and write overlap the other's forward, and torch already uses every core."""
        return self.in_process

    def torch_threads(self) -> int:
        """Torch threads per task: Dask pins ``OMP_NUM_THREADS=1`` in its workers, so our own
        worker processes get their share of the cores; 0 (leave as is) for an in-process
        worker or a cluster the user brought."""
        if not self.owned or self.in_process:
            return 0
        return max(1, (os.cpu_count() or 1) // max(1, len(workers(self.client))))

    def close(self) -> None:
        for obj in reversed(self.owned):
            obj.close()


def connect(client: ClusterSpec, n_workers: int | None = None, processes: bool | None = None,
            timeout: float = 5.0) -> Cluster:
    """``client`` as a :class:`Cluster`: None starts the embedded one, a string is a scheduler
    address (reached within ``timeout`` seconds, else :class:`ClusterUnavailable`), a Dask
    cluster object is connected to, and a ``distributed.Client`` is used as is."""
    from distributed import Client

    if client is None:
        ids = visible_gpu_ids(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
        return start(plan_cluster(ids, n_workers, processes, dask_cuda=bool(ids) and _has_dask_cuda()))
    if isinstance(client, Client):
        return Cluster(client)
    address = getattr(client, "scheduler_address", client)  # a LocalCluster, SLURMCluster, ...
    if not isinstance(address, str):
        raise InvalidInput(f"client must be None (an embedded cluster), a scheduler address such as "
                           f"'tcp://scheduler:8786', a Dask cluster or a distributed.Client; got "
                           f"{type(client).__name__}.")
    c = _connect(address, timeout)
    return Cluster(c, [c])


def _connect(address: str, timeout: float) -> Client:
    """A client of the scheduler at ``address``; a malformed address is :class:`InvalidInput`, one
    that does not answer in ``timeout`` seconds :class:`ClusterUnavailable`."""
    from distributed import Client
    from distributed.comm import parse_address
    from distributed.comm.addressing import parse_host_port

    try:
        scheme, location = parse_address(address)
        if scheme in ("tcp", "tls"):
            parse_host_port(location)  # "localhost" without a port is refused here, not after a wait
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"client={address!r} is not a Dask scheduler address ({exc}); write it as "
                           "tcp://host:port (the scheduler prints it: `dask scheduler` listens on "
                           "tcp://<host>:8786).") from None
    try:
        return Client(address, timeout=timeout)
    except (OSError, TimeoutError) as exc:
        raise ClusterUnavailable(
            f"cannot reach the Dask scheduler at {address} within {timeout:g} s ({type(exc).__name__}: {exc}). "
            "Check that it runs (dask scheduler) and that this machine can reach that host and port; for a "
            "scheduler still starting, raise ComputeOptions(connect_timeout=...) (--connect-timeout).") from exc
    except ValueError as exc:  # an address distributed cannot use (unknown scheme, ...)
        raise InvalidInput(f"client={address!r} is not a Dask scheduler address ({exc}); write it as "
                           "tcp://host:port.") from exc


def start(plan: ClusterPlan) -> Cluster:
    """Start the embedded cluster ``plan`` describes (see :func:`featstore.compute.plan_cluster`):
    worker processes get their share of the cores, GPU workers one GPU each; the scheduler
    preloads featstore's dashboard page."""
    from distributed import Client

    n = plan.n_workers
    # Two threads in the in-process CPU worker: one shard task's first fetch and last write
    # overlap the next task's forward (Model A's forwards take turns, see
    # Cluster.serial_forward); one thread per worker process.
    # LocalCluster's keyword arguments, of many kinds (Dask types them as Any)
    common: dict[str, Any] = dict(threads_per_worker=1 if plan.processes else 2,
                                  dashboard_address=f"127.0.0.1:{DASHBOARD_PORT}", silence_logs=logging.ERROR,
                                  memory_limit=0, scheduler_kwargs={"preload": [DASHBOARD_PRELOAD]})
    if plan.processes:
        # env= and preload= are for worker processes only (an in-process worker keeps this
        # process's environment and logging, quieted below)
        common.update(host="127.0.0.1", env={"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))},
                      preload=["featstore.compute._dask_logs"])
    resources = {GPU: 1} if plan.gpu_ids else None
    with warnings.catch_warnings():
        # Dask's own "Port 8787 is already in use" (a UserWarning naming its site-packages
        # file) is said once below, in featstore's words, with the port taken instead
        warnings.filterwarnings("ignore", message=r"Port \d+ is already in use", category=UserWarning)
        cluster = _local_cluster(plan, n, resources, common)
    _say_dashboard_port(cluster)
    quiet_task_failures()
    c = Client(cluster)
    try:
        c.wait_for_workers(n, timeout=120)
    except BaseException:
        c.close()
        cluster.close()
        raise
    return Cluster(c, [cluster, c], in_process=not plan.processes)


def _local_cluster(plan: ClusterPlan, n: int, resources: dict[str, int] | None, common: dict[str, Any]) -> Any:
    """The embedded cluster object of ``plan``'s kind (not yet connected to)."""
    from distributed import LocalCluster

    if plan.kind == "dask-cuda":
        from dask_cuda import LocalCUDACluster

        # dask-cuda sets each worker's CUDA_VISIBLE_DEVICES (its own GPU first) and replaces env=.
        common.pop("env")
        cluster = LocalCUDACluster(CUDA_VISIBLE_DEVICES=list(plan.gpu_ids), n_workers=n,
                                   resources=resources, **common)
    elif plan.kind == "per-gpu":
        # Worker i's own CUDA_VISIBLE_DEVICES: a LocalCluster's workers all share one spec.
        cluster = LocalCluster(n_workers=0, processes=True, resources=resources, **common)
        cluster.worker_spec.update(gpu_worker_specs(plan, cluster.new_spec))
        cluster.scale(n)
    else:
        cluster = LocalCluster(n_workers=n, processes=plan.processes, resources=resources, **common)
    return cluster


def _say_dashboard_port(cluster: Any) -> None:
    """One line on stderr when the dashboard is not on :data:`DASHBOARD_PORT` (another program,
    often another Dask cluster, holds it): which port this cluster's dashboard took instead."""
    try:
        port = urllib.parse.urlsplit(cluster.dashboard_link).port
    except (AttributeError, KeyError, ValueError):  # no dashboard (bokeh missing): nothing to say
        return
    if port is not None and port != DASHBOARD_PORT:
        print(f"featstore: port {DASHBOARD_PORT} is taken (another Dask dashboard?); this cluster's dashboard "
              f"listens on port {port} instead", file=sys.stderr)


def _has_dask_cuda() -> bool:
    """Whether dask-cuda is importable (``pip install featstore[gpu]``)."""
    try:
        import dask_cuda  # noqa: F401
    except ImportError:
        return False
    return True


def _scheduler_has_plugin(dask_scheduler: Scheduler | None = None) -> bool:
    return PLUGIN in getattr(dask_scheduler, "plugins", {})


def _has_plugin(client: Client) -> bool:
    """Whether the scheduler runs featstore's dashboard plugin (it was started with the preload)."""
    try:
        return bool(client.run_on_scheduler(_scheduler_has_plugin))
    except (OSError, ValueError, TypeError, RuntimeError):  # a scheduler that refuses run_on_scheduler
        return False


def workers(client: Client) -> dict[str, dict[str, Any]]:
    """The scheduler's view of every worker (distributed types it as a plain dict)."""
    try:
        info = client.scheduler_info(n_workers=-1)
    except TypeError:  # older distributed lists every worker by default
        info = client.scheduler_info()
    return cast("dict[str, dict[str, Any]]", info["workers"])


def task_resources(client: Client) -> dict[str, int] | None:
    """What each compute task asks for: one ``GPU`` where workers advertise GPUs."""
    has_gpu = any("GPU" in (w.get("resources") or {}) for w in workers(client).values())
    return {"GPU": 1} if has_gpu else None
