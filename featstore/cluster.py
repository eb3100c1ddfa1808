"""Where compute tasks run: the embedded ``LocalCluster``, or a cluster the user brings.

The embedded default is one worker per GPU (worker processes advertising a ``GPU`` resource),
or, on a machine without GPUs, one worker thread inside the calling process (measured
1.4-1.9x faster compute on 2 cores than a worker process: no start-up, no pickling of Model A
and the dataset). The dashboard listens on loopback only: it shows task names and can run code.
The embedded scheduler preloads :mod:`featstore.dashboard` (the featstore page and its plugin),
by name, so this module never imports it; a failed task's Dask traceback stays off the console
(:mod:`featstore.logs`).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from .events import PAGE, PLUGIN
from .logs import quiet_task_failures

#: The scheduler preload that adds featstore's dashboard page (``dask scheduler --preload ...``).
DASHBOARD_PRELOAD = "featstore.dashboard"


@dataclass
class Cluster:
    """A Dask client and what featstore started for it (closed by :meth:`close`)."""

    client: Any
    owned: list = field(default_factory=list)
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


def connect(client: Any, n_workers: int | None = None, processes: bool | None = None) -> Cluster:
    """``client`` as a :class:`Cluster`: None starts the embedded one, a string is a scheduler
    address, anything else is a ``distributed.Client`` used as is."""
    from distributed import Client, LocalCluster

    if client is None:
        gpus = torch.cuda.device_count()
        n = n_workers or max(gpus, 1)
        cores = os.cpu_count() or 1
        processes = bool(gpus) if processes is None else processes
        cluster = LocalCluster(
            # Two threads in the in-process CPU worker: one shard task's first fetch and last
            # write overlap the next task's forward (Model A's forwards take turns, see
            # Cluster.serial_forward); one thread per GPU worker process.
            n_workers=n, threads_per_worker=1 if processes else 2, processes=processes,
            dashboard_address="127.0.0.1:8787", silence_logs=logging.ERROR,
            resources={"GPU": 1} if gpus else None,
            memory_limit=0,
            scheduler_kwargs={"preload": [DASHBOARD_PRELOAD]},
            # env= and preload= are for worker processes only (an in-process worker keeps this
            # process's environment and logging, quieted below)
            **({"env": {"OMP_NUM_THREADS": str(max(1, cores // n))}, "host": "127.0.0.1",
                "preload": ["featstore.logs"]} if processes else {}),
        )
        quiet_task_failures()
        c = Client(cluster)
        return Cluster(c, [cluster, c], in_process=not processes)
    if isinstance(client, str):
        c = Client(client)
        return Cluster(c, [c])
    return Cluster(client)


def _scheduler_has_plugin(dask_scheduler: Any = None) -> bool:
    return PLUGIN in getattr(dask_scheduler, "plugins", {})


def _has_plugin(client: Any) -> bool:
    """Whether the scheduler runs featstore's dashboard plugin (it was started with the preload)."""
    try:
        return bool(client.run_on_scheduler(_scheduler_has_plugin))
    except (OSError, ValueError, TypeError, RuntimeError):  # a scheduler that refuses run_on_scheduler
        return False


def workers(client: Any) -> dict[str, dict]:
    """The scheduler's view of every worker."""
    try:
        return client.scheduler_info(n_workers=-1)["workers"]
    except TypeError:  # older distributed lists every worker by default
        return client.scheduler_info()["workers"]


def task_resources(client: Any) -> dict[str, int] | None:
    """What each compute task asks for: one ``GPU`` where workers advertise GPUs."""
    has_gpu = any("GPU" in (w.get("resources") or {}) for w in workers(client).values())
    return {"GPU": 1} if has_gpu else None
