"""FeatureDataset: a torch ``IterableDataset`` over one pinned version.

Each (rank, DataLoader worker) pair reads only its own span of the epoch's plan
(:mod:`featstore.read`), with reads issued ahead on a thread pool so S3 latency hides behind
Model B's step, and yields ready batches: ``{array: tensor, ..., "index": tensor}``. The store is
opened lazily inside each worker process, so it is safe under fork and spawn.

A version with augmented views is read one view per epoch (:func:`featstore.versions.epoch_view`),
and its batches carry ``"view"``. ``source=`` joins the student's own input: each row's
``source[index]``, augmented with that (index, view)'s seed, beside A's stored outputs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from dataclasses import field as dataclass_field
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from featstore.codecs._parts import assemble, expand_fields
from featstore.codecs._ragged import LENGTHS, OFFSETS, RaggedRows, concat_rows, offsets, pad_value, padded
from featstore.errors import DistributedSetupError, InvalidInput
from featstore.read._assignment import ConsumerPlan, UniformShards, consumer_plan, consumer_span, window_permutation
from featstore.read._gather import window_rows
from featstore.read._objects import scope_identity
from featstore.read._options import ReaderOptions
from featstore.read._ranks import Placement, resolve
from featstore.read._resume import (WorkerResume, check_same_run, check_worker_state, check_workers, is_worker_state,
                                    rank_state, rotated, worker_state)
from featstore.read._sources import (Caches, Epoch, ProcessReads, ShardSource, Window, WindowRows, default_cache_bytes,
                                     read_windows)
from featstore.read._views import ViewReading
from featstore.read._worker_share import SharedProgress, Start, check_epoch, in_worker, iteration_key, on_fork
from featstore.versions._committed import HasStoredVersion, StoredVersion, stored

#: What a dataset's rows come from in one process, given that process's reads of the stored
#: version: by default the stored sources (:attr:`ProcessReads.sources`); the online reader
#: (:mod:`featstore.online`) computes them.
SourceFactory = Callable[[ProcessReads], list[ShardSource]]


def stored_sources(reads: ProcessReads) -> list[ShardSource]:
    """The stored version's sources (the default :data:`SourceFactory`)."""
    return reads.sources


@dataclass(frozen=True)
class _Iteration:
    """One iteration in one process: its epoch, who reads, and what it skips."""

    epoch: int
    placement: Placement
    worker: int
    workers: int
    role: int  # the consumer this worker plays (another than its id on a resumed epoch)
    skip: int  # batches of the role already seen (resume)
    plan: ConsumerPlan

    @property
    def cid(self) -> int:
        return self.placement.rank * max(1, self.workers) + self.role


@dataclass
class _Local:
    """What one process (the training process, or one DataLoader worker) keeps of its own."""

    pid: int = dataclass_field(default_factory=os.getpid)
    count: int = 0  # iterations started here (a persistent worker tells its epochs apart by it)
    current: _Iteration | None = None
    yielded: int = 0  # batches of the current iteration's role yielded or skipped
    planned: Placement | None = None  # a persistent worker's placement of its last iteration
    worker_resume: WorkerResume | None = None  # where a worker state torchdata loaded into this copy resumes


class FeatureDataset(IterableDataset):
    """Stream one committed version into Model B's training loop.

    >>> ds = store.dataset("cnn-a/train", batch_size=256, shuffle=True, seed=0)
    >>> loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    >>> for epoch in range(3):              # each pass over the loader reads the next epoch
    ...     for batch in loader:
    ...         batch["features"].shape, batch["index"].shape   # [256, 512], [256]

    **Epochs.** Each new iteration reads the next epoch (new order, next view): every
    ``for batch in loader`` pass (all its DataLoader workers together, persistent or not), or
    ``iter(ds)`` in a process. ``set_epoch(e)`` makes the next one read ``e`` (it wins over the
    count, which continues from it); ``load_state_dict`` resumes the saved epoch. The rules are
    in :mod:`featstore.read`.

    **Ranks.** Rank and world size are found when each epoch's iteration starts, not when the
    dataset is built: ``rank=``/``world_size=``, else ``torch.distributed``, else ``RANK`` and
    ``WORLD_SIZE`` (see :mod:`featstore.read`). DataLoader workers use what the training process
    resolved when it started them; a placement that changes under persistent workers, or that
    cannot be resolved, raises :class:`~featstore.DistributedSetupError`.

    **Resume.** :meth:`state_dict`/:meth:`load_state_dict` per rank, or per DataLoader worker
    under torchdata's ``StatefulDataLoader`` (see :mod:`featstore.read`).

    Its parts: the epoch and resume point shared with DataLoader workers
    (:class:`~featstore.read._worker_share.SharedProgress`), the view each epoch reads and the
    source join (:class:`~featstore.read._views.ViewReading`), and per process the reads of the
    version (:class:`~featstore.read._sources.ProcessReads`) with the sources the rows come from.
    """

    def __init__(self, version: StoredVersion | HasStoredVersion, *, rank: int | None = None,
                 world_size: int | None = None, options: ReaderOptions | None = None, source: Any = None,
                 augment: Any = None, source_fields: Any = None, source_id: str | None = None,
                 sources: SourceFactory = stored_sources, **option_fields: Any) -> None:
        """``source``/``augment``/``source_fields``/``source_id``: see :class:`ViewReading`;
        ``sources``: where the rows come from (:data:`SourceFactory`; the stored version's)."""
        super().__init__()
        self.version = version = stored(version)
        self.options = replace(options or ReaderOptions(), **option_fields)
        self._viewing = ViewReading(version, self.options, source, augment, source_fields, source_id)
        # an output stored in parts (``logits`` -> logits.ids, logits.values) is read whole
        fields = expand_fields(version.manifest.arrays, self.options.fields or tuple(
            f for f, a in version.manifest.arrays.items() if a.source not in ("seed", "tokens")))
        missing = sorted(set(fields) - set(version.manifest.arrays))
        if missing:
            raise InvalidInput(f"version {version.id} has no arrays {missing}; it has "
                               f"{sorted(version.manifest.arrays)}.")
        self.fields = tuple(fields)
        self._explicit = (rank, world_size)
        self._progress = SharedProgress()
        self._started: tuple[int, int] | None = None  # a DataLoader worker's: see SharedProgress.stamp
        self._placement()  # an explicit rank out of range fails here
        self._local_state: _Local | None = None
        self._sources_for = sources
        self._reads: tuple[ProcessReads, list[ShardSource]] | None = None
        # Resolved here, once: workers opening the caches later must not see a smaller budget
        # because the caches themselves have taken shared memory (or disk) meanwhile.
        disk = self.options.disk_options() if not version.storage.is_local else None
        self._caches = Caches(scope_identity(version) if self.options.cache else "",
                              (self.options.cache_bytes or default_cache_bytes()) if self.options.memory else 0,
                              disk.resolved() if disk is not None else None)
        if self._caches.memory_bytes or self._caches.disk is not None:
            # This process uses the caches from now on: the memory tier is removed only after
            # this process and every DataLoader worker have left, the disk tier's entries of this
            # version stay while it lives (see featstore.read).
            self._process()
        on_fork(self)

    def _process(self) -> ProcessReads:
        """This process's reads of the version (made afresh in a new process)."""
        if self._reads is None or self._reads[0].pid != os.getpid():
            reads = ProcessReads(self.version, self.fields, self._viewing, self._caches, self.options)
            self._reads = (reads, self._sources_for(reads))
        return self._reads[0]

    def _sources(self) -> list[ShardSource]:
        """Where this process's rows come from."""
        self._process()
        assert self._reads is not None
        return self._reads[1]

    def clear_cache(self) -> None:
        """Empty this version's caches for every process on the machine: the shared memory
        (``cache="memory"``) and the disk tier's entries (``cache="disk"``); the next reads
        decode from storage again (a process keeps what it has mapped).

        >>> ds = store.dataset("cnn-a/train", cache="memory", cache_bytes=8 * 2**30)
        >>> ds.clear_cache()
        """
        self._process().clear_cache()

    # -- placement (rank, world size) ---------------------------------------------------
    def _placement(self) -> Placement:
        """In a DataLoader worker, what the training process resolved; else resolved now (and
        recorded for the workers this process starts)."""
        if in_worker():
            return self._progress.placement()
        placement = resolve(*self._explicit)
        self._progress.publish(placement)
        return placement

    def _before_fork(self) -> None:
        """Called just before this process forks: the forked workers share this block, plan
        with this placement and know which epoch they were started for."""
        self._progress.own()
        self._progress.publish(resolve(*self._explicit))
        self._started = self._progress.stamp()

    @property
    def rank(self) -> int:
        """This process's rank, resolved now (:class:`~featstore.DistributedSetupError` if it
        cannot be)."""
        return self._placement().check().rank

    @property
    def world_size(self) -> int:
        """The world size, resolved now."""
        return self._placement().check().world

    @property
    def partition(self) -> str:
        return self._partition(self.world_size)

    def _partition(self, world: int) -> str:
        return self.options.partition or ("even" if world == 1 else "pad")

    # -- epochs -------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch of the latest iteration since the last :meth:`set_epoch` (else the epoch
        the next iteration reads); shared with every DataLoader worker."""
        return self._progress.current_epoch()

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.set_epoch(value)

    @property
    def reading_epoch(self) -> int | None:
        """The epoch this process's current iteration reads (None before one): what a reader
        built on this one joins its rows with (:class:`~featstore.read.MultiTeacherDataset`)."""
        it = self._local.current
        return None if it is None else it.epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration read ``epoch`` (later ones count on from it). Optional: each
        new iteration reads the next epoch by itself.

        Works with ``persistent_workers=True``: the workers read it from shared memory when the
        next epoch's iteration starts. A call after that iteration started (Lightning starts the
        first epoch's DataLoader before ``on_train_epoch_start``) applies to the next one.
        """
        self._progress.set_epoch(epoch)
        self._placement()

    # -- the plan -----------------------------------------------------------------------
    def _window(self) -> int:
        return self.options.shuffle_window or 4 * self.version.manifest.layout.samples_per_shard

    def plan(self, worker: int = 0, num_workers: int = 0) -> ConsumerPlan:
        """This rank's plan of :attr:`epoch` for one DataLoader worker (``num_workers=0``: the
        main process)."""
        return self._plan(self.epoch, self._placement().check(), worker, num_workers)

    def _plan(self, epoch: int, placement: Placement, role: int, num_workers: int) -> ConsumerPlan:
        w = max(1, num_workers)
        layout = self.version.manifest.layout
        return consumer_plan(
            UniformShards(layout.n_samples, layout.samples_per_shard), seed=self.options.seed, epoch=epoch,
            shuffle=self.options.shuffle, consumers=placement.world * w, cid=placement.rank * w + role,
            partition=self._partition(placement.world), window=self._window(),
        )  # type: ignore[arg-type]

    def batches_per_rank(self, num_workers: int = 0) -> int:
        """How many batches this rank yields this epoch with ``num_workers`` DataLoader workers."""
        return sum(self.plan(w, num_workers).n_batches(self.options.batch_size, self.options.drop_last)
                   for w in range(max(1, num_workers)))

    # -- resume -------------------------------------------------------------------------
    def state_dict(self, batches_seen: int | None = None, num_workers: int | None = None) -> dict[str, Any]:
        """Where this rank is in the epoch, to resume with :meth:`load_state_dict`.

        ``batches_seen`` is the number of batches the training loop consumed this epoch; without
        it, the batches this process yielded are used (right for ``num_workers=0``).
        ``num_workers`` is the DataLoader's; without it, the number the workers of the last
        iteration recorded (None before any iteration: then the resume cannot check it).

        Inside a DataLoader worker (torchdata's ``StatefulDataLoader`` asks each worker), the
        state of that worker alone: its epoch, role and batches produced.
        """
        if in_worker():
            return self._worker_state()
        placement = self._placement().check()
        return rank_state(self.version, self.options, self.epoch,
                          self._local.yielded if batches_seen is None else batches_seen, placement.world,
                          placement.rank, num_workers if num_workers is not None else self._progress.last_workers())

    def _worker_state(self) -> dict[str, Any]:
        info, local = get_worker_info(), self._local
        it = local.current
        if it is None:
            p = self._progress.placement()
            return worker_state(self.version, self.options, None, info.id, 0, info.id, info.num_workers,
                                p.world, p.rank)
        return worker_state(self.version, self.options, it.epoch, it.role, local.yielded, it.worker, it.workers,
                            it.placement.world, it.placement.rank)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume mid-epoch: the next iteration skips the batches already seen (without reading
        them). Batch size, seed, the split, world size and DataLoader workers must match the
        saved run: the order of an epoch is split across ranks and workers, so another split
        cannot tell which samples were seen. A mismatch raises :class:`InvalidInput` (world size
        here, the number of workers when the next iteration starts). A DataLoader worker's state
        (torchdata's) is loaded by that worker, for its next iteration."""
        if is_worker_state(state):
            if not in_worker():
                raise InvalidInput("this is one DataLoader worker's state (torchdata's StatefulDataLoader saves "
                                   "one per worker): restore it with StatefulDataLoader.load_state_dict().")
            check_same_run(state, self.version, self.options, self._progress.placement().world)
            info = get_worker_info()
            # checked here, where torchdata reports a worker's error before it restores anything
            self._local.worker_resume = check_worker_state(state, info.id, info.num_workers)
            return
        check_same_run(state, self.version, self.options, self.world_size)
        self._progress.set_resume(check_epoch(state["epoch"]), int(state["batches_seen"]), state.get("num_workers"))

    # -- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        # Started here, not in the generator: torchdata asks a worker for its state right after
        # iter(), before the first batch, and that state must be this iteration's. In a worker,
        # an error is raised by the first next() instead: DataLoader creates a persistent worker's
        # next iterator outside its error handling, where the error would kill the worker silently.
        if not in_worker():
            return self._iterate(self._start())
        try:
            it = self._start()
        except Exception as exc:  # noqa: BLE001 - re-raised by the first next(), in the DataLoader's handling
            return raising(exc)
        return self._iterate(it)

    @property
    def _local(self) -> _Local:
        if self._local_state is None or self._local_state.pid != os.getpid():
            self._local_state = _Local()
        return self._local_state

    def _start(self) -> _Iteration:
        """Resolve this iteration's placement, epoch, role and skipped batches."""
        info, local = get_worker_info(), self._local
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 0)
        placement = self._placement().check()
        if info is not None:
            _check_unchanged(local, placement)
        self._progress.saw_workers(workers)
        saved, local.worker_resume = local.worker_resume, None

        def refuse_other_workers(start: Start) -> None:  # before the iteration is recorded
            if start.resume_seen is not None:
                check_workers(start.resume_workers, workers)

        key = None if info is None else iteration_key(info.seed - info.id, local.count)
        start = self._progress.begin(0 if info is None else 1 + worker, key, local.count == 0,
                                     None if saved is None else saved.epoch, self._started if info else None,
                                     refuse_other_workers)
        local.count += 1
        role, skip = worker, 0
        if saved is not None:
            role, skip = saved.role, saved.batches
        elif start.resume_seen is not None:
            counts = [self._plan(start.epoch, placement, r, workers).n_batches(
                self.options.batch_size, self.options.drop_last) for r in range(max(1, workers))]
            role, skip = rotated(worker, workers, start.resume_seen, counts)
        it = _Iteration(start.epoch, placement, worker, workers, role, skip,
                        self._plan(start.epoch, placement, role, workers))
        local.current, local.yielded = it, skip
        self._viewing.start_epoch(it.epoch)
        return it

    def _iterate(self, it: _Iteration) -> Iterator[dict[str, torch.Tensor]]:
        local = self._local
        windows = read_windows(self._sources(), self._epoch(it), self.options.prefetch,
                               self.version.manifest.layout.samples_per_shard)
        for batch in self._batches(windows, it.cid, it.epoch):
            local.yielded += 1
            yield batch

    def _epoch(self, it: _Iteration) -> Epoch:
        """The iteration as its sources see it: every window of its plan, where each starts."""
        consumers, partition = it.placement.world * max(1, it.workers), self._partition(it.placement.world)
        at = consumer_span(len(self.version), consumers, it.cid, partition)[0]  # type: ignore[arg-type]
        windows = []
        for i, pieces in enumerate(it.plan.windows):
            windows.append(Window(i, pieces, at))
            at += windows[-1].size
        return Epoch(it.epoch, it.cid, consumers, partition, tuple(windows), it.skip * self.options.batch_size)

    def __getstate__(self) -> dict[str, Any]:
        if not in_worker():  # pickled to start a worker (spawn): it shares this block, plans with this
            self._before_fork()
        # maps, file handles and counts stay in their process
        return {**self.__dict__, "_reads": None, "_local_state": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        on_fork(self)

    def _batches(self, windows: Iterator[tuple[Window, dict[str, WindowRows]]], cid: int,
                 epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        """Cut windows into batches: each batch is one gather of its rows from the window (the
        window is never permuted as a whole, which would copy it once more)."""
        bs = self.options.batch_size
        carry: dict[str, np.ndarray] | None = None
        for window, arrays in windows:
            drop, n = window.drop, window.size - window.drop
            order = (window_permutation(self.options.seed, epoch, cid, window.number, n + drop)[drop:]
                     if self.options.shuffle else None)
            pos = 0
            if carry is not None:
                take = min(bs - len(carry["index"]), n)
                more = window_rows(arrays, order, drop, 0, take)
                carry = {k: concat_rows([carry[k], more[k]]) for k in arrays}
                pos = take
                if len(carry["index"]) == bs:
                    yield self._to_tensors(carry)
                    carry = None
            while n - pos >= bs:
                yield self._to_tensors(window_rows(arrays, order, drop, pos, pos + bs))
                pos += bs
            if pos < n:
                carry = window_rows(arrays, order, drop, pos, n)
        if carry is not None and not self.options.drop_last:
            yield self._to_tensors(carry)

    def _to_tensors(self, arrays: dict[str, Any]) -> dict[str, torch.Tensor]:
        out = {f: self.version.decode(f, arrays[f]) for f in self.fields if not isinstance(arrays[f], RaggedRows)}
        out.update(self._ragged(arrays))
        out["index"] = torch.from_numpy(np.ascontiguousarray(arrays["index"]))
        return self._viewing.add(assemble(self.version.manifest.arrays, out))

    def _ragged(self, arrays: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The batch's per-token arrays: flat with ``<output>.offsets``, or padded with
        ``<output>.lengths`` (``ragged="padded"``)."""
        out: dict[str, torch.Tensor] = {}
        specs = self.version.manifest.arrays
        for f in self.fields:
            rows = arrays[f]
            if not isinstance(rows, RaggedRows):
                continue
            flat, lengths = self.version.decode(f, rows.flat), torch.from_numpy(rows.lengths.astype(np.int64))
            name = specs[f].output or f
            if self.options.ragged == "padded":
                out[f] = padded(flat, lengths, pad_value(f, flat.dtype))
                out[f"{name}.{LENGTHS}"] = lengths
            else:
                out[f] = flat
                out[f"{name}.{OFFSETS}"] = torch.from_numpy(offsets(rows.lengths))
        return out

    def __repr__(self) -> str:
        p = self._progress.placement()
        where = f"rank={p.rank}/{p.world}" if p.resolved else "rank unresolved"
        return f"FeatureDataset({self.version.name}@{self.version.id}, {where}, {self.options})"


def _check_unchanged(local: _Local, placement: Placement) -> None:
    """A persistent worker's placement must be the one its earlier iterations planned with."""
    if local.planned is not None and local.planned != placement:
        raise DistributedSetupError(
            f"the training process's placement changed from {local.planned.describe()} to "
            f"{placement.describe()} while persistent DataLoader workers kept running: their epochs "
            "would not split the samples the way the other ranks do. Build the DataLoader after "
            "init_process_group, or use persistent_workers=False.")
    local.planned = placement


def raising(exc: BaseException) -> Iterator[Any]:
    """An iterator whose first next() raises ``exc``."""
    raise exc
    yield  # a generator
