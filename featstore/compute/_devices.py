"""Which device each compute worker runs Model A on, and how the embedded cluster gives every
worker a GPU of its own.

Two pure functions hold the decisions, so they are tested on any machine:

* :func:`choose_device` maps what one worker process sees (its Dask name and resources, the
  CUDA devices visible to it, how it was started) to the device its tasks use. The rules, first
  match wins:

  1. ``FEATSTORE_DEVICE`` in the worker's environment (``cpu``, ``cuda``, ``cuda:3``): that one.
  2. No CUDA device visible: ``cpu``.
  3. Exactly one visible: ``cuda:0``. The embedded cluster starts every worker this way (its own
     ``CUDA_VISIBLE_DEVICES``), and so does ``CUDA_VISIBLE_DEVICES=3 dask worker ...``.
  4. A dask-cuda worker (``LocalCUDACluster``, ``dask cuda worker``): ``cuda:0``, because
     dask-cuda rotates ``CUDA_VISIBLE_DEVICES`` so that each worker's own GPU comes first.
  5. The worker advertises ``GPU=g`` with ``g > 1`` (one process driving several GPUs, with at
     least ``g`` threads): each running task holds one of ``g`` slots and uses ``cuda:<slot>``;
     Dask's resource accounting never runs more than ``g`` GPU tasks on it at once.
  6. The worker's name is or ends in an integer ``k`` (``3``, ``"gpu-3"``; ``LocalCluster``
     names its workers 0, 1, ...): ``cuda:<k mod visible>``.
  7. Otherwise :class:`~featstore.errors.DeviceSetupError`, which says how to fix it. Several
     GPUs visible and nothing that tells them apart would otherwise put every worker on GPU 0.

* :func:`plan_cluster` decides the embedded cluster: one worker thread in the calling process on
  a machine without GPUs, else one worker process per GPU, through dask-cuda's
  ``LocalCUDACluster`` when it is installed (``pip install featstore[gpu]``) and otherwise through
  a ``LocalCluster`` whose worker ``i`` gets ``CUDA_VISIBLE_DEVICES=<i-th visible GPU>``
  (:func:`gpu_worker_specs`).

:func:`task_device` is the small impure part: it reads the running worker and pins the task's
thread to the chosen device (``torch.cuda.set_device``). :func:`worker_devices` reports every
worker's device and why (for a report or a dashboard page).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict, cast

from featstore.errors import DeviceSetupError

if TYPE_CHECKING:  # torch and Dask only inside a worker: planning a cluster needs neither
    import torch
    from distributed import Client, Worker

#: Environment variable that names a worker's device explicitly (``cpu``, ``cuda``, ``cuda:2``).
ENV_DEVICE = "FEATSTORE_DEVICE"
#: The Dask resource a GPU worker advertises and each compute task asks for.
GPU = "GPU"


@dataclass(frozen=True)
class WorkerView:
    """What one worker process can see when it picks its device.

    Attributes:
        name: the Dask worker's name (``LocalCluster``: 0, 1, ...; ``dask worker --name gpu-3``).
        resources: the worker's Dask resources (``{"GPU": 1}``).
        visible: CUDA devices this process sees (``torch.cuda.device_count()``).
        dask_cuda: the worker was started by dask-cuda (its preload module is loaded).
        override: the value of ``FEATSTORE_DEVICE``, if set.
    """

    name: str | int | None = None
    resources: Mapping[str, float] = field(default_factory=dict)
    visible: int = 0
    dask_cuda: bool = False
    override: str | None = None

    @property
    def gpu_slots(self) -> int:
        """How many GPU tasks this worker runs at once (its ``GPU`` resource, at least 1)."""
        return max(1, int(self.resources.get(GPU, 0) or 0))


@dataclass(frozen=True)
class Assignment:
    """A worker's device and why (shown in logs and on the dashboard)."""

    device: str
    reason: str


def choose_device(view: WorkerView, slot: int | None = None) -> Assignment:
    """The device a worker's tasks use; ``slot`` is the task's slot under rule 5 (see the module).

    >>> choose_device(WorkerView(name=2, resources={"GPU": 1}, visible=4)).device
    'cuda:2'
    >>> choose_device(WorkerView(name="gpu-1", visible=1)).device
    'cuda:0'
    >>> choose_device(WorkerView(visible=0)).device
    'cpu'
    """
    if view.override:
        return Assignment(_parse_override(view.override, view.visible), f"{ENV_DEVICE}={view.override}")
    if view.visible <= 0:
        return Assignment("cpu", "no CUDA device visible")
    if view.visible == 1:
        return Assignment("cuda:0", "the only visible GPU")
    if view.dask_cuda:
        return Assignment("cuda:0", "dask-cuda lists this worker's own GPU first")
    if view.gpu_slots > 1:
        return Assignment(f"cuda:{_check_slot(view, slot)}", f"GPU slot {slot} of {view.gpu_slots}")
    k = name_index(view.name)
    if k is not None:
        return Assignment(f"cuda:{k % view.visible}", f"worker name {view.name!r}")
    raise DeviceSetupError(
        f"worker {view.name!r} sees {view.visible} GPUs and nothing says which one is its own, so "
        "every such worker would use GPU 0. Start one worker per GPU with its own "
        "CUDA_VISIBLE_DEVICES (or use dask-cuda: pip install featstore[gpu]), name the workers "
        f"0, 1, ... (dask worker --name gpu-0), advertise --resources GPU={view.visible} with as "
        f"many threads, or set {ENV_DEVICE}=cuda:N in the worker's environment.")


def name_index(name: object) -> int | None:
    """The integer a worker name is or ends with (``3``, ``"3"``, ``"gpu-3"`` -> 3), else None.

    >>> name_index("node1-gpu-7"), name_index(0), name_index("tcp://127.0.0.1:4000/x")
    (7, 0, None)
    """
    if isinstance(name, int) and not isinstance(name, bool):
        return name if name >= 0 else None
    m = re.search(r"(?:^|[^0-9.:])(\d{1,4})$", str(name)) if name is not None else None
    return int(m.group(1)) if m else None


def _parse_override(value: str, visible: int) -> str:
    v = value.strip().lower()
    if v == "cpu":
        return "cpu"
    m = re.fullmatch(r"cuda(?::(\d+))?", v)
    if not m:
        raise DeviceSetupError(f"{ENV_DEVICE}={value!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'.")
    k = int(m.group(1) or 0)
    if k >= visible:
        raise DeviceSetupError(f"{ENV_DEVICE}={value!r} but this worker sees {visible} CUDA device(s); "
                               "pick one it sees (indices count within its CUDA_VISIBLE_DEVICES).")
    return f"cuda:{k}"


def _check_slot(view: WorkerView, slot: int | None) -> int:
    if view.gpu_slots > view.visible:
        raise DeviceSetupError(
            f"worker {view.name!r} advertises {GPU}={view.gpu_slots} but sees only {view.visible} GPUs; "
            f"advertise at most {GPU}={view.visible}.")
    if slot is None or not 0 <= slot < view.gpu_slots:
        raise DeviceSetupError(f"GPU slot {slot!r} is outside 0..{view.gpu_slots - 1} (worker {view.name!r}).")
    return slot


# ---------------------------------------------------------------------------------------------
# The embedded cluster (pure).
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClusterPlan:
    """What the embedded cluster starts.

    Attributes:
        kind: ``"thread"`` (one worker thread in this process), ``"processes"`` (CPU worker
            processes), ``"dask-cuda"`` (``LocalCUDACluster``) or ``"per-gpu"`` (a
            ``LocalCluster`` whose worker ``i`` sees GPU ``gpu_ids[i % len(gpu_ids)]``).
        n_workers: worker count.
        gpu_ids: the GPUs the workers get, as ``CUDA_VISIBLE_DEVICES`` entries.
    """

    kind: str
    n_workers: int
    gpu_ids: tuple[str, ...] = ()

    @property
    def processes(self) -> bool:
        return self.kind != "thread"

    def worker_env(self, i: int) -> dict[str, str]:
        """The ``CUDA_VISIBLE_DEVICES`` of worker ``i`` (empty where featstore does not set it)."""
        if self.kind != "per-gpu":
            return {}
        return {"CUDA_VISIBLE_DEVICES": self.gpu_ids[i % len(self.gpu_ids)]}


def visible_gpu_ids(cuda_visible_devices: str | None, count: int) -> tuple[str, ...]:
    """The ids of the ``count`` GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` entries.

    >>> visible_gpu_ids(None, 2), visible_gpu_ids("3,5,GPU-ab12", 3), visible_gpu_ids("", 0)
    (('0', '1'), ('3', '5', 'GPU-ab12'), ())
    """
    if count <= 0:
        return ()
    if cuda_visible_devices is None:
        return tuple(str(i) for i in range(count))
    ids = tuple(s.strip() for s in cuda_visible_devices.split(",") if s.strip())
    return ids[:count]


def plan_cluster(gpu_ids: Sequence[str], n_workers: int | None, processes: bool | None,
                 dask_cuda: bool) -> ClusterPlan:
    """The embedded cluster for a machine whose process sees ``gpu_ids``.

    One worker process per GPU (more workers than GPUs share them round-robin); dask-cuda's
    ``LocalCUDACluster`` when it is installed and there are no more workers than GPUs. Without
    GPUs, one worker thread in this process unless ``processes=True``.

    >>> plan_cluster(["0", "1"], None, None, dask_cuda=False)
    ClusterPlan(kind='per-gpu', n_workers=2, gpu_ids=('0', '1'))
    >>> plan_cluster([], None, None, dask_cuda=True).kind
    'thread'
    """
    if n_workers is not None and n_workers < 1:
        raise DeviceSetupError(f"n_workers must be at least 1, got {n_workers}.")
    ids = tuple(gpu_ids)
    if not ids:
        n = n_workers or 1
        return ClusterPlan("processes" if processes else "thread", n)
    n = n_workers or len(ids)
    if processes is False:
        # Worker threads in this process: each picks its GPU by its name (rule 6).
        return ClusterPlan("thread", n, ids)
    if dask_cuda and n <= len(ids):
        return ClusterPlan("dask-cuda", n, ids)
    return ClusterPlan("per-gpu", n, ids)


def gpu_worker_specs(plan: ClusterPlan, base: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    """Dask ``SpecCluster`` worker specs for a ``per-gpu`` plan: ``base`` (``{"cls": ...,
    "options": {...}}``) with each worker's own ``CUDA_VISIBLE_DEVICES`` and a ``GPU`` resource.

    >>> specs = gpu_worker_specs(ClusterPlan("per-gpu", 2, ("0", "1")), {"cls": object, "options": {}})
    >>> [s["options"]["env"]["CUDA_VISIBLE_DEVICES"] for s in specs.values()]
    ['0', '1']
    """
    out = {}
    for i in range(plan.n_workers):
        options = dict(base["options"])
        options["env"] = {**(options.get("env") or {}), **plan.worker_env(i)}
        options["resources"] = {**(options.get("resources") or {}), GPU: 1}
        out[i] = {"cls": base["cls"], "options": options}
    return out


# ---------------------------------------------------------------------------------------------
# Inside a worker (impure: reads the process and pins the thread).
# ---------------------------------------------------------------------------------------------
class _Slots:
    """Which GPU slots (rule 5) the running tasks of this process hold."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()

    @contextlib.contextmanager
    def take(self, n: int) -> Iterator[int]:
        with self._lock:
            free = [s for s in range(n) if s not in self._held]
            if not free:
                raise DeviceSetupError(
                    f"more GPU tasks run at once than this worker's {GPU}={n} resource allows; "
                    f"run compute tasks with resources={{'{GPU}': 1}} (featstore does this itself).")
            slot = free[0]
            self._held.add(slot)
        try:
            yield slot
        finally:
            with self._lock:
                self._held.discard(slot)


_SLOTS = _Slots()


def current_view(worker: Worker | None = None) -> WorkerView:
    """What this process and ``worker`` (default: the Dask worker running the calling task, if
    any) can see. ``client.run(f)`` passes its worker to ``f`` as ``dask_worker``."""
    import torch

    name, resources = None, {}
    if worker is None:
        try:
            from distributed import get_worker

            worker = get_worker()
        except (ImportError, ValueError):  # not inside a Dask task
            pass
    if worker is not None:
        name, resources = worker.name, dict(worker.state.total_resources)
    return WorkerView(name=name, resources=resources,
                      visible=torch.cuda.device_count() if torch.cuda.is_available() else 0,
                      dask_cuda="dask_cuda.initialize" in sys.modules,
                      override=os.environ.get(ENV_DEVICE) or None)


class DeviceReport(TypedDict):
    """One worker's device as :func:`describe` reports it."""

    name: str | int | None
    device: str  # "cpu", "cuda:N", or "error"
    reason: str  # why that device, or what went wrong
    visible: int
    CUDA_VISIBLE_DEVICES: str | None


def describe(worker: Worker | None = None) -> DeviceReport:
    """One worker's device, why, and its ``CUDA_VISIBLE_DEVICES``, for a report or a dashboard
    (``client.run(describe)`` on every worker). Never raises: a worker that cannot pick a device
    shows ``"device": "error"`` and the message.

    >>> describe()["device"] in ("cpu", "cuda:0")
    True
    """
    view = current_view(worker)
    try:
        a = choose_device(view, 0 if view.gpu_slots > 1 else None)
        device, reason = a.device, a.reason
    except DeviceSetupError as exc:
        device, reason = "error", str(exc)
    return {"name": view.name, "device": device, "reason": reason, "visible": view.visible,
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}


def _describe_worker(dask_worker: Worker) -> DeviceReport:
    return describe(dask_worker)


def worker_devices(client: Client) -> dict[str, DeviceReport]:
    """:func:`describe` of every worker of ``client``'s cluster, by worker address."""
    return cast("dict[str, DeviceReport]", client.run(_describe_worker))  # distributed's run() is untyped


@contextlib.contextmanager
def task_device(view: WorkerView | None = None) -> Iterator[torch.device]:
    """The ``torch.device`` for the running task, its thread pinned to it while the task runs.

    >>> with task_device(WorkerView(visible=0)) as device:
    ...     device.type
    'cpu'
    """
    import torch

    view = view or current_view()
    needs_slot = (view.visible > 1 and view.gpu_slots > 1 and not view.dask_cuda and not view.override)
    with _SLOTS.take(view.gpu_slots) if needs_slot else contextlib.nullcontext(None) as slot:
        device = torch.device(choose_device(view, slot).device)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # per thread: libraries that say "cuda" mean this one
        yield device
