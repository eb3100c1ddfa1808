"""FeatureDataset: a torch ``IterableDataset`` over one pinned version.

Each (rank, DataLoader worker) pair reads only its own span of the epoch's plan
(:mod:`featstore.plan`), with reads issued ahead on a thread pool so S3 latency hides behind
Model B's step, and yields ready batches: ``{array: tensor, ..., "index": tensor}``. The store is
opened lazily inside each worker process, so it is safe under fork and spawn.

A version with augmented views is read one view per epoch (:func:`featstore.views.epoch_view`),
and its batches carry ``"view"``. ``source=`` joins the student's own input: each row's
``source[index]``, augmented with that (index, view)'s seed, beside A's stored outputs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from dataclasses import field as dataclass_field
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .arena import Arena, Slot, process_arena
from .cache import CacheOptions, MappedFiles, SharedCache, default_root
from .diskcache import ENTRY_TRAILER, POLICIES, DiskCacheOptions
from .diskreading import DiskObjects, scope_identity
from .errors import CorruptChunk, DistributedSetupError, InvalidInput
from .format import ChunkRef, ShardFormat, decode_shard_rows, mapped_chunks, shard_format, shard_index_bytes
from .gather import ArenaRows, InPlace, window_rows
from .partcodecs import assemble, expand_fields
from .ragged import (LENGTHS, OFFSETS, RAGGED_FORMS, TOKEN_LENGTH, TOKEN_START, RaggedRows,
                     concat_rows, offsets, pad_value, padded)
from .plan import PARTITIONS, ConsumerPlan, Piece, UniformShards, consumer_plan, window_permutation
from .progress import SharedProgress, Start, check_epoch, in_worker, iteration_key, on_fork
from .ranks import Placement, resolve
from .resume import (WorkerResume, check_same_run, check_worker_state, check_workers, is_worker_state, rank_state,
                     rotated, worker_state)
from .versions import Version, deleted_while_reading
from .viewreading import ViewReading
from .windows import InThread, WindowReader, spare_cores

T = TypeVar("T")


#: ``ReaderOptions.cache``: decoded shards in shared memory, remote objects on local disk, or both.
CACHES = ("memory", "disk", "memory+disk")


@dataclass(frozen=True)
class ReaderOptions:
    """How a :class:`FeatureDataset` batches, shuffles and splits an epoch.

    Attributes:
        batch_size: samples per yielded batch (use ``DataLoader(batch_size=None)``).
        shuffle: permute shards and rows each epoch.
        seed: with the epoch, fixes the order: same seed and epoch, same batches.
        drop_last: drop each consumer's last incomplete batch.
        partition: ``"even"`` (every sample exactly once; consumers differ by at most one
            sample), ``"pad"`` (each consumer gets ``ceil(N/C)``: a few samples repeat) or
            ``"drop"`` (each gets ``floor(N/C)``). None: ``"even"`` for one rank, ``"pad"`` for
            several, so every DDP rank yields the same number of batches.
        shuffle_window: samples permuted together (spans several chunks and shards); None:
            four shards.
        prefetch: shard pieces read ahead, concurrently.
        fields: the arrays to read (None: all but the views' ``view_seed``).
        cache: ``"memory"`` keeps decoded shards in shared memory (``/dev/shm``), one copy for
            every DataLoader worker and rank on the machine: once the version fits, later epochs
            read no storage and decode nothing. Uncompressed arrays of a local store are not
            copied into it: they are read in place from the page cache (already one shared copy).
            Either way a batch of an array is one ``index_select`` over its window's shards
            mapped back to back (:mod:`featstore.arena`). ``"disk"`` keeps a remote store's shard
            objects on the node's disk (:mod:`featstore.diskcache`): one download per object
            per node, shared by every worker and rank. ``"memory+disk"``: both, the disk below
            the memory (a memory miss decodes from the disk). A local store has no disk tier: its
            files are read in place.
        cache_bytes: the cache's budget: the memory tier's, or with ``cache="disk"`` the disk's
            (its files never exceed it). None: half the free space of ``/dev/shm`` (memory), or
            what the disk cache holds plus half the free space of its folder's filesystem (disk),
            when the dataset is made.
        cache_dir: the disk tier's folder (None: ``$FEATSTORE_CACHE_DIR``, else
            ``~/.cache/featstore``); every process naming the same folder shares it.
        disk_bytes: with ``cache="memory+disk"``, the disk tier's budget (None: as for ``"disk"``).
        disk_policy: what the disk tier evicts: ``"keep"`` (never the entries of a version a live
            process reads: an epoch scan keeps one fixed set on disk) or ``"lru"``.
        view: with a version computed with views, which view each epoch reads: ``"epoch"``
            (the default: a seeded permutation of the K views per cycle of K epochs, so K
            epochs read every view of every sample once), an int (always that view) or
            ``"random"`` (one drawn per seed and epoch). Must stay None without views.
        ragged: how a per-token output (computed with ``tokens=``) comes in a batch:
            ``"flat"``: its real tokens ``[T, ...]``, sample after sample, and
            ``"<name>.offsets"`` (int64 ``[B + 1]``); ``"padded"``: ``[B, L, ...]`` padded
            (0; sparse parts with their sentinels: id -1, log-prob -inf, count 0) and
            ``"<name>.lengths"``. See :mod:`featstore.ragged`.
    """

    batch_size: int = 256
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False
    partition: str | None = None
    shuffle_window: int | None = None
    prefetch: int = 4
    fields: tuple[str, ...] | None = None
    cache: str | None = None
    cache_bytes: int | None = None
    cache_dir: str | None = None
    disk_bytes: int | None = None
    disk_policy: str = "keep"
    view: str | int | None = None
    ragged: str = "flat"

    def __post_init__(self) -> None:
        if self.ragged not in RAGGED_FORMS:
            raise InvalidInput(f"ragged must be one of {RAGGED_FORMS}, got {self.ragged!r}.")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise InvalidInput(f"batch_size must be a positive int, got {self.batch_size!r}.")
        if self.partition is not None and self.partition not in PARTITIONS:
            raise InvalidInput(f"partition must be one of {PARTITIONS} or None, got {self.partition!r}.")
        if self.prefetch < 1:
            raise InvalidInput("prefetch must be at least 1.")
        if self.cache is not None and self.cache not in CACHES:
            raise InvalidInput(f"cache must be one of {CACHES} or None, got {self.cache!r}.")
        for name in ("cache_bytes", "disk_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidInput(f"{name} must be a positive int, got {value!r}.")
        self._check_disk()

    def _check_disk(self) -> None:
        disk = self.cache in ("disk", "memory+disk")
        if not disk and (self.cache_dir is not None or self.disk_policy != "keep"):
            raise InvalidInput("cache_dir and disk_policy configure the disk tier: pass cache='disk' or "
                               "cache='memory+disk' with them.")
        if self.disk_bytes is not None and self.cache != "memory+disk":
            raise InvalidInput("disk_bytes is the disk tier's budget under cache='memory+disk'; with "
                               "cache='disk', cache_bytes is the disk's budget.")
        if self.disk_policy not in POLICIES:
            raise InvalidInput(f"disk_policy must be one of {POLICIES}, got {self.disk_policy!r}.")

    @property
    def memory(self) -> bool:
        """Whether decoded shards go through the shared-memory tier."""
        return self.cache in ("memory", "memory+disk")

    def disk_options(self) -> DiskCacheOptions | None:
        """The disk tier's options (its budget not yet resolved), or None without one."""
        if self.cache not in ("disk", "memory+disk"):
            return None
        budget = self.cache_bytes if self.cache == "disk" else self.disk_bytes
        return DiskCacheOptions(self.cache_dir, budget, self.disk_policy)


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
    in :mod:`featstore.progress`.

    **Ranks.** Rank and world size are found when each epoch's iteration starts, not when the
    dataset is built: ``rank=``/``world_size=``, else ``torch.distributed``, else ``RANK`` and
    ``WORLD_SIZE`` (see :mod:`featstore.ranks`). DataLoader workers use what the training process
    resolved when it started them; a placement that changes under persistent workers, or that
    cannot be resolved, raises :class:`~featstore.DistributedSetupError`.

    **Resume.** :meth:`state_dict`/:meth:`load_state_dict` per rank, or per DataLoader worker
    under torchdata's ``StatefulDataLoader`` (see :mod:`featstore.resume`).
    """

    def __init__(self, version: Version, *, rank: int | None = None, world_size: int | None = None,
                 options: ReaderOptions | None = None, source: Any = None, augment: Any = None,
                 source_fields: Any = None, source_id: str | None = None, **option_fields: Any) -> None:
        """``source``/``augment``/``source_fields``/``source_id``: see :class:`ViewReading`."""
        super().__init__()
        self.version = version
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
        self._state: _ProcessState | None = None
        # Resolved here, once: workers opening the cache later must not see a smaller budget
        # because the cache itself has taken shared memory (or disk) meanwhile.
        self._memory = self.options.memory
        self._cache_bytes = (self.options.cache_bytes or _default_cache_bytes()) if self._memory else 0
        disk = self.options.disk_options() if not version.storage.is_local else None
        self._disk = (disk.resolved(), scope_identity(version)) if disk is not None else None
        if self._memory:
            # This process is a user of the shared cache from now on, so it is removed only
            # after this process and every DataLoader worker have left (see featstore.cache).
            self._shared_cache()
        if self._disk is not None:
            self._disk_objects()  # this process reads the version: its entries are in use
        on_fork(self)

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
        built on this one joins its rows with (:mod:`featstore.multiread`)."""
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
            return _raising(exc)
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
        for batch in self._batches(it.plan, it.cid, it.skip * self.options.batch_size, it.epoch):
            local.yielded += 1
            yield batch

    def __getstate__(self) -> dict[str, Any]:
        if not in_worker():  # pickled to start a worker (spawn): it shares this block, plans with this
            self._before_fork()
        # maps, file handles and counts stay in their process
        return {**self.__dict__, "_state": None, "_local_state": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        on_fork(self)

    @property
    def _proc(self) -> _ProcessState:
        if self._state is None or self._state.pid != os.getpid():
            self._state = _ProcessState(self.version)
        return self._state

    def _shard_format(self, field: str) -> ShardFormat | None:
        """The field's shard format when the fast path can read it (cached per process)."""
        formats = self._proc.formats
        if field not in formats:
            # every view has the same layout: one format per field
            formats[field] = shard_format(self._viewing.reading.array(field))
        return formats[field]

    def _in_place(self, field: str) -> bool:
        """Whether the field's pieces are read where they lie (a mapped local object, an
        uncompressed object as fetched, or the shared cache) rather than copied into a window
        buffer."""
        fmt = self._shard_format(field)
        return (fmt is not None and not self.version.manifest.arrays[field].ragged
                and (self._memory or not fmt.compressed))

    def _shared_cache(self) -> SharedCache:
        st = self._proc
        if st.cache is None:
            storage = self.version.storage
            where = os.path.abspath(storage.root) if storage.is_local else storage.url
            identity = f"{where}|{self.version.key}|{self.version.id}"
            st.cache = SharedCache.open(CacheOptions(self._cache_bytes), identity)
            st.cache.trim(self._cache_bytes)
        return st.cache

    def _disk_objects(self) -> DiskObjects | None:
        """This process's reads through the disk tier, or None (no disk tier, or a local store)."""
        if self._disk is None:
            return None
        st = self._proc
        if st.disk is None:
            st.disk = DiskObjects(self.version, st.storage, *self._disk, st.maps)
        return st.disk

    def clear_cache(self) -> None:
        """Empty this version's caches for every process on the machine: the shared memory
        (``cache="memory"``) and the disk tier's entries (``cache="disk"``); the next reads
        decode from storage again (a process keeps what it has mapped).

        >>> ds = store.dataset("cnn-a/train", cache="memory", cache_bytes=8 * 2**30)
        >>> ds.clear_cache()
        """
        if self._memory:
            self._shared_cache().clear()
        disk = self._disk_objects()
        if disk is not None:
            disk.cache.clear()

    def _with_object(self, ref: ChunkRef, shard: int, use: Callable[[Any], T], keep: bool = True) -> T:
        """``use(bytes)`` of one shard object: through the disk tier when there is one (a damaged
        cache entry is fetched again), else :meth:`_object`."""
        disk = self._disk_objects()
        if disk is None:
            return use(self._object(ref, shard, keep))
        fmt = self._shard_format(ref.array)
        assert fmt is not None
        return disk.use(self._object_key(ref, shard), ref, fmt, use, keep)

    def _object(self, ref: ChunkRef, shard: int, keep: bool = True) -> Any:
        """One shard object's bytes: mapped for a local store (no copy), else read whole.
        ``keep=False``: read once (decoded into the shared cache), so not kept mapped."""
        st = self._proc
        key = self._object_key(ref, shard)
        if st.storage.is_local:
            try:
                data: Any = st.maps.get(st.storage.path(key), keep)
            except FileNotFoundError:
                data = None
        else:
            data = st.storage.read_bytes(key)
        if data is None or len(data) == 0:
            if data is None and self.version.was_deleted():
                raise deleted_while_reading(self.version.ref)
            raise CorruptChunk.damaged(ref.version, ref.array, ref.chunk, "is missing" if data is None else "is empty")
        return data

    def _object_key(self, ref: ChunkRef, shard: int) -> str:
        # a base's folder for an inherited shard; this epoch's view's group with views
        return self._viewing.reading.object_key(ref.array, shard)

    def _source(self, piece: Piece, field: str, data: Any = None) -> np.ndarray:
        """The piece's whole shard as ``(chunks, chunk_rows, *row)``: mapped in place (local,
        uncompressed) or decoded once per machine into the shared cache.

        A mapped chunk's crc32c is checked once per map, not on every epoch (that cost ~0.12 of
        a read-only epoch, docs/benchmarks.md): a file rewritten or replaced since is mapped
        afresh and checked again; what a map no longer covers is a damage below the page cache
        after the check, which ``verify()`` finds."""
        fmt = self._shard_format(field)
        assert fmt is not None
        ref = ChunkRef(self.version.ref, field, self._viewing.reading.chunk_key(field, piece.shard))
        start, stop = self.version.manifest.layout.shard_range(piece.shard)
        n = -(-(stop - start) // fmt.chunk_rows)
        if not fmt.compressed and not self._memory and not self._proc.storage.is_local:
            return self._fetched(piece, field, fmt, n, ref, data)
        if self._proc.storage.is_local and not fmt.compressed:
            data = self._object(ref, piece.shard)
            checked = self._proc.maps.checked(self._proc.storage.path(self._object_key(ref, piece.shard)), data)
            todo = [c for c in range(piece.lo // fmt.chunk_rows, -(-piece.hi // fmt.chunk_rows)) if c not in checked]
            arr = mapped_chunks(data, fmt, n, todo, ref)
            if arr is not None:
                checked.update(todo)
                return arr
        return self._cached(fmt, n, ref, piece.shard)

    def _arena_rows(self, window: tuple[Piece, ...], field: str, held: list[str] | None = None) -> ArenaRows | InPlace:
        """A window's pieces of an array held in this process's arena (one ``index_select`` per
        batch, :mod:`featstore.arena`): the stored objects of an uncompressed array (a local
        store's files, or the disk tier's entries), else the decoded shards of the shared cache.
        Shard by shard (:meth:`_source`) when a shard does not fit a slot, is not laid out back
        to back, or cannot be cached."""
        fmt = self._shard_format(field)
        assert fmt is not None
        disk = None if self._memory else self._disk_objects()
        stored = not fmt.compressed and (self._proc.storage.is_local or disk is not None)
        per_chunk = fmt.stored_stride if stored else fmt.chunk_rows * fmt.row_bytes
        tail = shard_index_bytes(fmt) + (ENTRY_TRAILER if disk is not None else 0)
        arena = process_arena(fmt.chunks_per_shard * per_chunk + tail * stored, MAPPED_BYTES)
        # the disk tier's entry of each piece (``held``: known to be there), or the bytes fetched
        # for one that could not be kept
        entries: list[Any] | None = held or (
            [disk.entry(*self._entry_args(p, field, fmt)) for p in window] if stored and disk else None)
        if arena is not None and (entries is None or all(isinstance(e, str) for e in entries)):
            slots: list[Slot] = []
            try:
                for i, piece in enumerate(window):
                    slot = (self._pin_cached(arena, piece, field, fmt) if not stored
                            else self._pin(arena, piece, field, fmt, None if entries is None else entries[i]))
                    if slot is None:
                        break
                    slots.append(slot)
                else:
                    return ArenaRows(arena, slots, window, fmt, stored)
            except BaseException:
                for slot in slots:
                    arena.unpin(slot)
                raise
            for slot in slots:  # a shard that cannot be held: this window is read shard by shard
                arena.unpin(slot)
        fetched = [None if entries is None or isinstance(e, str) else e for e in entries or window]
        return InPlace([self._source(p, field, data) for p, data in zip(window, fetched, strict=True)],
                       window, fmt.chunk_rows)

    def _disk_holds(self, todo: list[tuple[int, int, tuple[Piece, ...]]]) -> bool:
        """Whether the disk tier holds every shard object these windows read (then an epoch reads
        no storage, as from a local store)."""
        disk = self._disk_objects()
        if disk is None or any(self._shard_format(f) is None or self.version.manifest.arrays[f].ragged
                               for f in self.fields):
            return False
        shards = sorted({p.shard for _, _, window in todo for p in window})
        return all(disk.holds(self._viewing.reading.object_key(f, s)) for f in self.fields for s in shards)

    def _entries_held(self, window: tuple[Piece, ...], field: str) -> list[str] | None:
        """The disk tier's file of every piece's shard object of ``field``, or None when it does
        not hold them all now."""
        disk = self._disk_objects()
        assert disk is not None
        paths = [disk.holds(self._viewing.reading.object_key(field, p.shard)) for p in window]
        return paths if all(paths) else None  # type: ignore[return-value]

    def _entry_args(self, piece: Piece, field: str, fmt: ShardFormat) -> tuple[str, ChunkRef, ShardFormat]:
        ref = ChunkRef(self.version.ref, field, self._viewing.reading.chunk_key(field, piece.shard))
        return self._object_key(ref, piece.shard), ref, fmt

    def _pin_cached(self, arena: Arena, piece: Piece, field: str, fmt: ShardFormat) -> Slot | None:
        """The piece's decoded shard, from the shared cache (decoded and inserted on a miss),
        held in ``arena``; None when it cannot be cached (then read shard by shard)."""
        ref = ChunkRef(self.version.ref, field, self._viewing.reading.chunk_key(field, piece.shard))
        cache = self._shared_cache()
        key = self._cache_key(ref, piece.shard)
        for attempt in range(2):
            try:
                slot = arena.pin(cache.path(key))
            except FileNotFoundError:  # a miss (or evicted by another process meanwhile)
                slot = None
            except OSError:  # no memory map left: read shard by shard
                return None
            if slot is not None:
                cache.touch(key)
                return slot
            if attempt == 0:
                start, stop = self.version.manifest.layout.shard_range(piece.shard)
                self._cached(fmt, -(-(stop - start) // fmt.chunk_rows), ref, piece.shard)
                arena.drop_stale()  # what the insert evicted: free its memory in this process too
        return None

    def _pin(self, arena: Arena, piece: Piece, field: str, fmt: ShardFormat, entry: str | None = None) -> Slot | None:
        """The piece's shard object (a local store's file, or ``entry``: its disk tier file) held
        in ``arena``, its layout and the piece's chunks checked (crc32c once per mapping, as in
        :meth:`_source`); None: read it shard by shard (that path says why a missing object is
        missing, and fetches a damaged disk entry again)."""
        ref = ChunkRef(self.version.ref, field, self._viewing.reading.chunk_key(field, piece.shard))
        try:
            slot = arena.pin(entry or self._proc.storage.path(self._object_key(ref, piece.shard)))
        except OSError:  # missing (that path says why), or no memory map left: read shard by shard
            return None
        if slot is None:
            return None
        try:
            view = arena.view(slot)
            if entry is not None:  # the trailer off (None: torn); a damaged entry is fetched again
                view = self._disk_objects().body(view, self._object_key(ref, piece.shard))  # type: ignore[union-attr]
            todo = [c for c in range(piece.lo // fmt.chunk_rows, -(-piece.hi // fmt.chunk_rows))
                    if c not in slot.checked]
            if view is not None and (todo or not slot.checked):
                start, stop = self.version.manifest.layout.shard_range(piece.shard)
                if mapped_chunks(view, fmt, -(-(stop - start) // fmt.chunk_rows), todo, ref) is None:
                    view = None  # not laid out back to back
            if view is None:
                arena.unpin(slot)
                return None
            slot.checked.update(todo)
        except CorruptChunk:
            arena.unpin(slot)
            if entry is None:
                raise
            self._disk_objects().discard(self._object_key(ref, piece.shard))  # type: ignore[union-attr]
            return None
        except BaseException:
            arena.unpin(slot)
            raise
        return slot

    def _fetched(self, piece: Piece, field: str, fmt: ShardFormat, n: int, ref: ChunkRef,
                 data: Any = None) -> np.ndarray:
        """An uncompressed shard of a remote store as ``(chunks, chunk_rows, *row)``: batches
        gather straight from the fetched object's bytes once the piece's chunks pass their
        crc32c (no copy into a window buffer). A piece needing only a few of the shard's chunks
        reads just those (:meth:`Version.read_shard_rows`) into an array of the shard's shape
        whose other rows are never touched."""
        c0, c1 = piece.lo // fmt.chunk_rows, -(-piece.hi // fmt.chunk_rows)
        full = np.empty((n * fmt.chunk_rows, *fmt.row_shape), dtype=fmt.dtype)
        if data is None and self._disk is None and 2 * (c1 - c0) <= fmt.chunks_per_shard:  # a few chunks, by range
            self._read_field(piece, field, full[piece.lo:piece.hi])
            return full.reshape(n, fmt.chunk_rows, *fmt.row_shape)

        def gather(data: Any) -> np.ndarray:
            if (arr := mapped_chunks(data, fmt, n, range(c0, c1), ref)) is not None:
                return arr
            # fetched whole, chunks not back to back: decoded from those bytes
            decode_shard_rows(data, fmt, piece.lo, piece.hi, full[piece.lo:piece.hi], ref)
            return full.reshape(n, fmt.chunk_rows, *fmt.row_shape)

        return gather(data) if data is not None else self._with_object(ref, piece.shard, gather)

    def _cache_key(self, ref: ChunkRef, shard: int) -> str:
        return f"{ref.array}.{shard}" + ("" if self._viewing.view is None else f".v{self._viewing.view}")

    def _cached(self, fmt: ShardFormat, n: int, ref: ChunkRef, shard: int) -> np.ndarray:
        """The shard decoded, from the shared cache (decoded and inserted on a miss; kept by
        this process alone when it cannot fit)."""
        shape = (n, fmt.chunk_rows, *fmt.row_shape)
        dtype = np.dtype(fmt.dtype)

        cache = self._shared_cache() if self._memory else None

        def decode(out: np.ndarray) -> None:  # raises on a bad crc32c: nothing is cached then
            # With the cache, the stored object is read to be decoded once per machine: its
            # mapping is dropped with the last reference, not kept resident in this process.
            self._with_object(ref, shard, lambda data: decode_shard_rows(
                data, fmt, 0, n * fmt.chunk_rows, out.reshape(n * fmt.chunk_rows, *fmt.row_shape), ref),
                keep=cache is None)

        key = self._cache_key(ref, shard)
        view = cache.get(key) if cache is not None else None
        if view is None and cache is not None:
            view = cache.put(key, int(np.prod(shape)) * dtype.itemsize,
                             lambda buf: decode(np.frombuffer(buf, dtype=dtype).reshape(shape)), self._cache_bytes)
        if view is None:
            out = np.empty(shape, dtype=dtype)
            decode(out)
            return out
        return np.frombuffer(view, dtype=dtype).reshape(shape)

    def _read_field(self, piece: Piece, field: str, out: np.ndarray, tokens: bool = False) -> None:
        """Rows of one piece of one array, stored dtype, written into ``out``.

        Fast path: the shard object read whole (one GET on S3), or by range when the piece
        needs only a few of its chunks (see :meth:`Version.read_shard_rows`), decoded here, in the
        calling reader thread, so decoding runs in parallel across threads (zstd and crc32c
        release the GIL) instead of queueing on zarr's single event-loop thread. Arrays in any
        other layout are read through zarr.
        """
        start = piece.shard * self.version.manifest.layout.samples_per_shard
        fmt = self._shard_format(field)
        reading = self._viewing.reading  # this epoch's view (the version itself without views)
        if fmt is None and not tokens:
            out[...] = reading.read_rows(field, start + piece.lo, start + piece.hi)
            return
        if not self._proc.storage.is_local and self._disk is None:  # whole object, or by range for a few chunks
            reading.read_shard_rows(self._proc.storage, field, fmt, piece.shard, piece.lo, piece.hi, out)
            return
        ref = ChunkRef(self.version.ref, field, reading.chunk_key(field, piece.shard))
        self._with_object(ref, piece.shard, lambda data: decode_shard_rows(data, fmt, piece.lo, piece.hi, out, ref))

    def _read_tokens(self, piece: Piece, fields: tuple[str, ...]) -> dict[str, RaggedRows]:
        """A piece's token rows of each per-token array in ``fields``: the piece's samples'
        tokens are one run of rows in their shard, found once from the piece's
        ``token_start``/``token_length``."""
        spec = self.version.manifest.arrays
        lengths = np.empty(piece.size, dtype=spec[TOKEN_LENGTH].dtype)
        starts = np.empty(piece.size, dtype=spec[TOKEN_START].dtype)
        self._read_field(piece, TOKEN_LENGTH, lengths)
        self._read_field(piece, TOKEN_START, starts)
        out = {}
        for field in fields:
            first = piece.shard * spec[field].tokens[0]
            lo = int(starts[0]) - first if piece.size else 0
            hi = lo + int(lengths.sum(dtype=np.int64))
            rows = np.empty((hi - lo, *spec[field].shape), dtype=spec[field].dtype)
            if hi > lo and self._shard_format(field) is None:
                rows[...] = self._viewing.reading.read_rows(field, first + lo, first + hi)
            elif hi > lo:
                self._read_field(Piece(piece.shard, lo, hi), field, rows, tokens=True)
            out[field] = RaggedRows(rows, lengths)
        return out

    def _windows(self, plan: ConsumerPlan, skip: int) -> Iterator[tuple[int, int, dict[str, np.ndarray]]]:
        """Read windows ahead on a thread pool; yield (window index, rows to drop, arrays)."""
        todo: list[tuple[int, int, tuple[Piece, ...]]] = []
        pos = 0
        for wi, window in enumerate(plan.windows):
            size = sum(p.size for p in window)
            if pos + size > skip:
                todo.append((wi, max(0, skip - pos), window))
            pos += size
        if spare_cores() < 1 and (self._proc.storage.is_local or self._disk_holds(todo)):
            # Nothing to hide on a local store (or a disk tier holding all this epoch reads) but
            # decode CPU, and no core to overlap it on: pool threads would only take turns with
            # Model B's torch threads (measured slower).
            yield from WindowReader(self, InThread(), todo)
            return
        with ThreadPoolExecutor(self.options.prefetch, thread_name_prefix="featstore-read") as pool:
            yield from WindowReader(self, pool, todo)

    def _batches(self, plan: ConsumerPlan, cid: int, skip: int, epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        """Cut windows into batches: each batch is one numpy gather of its rows from the window
        (the window is never permuted as a whole, which would copy it once more)."""
        bs = self.options.batch_size
        carry: dict[str, np.ndarray] | None = None
        for wi, drop, arrays in self._windows(plan, skip):
            n = len(arrays["index"])
            if self.options.shuffle:
                order: np.ndarray | None = window_permutation(self.options.seed, epoch, cid, wi, n)[drop:]
            else:
                order = None

            n -= drop
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


def _raising(exc: BaseException) -> Iterator[Any]:
    """An iterator whose first next() raises ``exc``."""
    raise exc
    yield  # a generator


#: Bytes of local shard objects one process keeps mapped: faulting a mapping's pages in again
#: costs about as much as copying them, so a version up to this size is mapped once per process.
MAPPED_BYTES = 256 * 2**20
_MAPS: tuple[int, MappedFiles] | None = None
_MAPS_LOCK = threading.Lock()


def process_maps() -> MappedFiles:
    """This process's mapped shard objects, shared by all its readers (so each chunk's crc32c
    is checked once per process); a forked child starts its own (a lock may have been held
    by another thread at the fork)."""
    global _MAPS
    with _MAPS_LOCK:
        if _MAPS is None or _MAPS[0] != os.getpid():
            _MAPS = (os.getpid(), MappedFiles(MAPPED_BYTES))
        return _MAPS[1]


class _ProcessState:
    """What one process reads with: its own storage (an fsspec filesystem is neither fork- nor
    loop-safe), the shard formats, mapped shard objects,
    and its handle on the shared cache."""

    def __init__(self, version: Version) -> None:
        self.pid = os.getpid()
        self.storage = version.storage.reopen()
        self.formats: dict[str, ShardFormat | None] = {}
        self.maps = process_maps()
        self.cache: SharedCache | None = None
        self.disk: DiskObjects | None = None


def _default_cache_bytes() -> int:
    """Half the free space where the shared cache lives."""
    st = os.statvfs(default_root())
    return max(1, st.f_bavail * st.f_frsize // 2)
