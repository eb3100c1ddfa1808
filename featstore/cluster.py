"""Where compute tasks run: the embedded ``LocalCluster``, or a cluster the user brings.

The embedded default is one worker per GPU (worker processes advertising a ``GPU`` resource),
or, on a machine without GPUs, one worker thread inside the calling process (measured
1.4-1.9x faster compute on 2 cores than a worker process: no start-up, no pickling of Model A
and the dataset). The dashboard listens on loopback only: it shows task names and can run code.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch


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
            n_workers=n, threads_per_worker=1, processes=processes,
            dashboard_address="127.0.0.1:8787", silence_logs=logging.ERROR,
            resources={"GPU": 1} if gpus else None,
            memory_limit=0,
            # env= is for worker processes only (an in-process worker keeps this process's)
            **({"env": {"OMP_NUM_THREADS": str(max(1, cores // n))}, "host": "127.0.0.1"} if processes else {}),
        )
        c = Client(cluster)
        return Cluster(c, [cluster, c], in_process=not processes)
    if isinstance(client, str):
        c = Client(client)
        return Cluster(c, [c])
    return Cluster(client)


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
