"""A FeatureDataset's resume points: featstore's own per-rank state, and torchdata's per-worker one.

Two protocols, one rule (every sample of the epoch exactly once):

- **Per rank** (:func:`rank_state`): ``dataset.state_dict(batches_seen=k)`` in the training
  process, the batches its loop consumed this epoch; ``load_state_dict`` makes the next
  iteration skip them. With ``W`` DataLoader workers, the DataLoader's round robin always starts
  at worker 0, so after ``k`` batches worker ``w`` plays the role of worker ``(w + k) % W``
  (:func:`rotated`). ``StatefulDataLoader`` with ``num_workers=0`` uses this one too.
- **Per worker** (:func:`worker_state`): torchdata's ``StatefulDataLoader`` asks each worker's copy
  of the dataset for ``state_dict()`` after each batch it produces, and on resume hands each new
  worker the state of the worker with its id, then continues its round robin after the last
  worker that produced a batch. So a worker's state is its own: the epoch, the role it plays and
  the batches it has produced; the resumed worker skips exactly those.

Both refuse another batch size, seed, shuffle, split (partition, drop_last, window), view
policy, world size or number of workers: the order of an epoch is split across ranks and
workers, so another split cannot tell which samples were seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from featstore.errors import InvalidInput
from featstore.read.plans._assignment import round_robin_consumed

WORKER_SCHEMA = "featstore.worker_state"
#: Options that change which samples a consumer reads, and in which order.
SPLIT_OPTIONS = ("batch_size", "seed", "shuffle", "view", "partition", "drop_last", "shuffle_window")
#: Of those, what an elastic resume keeps (the epoch's order; the split may change).
ORDER_OPTIONS = ("seed", "shuffle", "view", "shuffle_window")


@dataclass(frozen=True)
class WorkerResume:
    """A worker's saved place: epoch, the consumer role it played, batches it produced."""

    epoch: int
    role: int
    batches: int


def rank_state(version: Any, options: Any, epoch: int, batches_seen: int, world: int, rank: int,
               workers: int | None) -> dict[str, Any]:
    """featstore's per-rank state (the format :meth:`FeatureDataset.state_dict` returns)."""
    return {"version": version.id, "name": version.name, "epoch": epoch, "batches_seen": int(batches_seen),
            "options": asdict(options), "world_size": world, "rank": rank, "num_workers": workers}


def worker_state(version: Any, options: Any, epoch: int | None, role: int, batches: int, worker: int,
                 workers: int, world: int, rank: int) -> dict[str, Any]:
    """One DataLoader worker's state (what torchdata saves per worker); ``epoch`` None: the
    worker has not started an iteration."""
    return {"schema": WORKER_SCHEMA, "schema_version": 1, "version": version.id, "name": version.name,
            "epoch": epoch, "role": role, "batches": batches, "worker": worker, "num_workers": workers,
            "world_size": world, "rank": rank, "options": asdict(options)}


def is_worker_state(state: Any) -> bool:
    return isinstance(state, dict) and state.get("schema") == WORKER_SCHEMA


def check_same_run(state: dict[str, Any], version: Any, options: Any, world: int | None) -> None:
    """Refuse a state of another version, split or world size (:class:`InvalidInput`); ``world``
    None: a state with the epoch's progress, which resumes under any split of the same order."""
    if state["version"] != version.id:
        raise InvalidInput(f"the state is for version {state['version']}, this dataset reads "
                           f"{version.id}; open the pinned version with store.open("
                           f"'{state['name']}@{state['version']}').")
    saved, now = state.get("options") or {}, asdict(options)
    differ = [f"{k}={saved[k]!r} (now {now[k]!r})" for k in (ORDER_OPTIONS if world is None else SPLIT_OPTIONS)
              if k in saved and _norm(saved[k]) != _norm(now[k])]
    if world is None:
        if differ:
            raise InvalidInput(f"seed, shuffle, view and shuffle_window must match the saved state: "
                               f"{', '.join(differ)}. Resume with the saved settings, or start the epoch over.")
        return
    if state["world_size"] != world:
        differ.append(f"world_size={state['world_size']} (now {world})")
    if differ:
        hint = (" (a state with its epoch's progress resumes on another world size or number of workers through "
                "dataset.load_state_dict() or featstore.StatefulLoader)") if "progress" in state else ""
        raise InvalidInput(f"batch_size, seed, shuffle, view, the split and world_size must match the saved "
                           f"state: {', '.join(differ)}. Resume with the saved settings, or start the epoch "
                           f"over{hint}.")


def _norm(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def check_workers(saved: int | None, workers: int) -> None:
    """Refuse to resume with another number of DataLoader workers than the state's."""
    if saved is not None and max(1, saved) != max(1, workers):
        raise InvalidInput(
            f"the resume point was saved with {saved} DataLoader workers per rank and this loader "
            f"has {workers}: this state cannot tell which samples the other workers had seen. Resume "
            f"with num_workers={saved}, load the loader's state with featstore.StatefulLoader (it resumes "
            "under any number of workers), or start the epoch over without load_state_dict().")


def check_worker_state(state: dict[str, Any], worker: int, workers: int) -> WorkerResume | None:
    """The resume point in one worker's saved state (None: it had not started), or
    :class:`InvalidInput` when this worker cannot continue it.

    Another rank's state is accepted (its world size was checked): Lightning checkpoints rank 0's
    loader state only and every rank resumes from it, which is right because DDP ranks step
    together and each worker of each rank has produced the same number of batches of its own
    (equal) share."""
    check_workers(state["num_workers"], workers)
    if state["worker"] != worker:
        raise InvalidInput(f"DataLoader worker {worker} was given the state of worker {state['worker']}: "
                           "restore the loader's state with StatefulDataLoader.load_state_dict().")
    if state["epoch"] is None:
        return None
    return WorkerResume(int(state["epoch"]), int(state["role"]), int(state["batches"]))


def rotated(worker: int, workers: int, seen: int, counts: Sequence[int]) -> tuple[int, int]:
    """(role, batches to skip) of ``worker`` resuming a rank-level state after ``seen`` batches;
    ``counts``: each role's batches this epoch. DataLoader's round robin restarts at worker 0,
    which must continue as the worker the original run would have read next."""
    w = max(1, workers)
    role = (worker + seen) % w
    return role, round_robin_consumed(seen, counts)[role]
