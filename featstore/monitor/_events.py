"""The progress events a compute sends while it runs: one small, pure schema.

Tasks (:mod:`featstore.compute`) and the driver (:mod:`featstore.compute`) send these with Dask's
``log_event`` under one topic, :data:`TOPIC`; the terminal progress bar and the dashboard page
(:mod:`featstore.dashboard`, a scheduler plugin) read them. Messages are plain dicts of strings
and numbers, because Dask sends events with msgpack. Nothing here imports Dask or torch.

Kinds, each with ``run`` (the run id) and ``kind``:

- ``run``: the driver starts a run: ``name``, ``version``, ``samples``, ``samples_per_shard``,
  ``shards_done`` (indices finished by an earlier run), ``url`` (the store, without secrets);
  with augmented views also ``views`` (K): ``samples`` is then per view, and every ``shard``
  number is view-major, ``view * shards_per_view + shard``.
- ``batch``: a task's Model A finished a batch of ``shard``: ``worker``, ``samples``.
- ``shard-start``: a task started a shard: ``worker``, ``shard``, ``device``, plus GPU
  memory/utilisation (``gpu_mem``, ``gpu_mem_total`` bytes, ``gpu_util`` percent) where known.
- ``shard``: a shard is written with its receipt: ``worker``, ``shard``, ``bytes``,
  ``nonfinite`` (samples), ``max_abs_error`` (the largest codec error so far, over outputs).
- ``end``: the driver finished: ``status`` (``"committed"`` or ``"failed"``), ``error``.
"""

from __future__ import annotations

from typing import NotRequired, Required, TypedDict, TypeGuard

#: The one Dask event topic featstore's computes send on.
TOPIC = "featstore"

KINDS = ("run", "batch", "shard-start", "shard", "end")


class DeviceInfo(TypedDict):
    """What a worker computes on (``device_info()`` in the shard task): the page's device column."""

    device: str  # "cpu" or "cuda"
    device_name: str
    gpu_mem: NotRequired[int]  # bytes allocated, and the GPU's total
    gpu_mem_total: NotRequired[int]
    gpu_util: NotRequired[int]  # percent busy, where NVML is installed


class Event(TypedDict, total=False):
    """One progress event: ``kind`` and ``run`` always, the other keys by kind (see above)."""

    kind: Required[str]
    run: Required[str]
    # run
    name: str
    version: str
    samples: int
    samples_per_shard: int
    shards_done: list[int]
    url: str
    views: int
    # batch, shard-start, shard
    worker: str
    shard: int
    # shard-start: DeviceInfo's keys
    device: str
    device_name: str
    gpu_mem: int
    gpu_mem_total: int
    gpu_util: int
    # shard
    bytes: int
    nonfinite: int
    max_abs_error: float
    # end
    status: str
    error: str


def run_started(run: str, name: str, version: str, samples: int, samples_per_shard: int,
                shards_done: list[int], url: str, views: int | None = None) -> Event:
    """The driver's first event of a run (the page learns the totals from it)."""
    event: Event = {"kind": "run", "run": run, "name": name, "version": version, "samples": int(samples),
                    "samples_per_shard": int(samples_per_shard), "shards_done": [int(i) for i in shards_done],
                    "url": url}
    if views is not None:
        event["views"] = int(views)
    return event


def batch_done(run: str, worker: str, shard: int, samples: int) -> Event:
    """A task ran Model A on ``samples`` more samples of ``shard``."""
    return {"kind": "batch", "run": run, "worker": worker, "shard": int(shard), "samples": int(samples)}


def shard_started(run: str, worker: str, shard: int, device: DeviceInfo) -> Event:
    """A task started computing ``shard`` on ``device`` (see :func:`device_info`'s keys)."""
    return {"kind": "shard-start", "run": run, "worker": worker, "shard": int(shard), **device}


def shard_written(run: str, worker: str, shard: int, nbytes: int, nonfinite: int,
                  max_abs_error: float) -> Event:
    """``shard`` is stored and has its receipt."""
    return {"kind": "shard", "run": run, "worker": worker, "shard": int(shard), "bytes": int(nbytes),
            "nonfinite": int(nonfinite), "max_abs_error": float(max_abs_error)}


def run_ended(run: str, status: str, error: str = "") -> Event:
    """The driver's last event of a run: ``"committed"`` or ``"failed"`` (with the error)."""
    return {"kind": "end", "run": run, "status": status, "error": error[:500]}


def is_event(msg: object) -> TypeGuard[Event]:
    """Whether ``msg`` looks like one of ours (other code may log on the same topic)."""
    return isinstance(msg, dict) and msg.get("kind") in KINDS and isinstance(msg.get("run"), str)


#: Where the featstore page lives in the Dask dashboard (next to ``/status``).
PAGE = "/individual-featstore"
#: The scheduler plugin's name (how the driver asks whether a scheduler has the page).
PLUGIN = "featstore"
