"""The one resume state: :class:`ReaderState`, what every saver writes and every loader reads.

A reader's state says where a job is in an epoch: the epoch, the streams it reads (each stream's
versions, by label, and its weight), the options that fix the order and the split (seed,
shuffle, view policy, shuffle window; batch size, partition, drop_last), the split it was saved
under (world size, rank, DataLoader workers), the steps of the epoch so far, and the epoch's
global progress (:class:`~featstore.read.plans.ResumeState`: how the epoch was planned and the
batches each split consumed). One DataLoader worker's state (what torchdata's
``StatefulDataLoader`` saves per worker) adds that worker's position (:class:`WorkerPosition`).

Every reader saves this one type, whatever its streams (one version, a mixture, several
teachers, a teacher in the loop): ``state_dict()`` per rank, per DataLoader worker, the
rank-level state made of a loader's worker states (:class:`featstore.StatefulLoader`) and
Lightning's checkpoints of them. :meth:`ReaderState.to_dict` gives plain JSON types, versioned
(``schema``, ``schema_version``); :meth:`ReaderState.from_dict` reads them and every format an
older featstore saved (a rank's state, a worker's, a multi-teacher state: schema version 1).

Two ways to resume, one rule (every sample of the epoch exactly once):

- **Per rank**: ``state_dict(batches_seen=k)`` in the training process, the steps its loop
  consumed this epoch; with the epoch's progress it resumes under any split with the same global
  batch (:mod:`featstore.read.plans`), without (an older featstore's) under the same split only.
- **Per worker**: torchdata asks each worker's copy of the dataset for its state after each batch
  it produces, and on resume hands each new worker the state of the worker with its id, then
  continues its round robin after the last worker that produced a batch. So a worker's state is
  its own: the epoch, the role it plays and the batches it has produced; the resumed worker skips
  exactly those.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any


from featstore.errors import InvalidInput
from featstore.read.plans import ResumeState, Split

SCHEMA = "featstore.reader_state"
SCHEMA_VERSION = 2
#: The formats of schema version 1 (featstore before issue 43): a rank's state had no schema.
WORKER_SCHEMA_1 = "featstore.worker_state"
MULTI_SCHEMA_1 = "featstore.multi_teacher_state"


@dataclass(frozen=True)
class Member:
    """One version of a stream, as a state names it: its label (None: a stream of one version,
    whose arrays are not prefixed), version id and feature set name."""

    label: str | None
    id: str
    name: str

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.id}"


@dataclass(frozen=True)
class StreamIdentity:
    """What a state names one stream by: its versions and its weight (None where an older
    featstore's state did not record it)."""

    members: tuple[Member, ...]
    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"members": [asdict(m) for m in self.members], "proportion": self.proportion, "repeat": self.repeat,
                "choose": self.choose}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StreamIdentity:
        return cls(tuple(Member(_opt_str(m, "label"), _str(m, "id"), _str(m, "name")) for m in data["members"]),
                   _opt_float(data, "proportion"), _opt_float(data, "repeat"), _opt_int(data, "choose"))


@dataclass(frozen=True)
class OrderOptions:
    """The reader's options that fix an epoch's order (``seed``, ``shuffle``, ``view``,
    ``shuffle_window``) and its split per rank (``batch_size``, ``partition``, ``drop_last``)."""

    seed: int
    shuffle: bool
    view: str | int | None
    shuffle_window: int | None
    batch_size: int
    partition: str | None
    drop_last: bool

    #: The options an elastic resume keeps (the split may change).
    ORDER = ("seed", "shuffle", "view", "shuffle_window")

    @classmethod
    def of(cls, options: object) -> OrderOptions:
        """The order options of a :class:`~featstore.ReaderOptions`."""
        return cls(**{f.name: getattr(options, f.name) for f in fields(cls)})

    @classmethod
    def saved(cls, data: dict[str, Any]) -> OrderOptions:
        """The order options a state saved (a schema 1 state saved every ReaderOptions field)."""
        view = data["view"]
        if not (view is None or isinstance(view, (str, int))):
            raise TypeError(f"view must be a str, an int or None, got {view!r}")
        return cls(int(data["seed"]), bool(data["shuffle"]), view, _opt_int(data, "shuffle_window"),
                   int(data["batch_size"]), _opt_str(data, "partition"), bool(data["drop_last"]))

    def differ(self, now: OrderOptions, which: tuple[str, ...]) -> list[str]:
        """``"name=saved (now now)"`` for each of ``which`` that differs."""
        return [f"{k}={getattr(self, k)!r} (now {getattr(now, k)!r})" for k in which
                if getattr(self, k) != getattr(now, k)]


@dataclass(frozen=True)
class WorkerPosition:
    """One DataLoader worker's place (torchdata's per-worker state).

    Attributes:
        worker: the worker's id; ``workers``: the loader's number of workers.
        role: the consumer of its rank it played; ``batches``: batches of that role yielded in
            the epoch (those before a resume included).
        split: the split its iteration read under, and ``since``: batches it yielded since the
            epoch's progress (None: an older featstore's state, or a worker that had not started).
    """

    worker: int
    workers: int
    role: int = 0
    batches: int = 0
    split: Split | None = None
    since: int = 0


@dataclass(frozen=True)
class ReaderState:
    """Where a reader is in an epoch (see the module docstring).

    Attributes:
        epoch: the epoch (None: a DataLoader worker that had not started an iteration).
        streams: the streams read, in order.
        options: the options that fix the order and the split.
        world, rank, workers: the split it was saved under (``workers`` None: not known).
        batches_seen: steps of the epoch so far (per rank; DDP ranks step together).
        progress: the epoch's global progress: for a rank's state after ``batches_seen``, for a
            worker's before its iteration (None: an older featstore's state, or a state saved
            before any iteration without ``num_workers``: then it resumes under the same split only).
        worker: a DataLoader worker's own position (None: a rank's state).
    """

    epoch: int | None
    streams: tuple[StreamIdentity, ...]
    options: OrderOptions
    world: int
    rank: int
    workers: int | None
    batches_seen: int = 0
    progress: ResumeState | None = None
    worker: WorkerPosition | None = None
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types, versioned: what ``state_dict()`` returns."""
        out: dict[str, Any] = {
            "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "epoch": self.epoch,
            "streams": [s.to_dict() for s in self.streams], "options": asdict(self.options),
            "world_size": self.world, "rank": self.rank, "num_workers": self.workers,
            "batches_seen": self.batches_seen}
        if self.progress is not None:
            out["progress"] = self.progress.to_dict()
        if self.worker is not None:
            w = self.worker
            out["worker"] = {"worker": w.worker, "num_workers": w.workers, "role": w.role, "batches": w.batches,
                             "since": w.since, "split": None if w.split is None else asdict(w.split)}
        return out

    @classmethod
    def from_dict(cls, data: Any) -> ReaderState:
        """A state :meth:`to_dict` wrote, or one an older featstore saved (schema version 1), or
        :class:`InvalidInput` saying what is wrong."""
        if not isinstance(data, dict):
            raise InvalidInput(f"a reader state is a dict (what state_dict() returned), got {type(data).__name__}.")
        try:
            if data.get("schema") == SCHEMA:
                version = data.get("schema_version")
                if not isinstance(version, int) or version > SCHEMA_VERSION:
                    raise InvalidInput(f"this reader state has schema version {version!r}; this featstore reads "
                                       f"version {SCHEMA_VERSION} and older: upgrade featstore to resume it.")
                return _from_2(data)
            if data.get("schema") == MULTI_SCHEMA_1:
                return _from_multi_1(data)
            if data.get("schema") == WORKER_SCHEMA_1 or "batches_seen" in data:
                return _from_1(data)
        except (KeyError, TypeError, ValueError, AssertionError) as exc:
            raise InvalidInput(f"this reader state is incomplete or damaged ({exc!r}): pass what state_dict() "
                               "saved, or start the epoch over.") from exc
        raise InvalidInput("not a featstore reader state (no schema): pass what a featstore dataset's state_dict() "
                           "saved.")

    # -- checks -----------------------------------------------------------------------------
    def check_streams(self, now: tuple[StreamIdentity, ...]) -> None:
        """Refuse a state of other streams (:class:`InvalidInput` naming how to read the saved ones)."""
        def ids(streams: tuple[StreamIdentity, ...]) -> list[list[tuple[str | None, str]]]:
            return [[(m.label, m.id) for m in s.members] for s in streams]

        def labels(streams: tuple[StreamIdentity, ...]) -> list[str]:
            return sorted(str(m.label) for s in streams for m in s.members if m.label is not None)

        if ids(self.streams) == ids(now):
            return
        if labels(now) and not labels(self.streams):
            raise InvalidInput("this state is not a multi-teacher dataset's: a state of one version (or of a "
                               "mixture) resumes a dataset over those versions alone.")
        if labels(self.streams) != labels(now):
            raise InvalidInput(f"the state is for teachers {labels(self.streams)}, this dataset reads {labels(now)}; "
                               "resume with the same teachers.")
        if len(self.streams) == len(now) == 1 and len(self.streams[0].members) == len(now[0].members) == 1:
            m, here = self.streams[0].members[0], now[0].members[0]
            raise InvalidInput(f"the state is for version {m.id}, this dataset reads {here.id}; open the pinned "
                               f"version with store.open('{m.ref}').")
        raise InvalidInput(f"the state is for streams {_describe(self.streams)}, this dataset reads "
                           f"{_describe(now)}; resume with the saved versions, in the same order.")

    def check_options(self, now: OrderOptions, world: int | None) -> None:
        """Refuse other order options; ``world`` given (a state without progress, which resumes
        under its own split only): other split options and world size too."""
        if world is None:
            differ = self.options.differ(now, OrderOptions.ORDER)
            if differ:
                raise InvalidInput(f"seed, shuffle, view and shuffle_window must match the saved state: "
                                   f"{', '.join(differ)}. Resume with the saved settings, or start the epoch over.")
            return
        differ = self.options.differ(now, tuple(f.name for f in fields(OrderOptions)))
        if self.world != world:
            differ.append(f"world_size={self.world} (now {world})")
        if differ:
            hint = (" (a state with its epoch's progress resumes on another world size or number of workers "
                    "through dataset.load_state_dict() or featstore.StatefulLoader)") if self.progress else ""
            raise InvalidInput(f"batch_size, seed, shuffle, view, the split and world_size must match the saved "
                               f"state: {', '.join(differ)}. Resume with the saved settings, or start the epoch "
                               f"over{hint}.")

    def for_worker(self, worker: int, workers: int) -> WorkerPosition | None:
        """This worker state's position, checked for worker ``worker`` of ``workers`` (None: it
        had not started an iteration); :class:`InvalidInput` when that worker cannot continue it.

        Another rank's state is accepted (its world size was checked): Lightning checkpoints rank
        0's loader state only and every rank resumes from it, which is right because DDP ranks step
        together and each worker of each rank has produced the same number of batches of its own
        (equal) share."""
        assert self.worker is not None
        check_workers(self.worker.workers, workers)
        if self.worker.worker != worker:
            raise InvalidInput(f"DataLoader worker {worker} was given the state of worker {self.worker.worker}: "
                               "restore the loader's state with StatefulDataLoader.load_state_dict().")
        return None if self.epoch is None else self.worker


def check_workers(saved: int | None, workers: int) -> None:
    """Refuse to resume with another number of DataLoader workers than the state's."""
    if saved is not None and max(1, saved) != max(1, workers):
        raise InvalidInput(
            f"the resume point was saved with {saved} DataLoader workers per rank and this loader "
            f"has {workers}: this state cannot tell which samples the other workers had seen. Resume "
            f"with num_workers={saved}, load the loader's state with featstore.StatefulLoader (it resumes "
            "under any number of workers), or start the epoch over without load_state_dict().")


def _describe(streams: tuple[StreamIdentity, ...]) -> str:
    return "[" + "; ".join(", ".join((f"{m.label}=" if m.label else "") + m.ref for m in s.members)
                           for s in streams) + "]"


# -- reading the formats ------------------------------------------------------------------------
def _from_2(data: dict[str, Any]) -> ReaderState:
    w = data.get("worker")
    worker = None if w is None else WorkerPosition(
        int(w["worker"]), int(w["num_workers"]), int(w["role"]), int(w["batches"]),
        None if w["split"] is None else Split(**w["split"]), int(w["since"]))
    return ReaderState(_opt_int(data, "epoch"), tuple(StreamIdentity.from_dict(s) for s in data["streams"]),
                       OrderOptions.saved(data["options"]), int(data["world_size"]), int(data["rank"]),
                       _opt_int(data, "num_workers"), int(data["batches_seen"]), _progress(data.get("progress")),
                       worker)


def _from_1(data: dict[str, Any]) -> ReaderState:
    """A rank's or a worker's state of schema version 1 (``"version"``: an id, or a mixture's ids
    joined by ``+``; ``"name"``: a name, or ``"mix(a, b)"``)."""
    ids = str(data["version"]).split("+")
    name = str(data["name"])
    names = name[4:-1].split(", ") if name.startswith("mix(") and len(ids) > 1 else [name]
    streams = tuple(StreamIdentity((Member(None, i, n),)) for i, n in zip(ids, names, strict=True))
    options = OrderOptions.saved(data["options"])
    progress = data.get("progress")
    if data.get("schema") != WORKER_SCHEMA_1:
        return ReaderState(_opt_int(data, "epoch"), streams, options, int(data["world_size"]), int(data["rank"]),
                           _opt_int(data, "num_workers"), int(data["batches_seen"]), _progress(progress))
    split = None if progress is None else Split(**progress["split"])
    worker = WorkerPosition(int(data["worker"]), int(data["num_workers"]), int(data["role"]), int(data["batches"]),
                            split, 0 if progress is None else int(progress["since"]))
    return ReaderState(_opt_int(data, "epoch"), streams, options, int(data["world_size"]), int(data["rank"]),
                       int(data["num_workers"]), 0, None if progress is None else _progress(progress["base"]), worker)


def _from_multi_1(data: dict[str, Any]) -> ReaderState:
    """A multi-teacher state of schema version 1: one state per teacher, all of the same plan."""
    teachers = data["teachers"]
    if not isinstance(teachers, dict) or not teachers:
        raise ValueError("no teachers")
    first = _from_1(next(iter(teachers.values())))
    members = tuple(Member(label, str(s["version"]), str(s["name"])) for label, s in teachers.items())
    return replace(first, streams=(StreamIdentity(members),))


def _progress(data: Any) -> ResumeState | None:
    return None if data is None else ResumeState.from_dict(data)


def _str(data: dict[str, Any], key: str) -> str:
    value = data[key]
    if not isinstance(value, str):
        raise TypeError(f"{key} must be a str, got {value!r}")
    return value


def _opt_str(data: dict[str, Any], key: str) -> str | None:
    return None if data.get(key) is None else _str(data, key)


def _opt_int(data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    return None if value is None else int(value)


def _opt_float(data: dict[str, Any], key: str) -> float | None:
    value = data.get(key)
    return None if value is None else float(value)
