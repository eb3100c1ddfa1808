"""A reader's epochs and resume points: what a :class:`~featstore.FeatureDataset` keeps about
where it is, for itself and its DataLoader workers.

One collaborator per dataset, :class:`EpochState`, owns:

- the placement (rank, world size) and the epoch counter shared with DataLoader workers
  (:class:`~featstore.read.state._worker_share.SharedProgress`);
- the resume point loaded by ``load_state_dict`` (a :class:`~featstore.read.state.ReaderState`):
  the rank-level count and, beside it, the epoch's global progress
  (:class:`~featstore.read.plans._elastic.ResumeState`: the plan and the batches each split consumed),
  kept in a small shared buffer of its own (:class:`LoadedProgress`) so that workers started
  before the load see it too;
- what each iteration reads (:meth:`EpochState.start`): the consumer's whole share of a fresh
  epoch, or under a resume its share of the epoch's rest under the *current* split
  (:func:`~featstore.read.plans._elastic.resume`);
- the states it saves (:class:`~featstore.read.state.ReaderState`): per rank
  (``state_dict(batches_seen=k)``) and per DataLoader worker (torchdata's), both with the
  epoch's progress, and the rank-level state made of a loader's
  worker states (:meth:`EpochState.from_workers`, what :class:`featstore.StatefulLoader` loads
  under another number of workers).

**Counting.** DDP ranks step together and the global batch stays the same across splits, so
"batches this epoch" is a count of steps whatever the split: ``state_dict(batches_seen=k)`` is
the steps of the whole epoch so far (before a resume too), and the progress records the steps
since the last resume under the current split (:meth:`ResumeState.advanced`).

**Old states** (without ``"progress"``) resume under the split they were saved with, as before.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any, cast

import torch
from torch.utils.data import get_worker_info

from featstore.errors import DistributedSetupError, InvalidInput
from featstore.read.plans import (EpochOrder, Partition, ResumeState, Segment, Share, Split, check_global_batch,
                                  check_same_order, epoch_share, progress, remaining_samples, resume, rotated)
from featstore.read.state._ranks import Placement, resolve
from featstore.read.state._state import OrderOptions, ReaderState, StreamIdentity, WorkerPosition, check_workers
from featstore.read.state._worker_share import SharedProgress, Start, check_epoch, in_worker, iteration_key, on_fork


@dataclass(frozen=True)
class Iteration:
    """One iteration in one process: its epoch, who reads, and what.

    Attributes:
        role: the consumer of its rank this worker plays (another than its id on a resumed epoch).
        skip: batches of that role yielded before this iteration (a continued segment).
        share: the role's share in this iteration's segment (from its first row).
        skip_rows: rows of ``share`` already yielded.
        whole: ``share`` is the epoch's own plan for the consumer (whole windows, from the
            start of its span): what the online fill's ownership relies on.
        base: the epoch's progress before this iteration (None: unknown, an old worker state).
        split: the split this iteration reads under.
    """

    epoch: int
    placement: Placement
    worker: int
    role: int
    skip: int
    share: Share
    skip_rows: int
    whole: bool
    base: ResumeState | None
    split: Split

    @property
    def cid(self) -> int:
        return self.placement.rank * self.split.per_rank + self.role


@dataclass(frozen=True)
class WorkerResume:
    """A DataLoader worker's own saved place (torchdata's), loaded for its next iteration: the
    epoch, its position, and the epoch's progress before its iteration (None: an older featstore's)."""

    epoch: int
    position: WorkerPosition
    base: ResumeState | None


@dataclass
class _Local:
    """What one process (the training process, or one DataLoader worker) keeps of its own."""

    pid: int = dataclass_field(default_factory=os.getpid)
    count: int = 0  # iterations started here (a persistent worker tells its epochs apart by it)
    current: Iteration | None = None
    yielded: int = 0  # batches yielded by the current iteration
    planned: Placement | None = None  # a persistent worker's placement of its last iteration
    worker_resume: WorkerResume | None = None  # a torchdata worker state loaded here


class LoadedProgress:
    """The progress ``load_state_dict`` loaded, in a shared byte buffer (JSON, length first):
    a DataLoader worker reads it when its iteration starts, whenever it was started. Written
    only by the training process that owns it (a process given another's, by pickling, takes a
    copy first, as :class:`SharedProgress` does)."""

    SIZE = 1 << 16

    def __init__(self) -> None:
        self._t = torch.zeros(self.SIZE, dtype=torch.uint8).share_memory_()
        self._owner = os.getpid()

    def own(self) -> None:
        if not in_worker() and self._owner != os.getpid():
            self._t, self._owner = self._t.clone().share_memory_(), os.getpid()

    def write(self, state: ResumeState | None) -> None:
        self.own()
        data = b"" if state is None else json.dumps(state.to_dict()).encode()
        if len(data) + 8 > self.SIZE:
            raise InvalidInput(f"this epoch's progress has {len(state.segments) if state else 0} segments, more "
                               "than featstore keeps: start the epoch over.")
        self._t[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else self._t[8:8]
        self._t[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)

    def read(self) -> ResumeState | None:
        n = int.from_bytes(bytes(self._t[:8].tolist()), "little")
        if not n:
            return None
        return ResumeState.from_dict(json.loads(bytes(self._t[8:8 + n].numpy().tobytes())))


class EpochState:
    """A dataset's epochs, placement and resume points (see the module docstring)."""

    def __init__(self, streams: tuple[StreamIdentity, ...], options: OrderOptions, order: EpochOrder,
                 rank: int | None, world_size: int | None) -> None:
        self.streams, self.options, self.order = streams, options, order
        self._explicit = (rank, world_size)
        self._progress = SharedProgress()
        self._loaded = LoadedProgress()
        self._started: tuple[int, int] | None = None  # a DataLoader worker's: see SharedProgress.stamp
        self._local_state: _Local | None = None
        self.placement()  # an explicit rank out of range fails here
        on_fork(self)

    # -- placement ------------------------------------------------------------------------
    def placement(self) -> Placement:
        """In a DataLoader worker, what the training process resolved; else resolved now (and
        recorded for the workers this process starts)."""
        if in_worker():
            return self._progress.placement()
        placement = resolve(*self._explicit)
        self._progress.publish(placement)
        return placement

    def published(self) -> Placement:
        """The placement last recorded (not resolved now: possibly unresolved)."""
        return self._progress.placement()

    def _before_fork(self) -> None:
        """Called just before this process forks: the forked workers share the blocks, plan
        with this placement and know which epoch they were started for."""
        self._progress.own()
        self._loaded.own()
        self._progress.publish(resolve(*self._explicit))
        self._started = self._progress.stamp()

    def partition(self, world: int) -> Partition:
        return cast("Partition", self.options.partition or ("even" if world == 1 else "pad"))  # checked by the options

    def split(self, world: int, workers: int) -> Split:
        """The split of ``world`` ranks with ``workers`` DataLoader workers each."""
        o = self.options
        return Split(world, workers, o.batch_size, self.partition(world), o.drop_last)

    def last_workers(self) -> int | None:
        """The DataLoader workers the last iteration ran with (None before one)."""
        return self._progress.last_workers()

    # -- epochs ---------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._progress.current_epoch()

    def set_epoch(self, epoch: int) -> None:
        self._progress.set_epoch(epoch)
        self.placement()

    @property
    def local(self) -> _Local:
        if self._local_state is None or self._local_state.pid != os.getpid():
            self._local_state = _Local()
        return self._local_state

    # -- an iteration ---------------------------------------------------------------------
    def start(self) -> Iteration:
        """Resolve this iteration's placement, epoch and what it reads."""
        info, local = get_worker_info(), self.local
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 0)
        placement = self.placement().check()
        if info is not None:
            _check_unchanged(local, placement)
        self._progress.saw_workers(workers)
        saved, local.worker_resume = local.worker_resume, None
        loaded = self._loaded.read()

        def refuse_other_workers(start: Start) -> None:  # before the iteration is recorded
            if start.resume_seen is not None and (loaded is None or loaded.epoch != start.epoch):
                check_workers(start.resume_workers, workers)

        key = None if info is None else iteration_key(info.seed - info.id, local.count)
        start = self._progress.begin(0 if info is None else 1 + worker, key, local.count == 0,
                                     None if saved is None else saved.epoch, self._started if info else None,
                                     refuse_other_workers)
        local.count += 1
        split = self.split(placement.world, workers)
        if saved is not None:  # torchdata's own worker state, under the same split
            it = self._continued(start.epoch, placement, worker, split, saved.position.role, saved.position.batches,
                                 saved.base)
        elif start.resume_seen is not None:
            state = loaded if loaded is not None and loaded.epoch == start.epoch else None
            it = self._resumed(start.epoch, placement, worker, split, start.resume_seen, state)
        else:
            it = self._continued(start.epoch, placement, worker, split, worker, 0, ResumeState(start.epoch, self.order))
        local.current, local.yielded = it, 0
        return it

    def _continued(self, epoch: int, placement: Placement, worker: int, split: Split, role: int, skip: int,
                   base: ResumeState | None) -> Iteration:
        """Consumer ``role``'s whole share of the epoch's plan, ``skip`` of its batches seen."""
        share = epoch_share(self.order, epoch, split, placement.rank * split.per_rank + role)
        rows = min(skip * split.batch_size, share.n_samples)
        return Iteration(epoch, placement, worker, role, skip, share, rows, True, base, split)

    def _resumed(self, epoch: int, placement: Placement, worker: int, split: Split, seen: int,
                 state: ResumeState | None) -> Iteration:
        """The first iteration after ``load_state_dict``: the state's epoch goes on under ``split``."""
        if state is None or (len(state.segments) == 1 and state.segments[0].split.continues(split)):
            # the epoch's first segment goes on (or an old state, checked to be of this split)
            first = placement.rank * split.per_rank
            counts = progress(self.order, (Segment(split, 0),))[0].counts[first:first + split.per_rank].tolist()
            seen = min(seen, sum(counts))
            role, skip = rotated(worker, split.workers, seen, counts)
            base = state if state is not None else ResumeState(epoch, self.order).advanced(split, seen)
            return self._continued(epoch, placement, worker, split, role, skip, base)
        r = resume(state, split, placement.rank, worker)
        return Iteration(epoch, placement, worker, r.role, r.skipped, r.share, 0, False, state, split)

    # -- states ---------------------------------------------------------------------------
    def _state(self, epoch: int | None, placement: Placement, workers: int | None, batches_seen: int = 0,
               base: ResumeState | None = None, worker: WorkerPosition | None = None) -> ReaderState:
        return ReaderState(epoch, self.streams, self.options, placement.world, placement.rank, workers, batches_seen,
                           base, worker)

    def state_dict(self, batches_seen: int | None, num_workers: int | None) -> dict[str, Any]:
        """This rank's state (see :meth:`FeatureDataset.state_dict`); in a worker, the worker's."""
        if in_worker():
            return self._worker_state().to_dict()
        placement = self.placement().check()
        it = self.local.current
        workers = num_workers if num_workers is not None else self._progress.last_workers()
        base = self._base()
        prior = base.steps
        seen = prior + self.local.yielded if batches_seen is None else int(batches_seen)
        done = None
        if workers is not None and (it is None or it.base is not None):
            if seen < prior:
                raise InvalidInput(f"batches_seen={seen}, but this epoch had {prior} steps before the resume: "
                                   "pass the batches (steps) of the whole epoch so far.")
            done = base.advanced(self.split(placement.world, workers), seen - prior)
        return self._state(self.epoch, placement, workers, seen, done).to_dict()

    def _base(self) -> ResumeState:
        """The epoch's progress before this process's iteration (or the loaded one for the
        epoch the training process's workers read)."""
        it = self.local.current
        if it is not None and it.base is not None and it.epoch == self.epoch:
            return it.base
        loaded = self._loaded.read()
        if loaded is not None and loaded.epoch == self.epoch:
            return loaded
        return ResumeState(self.epoch, self.order)

    def _worker_state(self) -> ReaderState:
        info, local = get_worker_info(), self.local
        assert info is not None  # called in a worker
        it = local.current
        if it is None:
            return self._state(None, self._progress.placement(), info.num_workers,
                               worker=WorkerPosition(info.id, info.num_workers, info.id))
        position = WorkerPosition(it.worker, it.split.workers, it.role, it.skip + local.yielded,
                                  it.split if it.base is not None else None, local.yielded)
        return self._state(it.epoch, it.placement, it.split.workers, base=it.base, worker=position)

    def load_state_dict(self, data: dict[str, Any]) -> None:
        """Resume mid-epoch (see :meth:`FeatureDataset.load_state_dict`)."""
        state = ReaderState.from_dict(data)
        state.check_streams(self.streams)
        if state.worker is not None:
            if not in_worker():
                raise InvalidInput("this is one DataLoader worker's state (torchdata's StatefulDataLoader saves "
                                   "one per worker): restore it with featstore.StatefulLoader.load_state_dict().")
            state.check_options(self.options, self._progress.placement().world)
            info = get_worker_info()
            assert info is not None  # in_worker()
            # checked here, where torchdata reports a worker's error before it restores anything
            resumed = state.for_worker(info.id, info.num_workers)
            self.local.worker_resume = None if resumed is None or state.epoch is None else WorkerResume(
                state.epoch, resumed, state.progress)
            return
        if state.progress is None:  # an older featstore's state, or one saved before any iteration: the same split
            state.check_options(self.options, self.world)
            self._loaded.write(None)
            self._progress.set_resume(check_epoch(state.epoch), state.batches_seen, state.workers)
            return
        state.check_options(self.options, None)
        saved = state.progress
        check_same_order(saved.order, self.order)
        epoch = check_epoch(saved.epoch)
        if saved.segments:  # refused here, not in the first batch of every worker
            check_global_batch(saved.segments[0].split, self.split(self.world, 0))
        if not remaining_samples(saved):  # the epoch was read to its end: the next is whole
            self._loaded.write(None)
            self._progress.set_epoch(epoch + 1)
            return
        self._loaded.write(saved)
        self._progress.set_resume(epoch, saved.steps, None)

    @property
    def world(self) -> int:
        return self.placement().check().world

    def from_workers(self, states: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The rank-level state made of one loader's saved dataset states (torchdata's: one per
        worker, all of one rank at one step; or, without workers, the rank's own): the steps are
        the batches its workers produced, summed (DDP ranks step together, so any rank's states
        describe the job). None where it cannot be made with the epoch's progress (no worker had
        started; an older featstore's states): then torchdata restores them as saved."""
        parsed = [ReaderState.from_dict(s) for s in states if s]
        for p in parsed:
            p.check_streams(self.streams)
        ranks = [p for p in parsed if p.worker is None]
        if ranks:
            return ranks[0].to_dict() if len(parsed) == 1 and ranks[0].progress is not None else None
        started = [p for p in parsed if p.epoch is not None]
        if not started or any(p.progress is None or p.worker is None or p.worker.split is None for p in started):
            return None
        first = started[0]
        assert first.progress is not None and first.worker is not None and first.worker.split is not None
        since = sum(p.worker.since for p in started if p.worker is not None)
        done = first.progress.advanced(first.worker.split, since)
        return ReaderState(first.progress.epoch, self.streams, first.options, first.world, first.rank, first.workers,
                           first.progress.steps + since, done).to_dict()

    def __getstate__(self) -> dict[str, Any]:
        if not in_worker():  # pickled to start a worker (spawn): it shares the blocks, plans with this
            self._before_fork()
        return {**self.__dict__, "_local_state": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        on_fork(self)


def _check_unchanged(local: _Local, placement: Placement) -> None:
    """A persistent worker's placement must be the one its earlier iterations planned with."""
    if local.planned is not None and local.planned != placement:
        raise DistributedSetupError(
            f"the training process's placement changed from {local.planned.describe()} to "
            f"{placement.describe()} while persistent DataLoader workers kept running: their epochs "
            "would not split the samples the way the other ranks do. Build the DataLoader after "
            "init_process_group, or use persistent_workers=False.")
    local.planned = placement
