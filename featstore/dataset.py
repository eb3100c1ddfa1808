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
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .arena import Arena, Slot, process_arena
from .arena import supported as arena_supported
from .cache import CacheOptions, MappedFiles, SharedCache, default_root
from .diskcache import ENTRY_TRAILER, POLICIES, DiskCacheOptions
from .diskreading import DiskObjects, scope_identity
from .errors import CorruptChunk, InvalidInput
from .format import ChunkRef, ShardFormat, decode_shard_rows, mapped_chunks, shard_format, shard_index_bytes
from .gather import ArenaRows, InPlace, window_rows
from .partcodecs import assemble, expand_fields
from .ragged import (LENGTHS, OFFSETS, RAGGED_FORMS, TOKEN_LENGTH, TOKEN_START, RaggedRows,
                     RaggedWindow, concat_rows, offsets, pad_value, padded)
from .plan import (PARTITIONS, ConsumerPlan, Piece, UniformShards, consumer_plan, round_robin_consumed,
                   window_permutation)
from .versions import Version, deleted_while_reading
from .viewreading import ViewReading

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


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class FeatureDataset(IterableDataset):
    """Stream one committed version into Model B's training loop.

    >>> ds = store.dataset("cnn-a/train", batch_size=256, shuffle=True, seed=0)
    >>> loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    >>> for epoch in range(3):
    ...     ds.set_epoch(epoch)
    ...     for batch in loader:
    ...         batch["features"].shape, batch["index"].shape   # [256, 512], [256]

    Rank and world size come from ``torch.distributed`` when it is initialised at construction
    (or at :meth:`set_epoch`), else from ``rank=``/``world_size=`` (default 0 and 1).
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
        self.rank, self.world_size = self._rank_world()
        # The epoch and the resume point live in shared memory: with persistent_workers=True
        # each DataLoader worker keeps its own copy of this object for the whole run, and
        # set_epoch()/load_state_dict() in the training process must still reach it.
        # [epoch, resume epoch (-1: none), batches seen at the resume point, DataLoader workers
        # of the last iteration + 1, workers the resume point was saved with + 1 (0: unknown)]
        self._shared = torch.tensor([0, -1, 0, 0, 0], dtype=torch.int64).share_memory_()
        self._yielded = 0
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

    def _rank_world(self) -> tuple[int, int]:
        rank, world = self._explicit
        if rank is None or world is None:
            drank, dworld = _dist_rank_world()
            rank = drank if rank is None else rank
            world = dworld if world is None else world
        if not 0 <= rank < world:
            raise InvalidInput(f"rank {rank} is out of range for world_size {world}.")
        return rank, world

    @property
    def epoch(self) -> int:
        """The epoch :meth:`set_epoch` selected (shared with every DataLoader worker)."""
        return int(self._shared[0])

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._shared[0] = int(value)

    @property
    def _resume(self) -> dict[str, int] | None:
        epoch, seen = int(self._shared[1]), int(self._shared[2])
        return None if epoch < 0 else {"epoch": epoch, "batches_seen": seen}

    @_resume.setter
    def _resume(self, value: dict[str, int] | None) -> None:
        if value is None:
            self._shared[1] = -1
        else:
            self._shared[2] = int(value["batches_seen"])
            self._shared[1] = int(value["epoch"])

    @property
    def partition(self) -> str:
        return self.options.partition or ("even" if self.world_size == 1 else "pad")

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (it changes the order); call before iterating each epoch.

        Works with ``persistent_workers=True``: the workers read the epoch from shared memory
        when the next epoch's iteration starts.
        """
        self.epoch = int(epoch)
        self.rank, self.world_size = self._rank_world()

    # -- the plan -----------------------------------------------------------------------
    def _window(self) -> int:
        return self.options.shuffle_window or 4 * self.version.manifest.layout.samples_per_shard

    def plan(self, worker: int = 0, num_workers: int = 0) -> ConsumerPlan:
        """This rank's plan for one DataLoader worker (``num_workers=0``: the main process)."""
        w = max(1, num_workers)
        layout = self.version.manifest.layout
        return consumer_plan(
            UniformShards(layout.n_samples, layout.samples_per_shard), seed=self.options.seed, epoch=self.epoch,
            shuffle=self.options.shuffle, consumers=self.world_size * w,
            cid=self.rank * w + worker, partition=self.partition, window=self._window(),
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
        """
        seen_workers = int(self._shared[3]) - 1
        return {
            "version": self.version.id, "name": self.version.name, "epoch": self.epoch,
            "batches_seen": self._yielded if batches_seen is None else int(batches_seen),
            "options": asdict(self.options), "world_size": self.world_size, "rank": self.rank,
            "num_workers": num_workers if num_workers is not None else (seen_workers if seen_workers >= 0 else None),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume mid-epoch: the next iteration skips the batches already seen (without reading
        them). Batch size, seed, world size and DataLoader workers must match the saved run:
        the order of an epoch is split across ranks and workers, so another split cannot tell
        which samples were seen. A mismatch raises :class:`InvalidInput` (world size here, the
        number of workers when the next iteration starts)."""
        if state["version"] != self.version.id:
            raise InvalidInput(f"the state is for version {state['version']}, this dataset reads "
                               f"{self.version.id}; open the pinned version with store.open("
                               f"'{state['name']}@{state['version']}').")
        saved = ReaderOptions(**{k: tuple(v) if k == "fields" and v else v for k, v in state["options"].items()})
        if (saved.batch_size, saved.seed, saved.shuffle, state["world_size"]) != (
                self.options.batch_size, self.options.seed, self.options.shuffle, self.world_size):
            raise InvalidInput("batch_size, seed, shuffle and world_size must match the saved state.")
        if saved.view != self.options.view:  # the epoch's view would differ: another sequence
            raise InvalidInput(f"view must match the saved state ({saved.view!r}).")
        self.epoch = int(state["epoch"])
        workers = state.get("num_workers")  # absent from states saved before it was recorded
        self._shared[4] = 0 if workers is None else int(workers) + 1
        self._resume = {"epoch": self.epoch, "batches_seen": int(state["batches_seen"])}

    def _check_workers(self, num_workers: int) -> None:
        """Refuse to resume with another number of DataLoader workers than the state's."""
        self._shared[3] = num_workers + 1
        saved = int(self._shared[4]) - 1
        if saved < 0 or not self._resume or self._resume["epoch"] != self.epoch:
            return
        if max(1, saved) != max(1, num_workers):
            raise InvalidInput(
                f"the resume point was saved with {saved} DataLoader workers per rank and this loader "
                f"has {num_workers}: the epoch is split across workers differently, so the samples "
                f"already seen cannot be skipped. Resume with num_workers={saved}, or start the epoch "
                "over without load_state_dict().")

    def _role_and_skip(self, worker: int, num_workers: int) -> tuple[int, int]:
        """Which consumer this worker plays, and how many of its batches to skip.

        DataLoader always starts its round-robin at worker 0; after ``k`` batches the original
        run would next have read from worker ``k % W``, so on resume worker ``w`` plays the role
        of worker ``(w + k) % W`` and the batch order continues exactly where it stopped.
        """
        if not self._resume or self._resume["epoch"] != self.epoch:
            return worker, 0
        w = max(1, num_workers)
        seen = self._resume["batches_seen"]
        counts = [self.plan(i, num_workers).n_batches(self.options.batch_size, self.options.drop_last)
                  for i in range(w)]
        role = (worker + seen) % w
        return role, round_robin_consumed(seen, counts)[role]

    # -- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 0)
        self._check_workers(num_workers)
        role, skipped = self._role_and_skip(worker, num_workers)
        plan = self.plan(role, num_workers)
        self._viewing.start_epoch(self.epoch)
        if info is None:
            self._yielded = skipped
        cid = self.rank * max(1, num_workers) + role
        for batch in self._batches(plan, cid, skipped * self.options.batch_size):
            if info is None:
                self._yielded += 1
            yield batch
        if info is None:
            self._resume = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_state": None}  # maps and file handles stay in their process

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
        if _spare_cores() < 1 and (self._proc.storage.is_local or self._disk_holds(todo)):
            # Nothing to hide on a local store (or a disk tier holding all this epoch reads) but
            # decode CPU, and no core to overlap it on: pool threads would only take turns with
            # Model B's torch threads (measured slower).
            yield from _WindowReader(self, _InThread(), todo)
            return
        with ThreadPoolExecutor(self.options.prefetch, thread_name_prefix="featstore-read") as pool:
            yield from _WindowReader(self, pool, todo)

    def _batches(self, plan: ConsumerPlan, cid: int, skip: int) -> Iterator[dict[str, torch.Tensor]]:
        """Cut windows into batches: each batch is one numpy gather of its rows from the window
        (the window is never permuted as a whole, which would copy it once more)."""
        bs = self.options.batch_size
        carry: dict[str, np.ndarray] | None = None
        for wi, drop, arrays in self._windows(plan, skip):
            n = len(arrays["index"])
            if self.options.shuffle:
                order: np.ndarray | None = window_permutation(self.options.seed, self.epoch, cid, wi, n)[drop:]
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
        return (f"FeatureDataset({self.version.name}@{self.version.id}, rank={self.rank}/"
                f"{self.world_size}, {self.options})")


class _WindowReader:
    """Keeps shuffle windows in flight and yields each once all its reads are done.

    Every (piece, array) is its own read, so one shard's arrays are fetched concurrently;
    ``prefetch`` pool threads issue them. The next window's reads are always in flight while
    the current one is consumed (a window is only usable once whole: it is permuted together),
    so S3 latency hides behind Model B instead of adding up window by window. Every read decodes
    straight into its rows of the window's buffers: no concatenation.
    """

    def __init__(self, ds: FeatureDataset, pool: ThreadPoolExecutor | _InThread,
                 todo: list[tuple[int, int, tuple[Piece, ...]]]) -> None:
        self.ds, self.pool, self.todo = ds, pool, iter(todo)
        self.specs = ds.version.manifest.arrays
        self.spp = ds.version.manifest.layout.samples_per_shard
        self.queue: deque[tuple[int, int, dict[str, Any], list[Future], tuple[Piece, ...]]] = deque()
        self.in_flight = 0  # pieces submitted and not yet consumed
        self.placed = [f for f in ds.fields if ds._in_place(f)]
        # Mapping a local uncompressed shard is bookkeeping (~0.2 ms): done here, not handed to a
        # pool thread that would wait for a core behind Model B's busy torch threads.
        local_raw = {f for f in self.placed if ds._proc.storage.is_local and not ds._shard_format(f).compressed}
        # (the disk tier's entries only under "keep", which never evicts them while this reads:
        # under "lru" an entry could go between its fetch and its mapping, and be fetched twice)
        self.disk_raw = {f for f in self.placed if ds._disk is not None and ds._disk[0].policy == "keep"
                         and not ds._shard_format(f).compressed}
        # one index_select per batch: local uncompressed objects, or the disk tier's, or the shared cache's shards
        self.arena = (set(self.placed) if ds._memory else local_raw | self.disk_raw) if arena_supported() else set()
        self.mapped = set() if ds._memory else local_raw - self.arena
        self.ragged = [f for f in ds.fields if ds.version.manifest.arrays[f].ragged]
        self.dense = [f for f in ds.fields if f not in self.placed and f not in self.ragged]
        self.chunk_rows = ds.version.manifest.layout.chunk_rows
        # Shuffled batches are gathered copies, so a consumed window's buffers are reused for a
        # later window: no fresh pages to fault in for every window (~15% of the read cost).
        # Unshuffled batches are views into the window, which the caller may keep.
        self.spare: list[dict[str, np.ndarray]] | None = [] if ds.options.shuffle else None

    def __iter__(self) -> Iterator[tuple[int, int, dict[str, np.ndarray]]]:
        arrays: dict[str, Any] = {}
        try:
            self._fill()
            while self.queue:
                wi, drop, arrays, futs, window = self.queue.popleft()
                for f in futs:
                    f.result()
                for f in self.placed:  # an arena's rows (a future), or each piece's source (a list)
                    arrays[f] = (arrays[f].result() if isinstance(arrays[f], Future)
                                 else InPlace([x.result() for x in arrays[f]], window, self.chunk_rows))
                for f in self.ragged:
                    arrays[f] = RaggedWindow([x.result()[f] for x in arrays[f]])
                self.in_flight -= len(window)
                self._fill()
                yield wi, drop, arrays
                _release(arrays.values())  # the consumer has cut every batch of this window
                if self.spare is not None:
                    self.spare.append({k: v for k, v in arrays.items() if k in self.dense or k == "index"})
        finally:
            _release(arrays.values())
            for _, _, queued, futs, _ in self.queue:  # an abandoned epoch: do not read what nobody will use
                for f in futs:
                    f.cancel()
                _release(queued.values())

    def _buffers(self, total: int) -> dict[str, np.ndarray]:
        while self.spare:
            got = self.spare.pop()
            if len(got["index"]) == total:
                return got
        return {f: np.empty((total, *self.specs[f].shape), dtype=self.specs[f].dtype) for f in self.dense}

    def _fill(self) -> None:
        """Keep ``prefetch`` pieces in flight, and the next two windows at least."""
        while self.in_flight < self.ds.options.prefetch or len(self.queue) < 2:
            nxt = next(self.todo, None)
            if nxt is None:
                return
            wi, drop, window = nxt
            arrays = self._buffers(sum(p.size for p in window))
            arrays["index"] = np.concatenate(
                [np.arange(p.shard * self.spp + p.lo, p.shard * self.spp + p.hi, dtype=np.int64) for p in window])
            futs, off = [], 0
            for p in window:
                futs += [self.pool.submit(self.ds._read_field, p, f, arrays[f][off:off + p.size])
                         for f in self.dense]
                off += p.size
            for f in self.placed:  # each piece's source; an InPlace once all are done
                # a window whose disk tier entries are not all held yet fetches them piece by
                # piece on the pool, shard by shard (the arena's pins would fetch one at a time)
                held = self.ds._entries_held(window, f) if f in self.disk_raw else None
                if f in self.arena and (held or f not in self.disk_raw):  # bookkeeping only, in this thread
                    arrays[f] = _now(self.ds._arena_rows, window, f, held)
                    futs.append(arrays[f])
                    continue
                run = _now if f in self.mapped else self.pool.submit
                arrays[f] = [run(self.ds._source, p, f) for p in window]
                futs += arrays[f]
            if self.ragged:  # each piece's token rows of every per-token array; RaggedWindows once done
                tokens = [self.pool.submit(self.ds._read_tokens, p, tuple(self.ragged)) for p in window]
                arrays.update({f: tokens for f in self.ragged})
                futs += tokens
            self.queue.append((wi, drop, arrays, futs, window))
            self.in_flight += len(window)


class _InThread:
    """An executor that runs each read in the calling thread (a finished future)."""

    def submit(self, fn: Any, *args: Any) -> Future:
        return _now(fn, *args)


def _spare_cores() -> int:
    """Cores this process may use beyond its torch intra-op threads."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores - torch.get_num_threads()


def _release(values: Any) -> None:
    """Give back the arena slots of a window's arrays (an :class:`ArenaRows`, or the finished
    future of one)."""
    for v in values:
        if isinstance(v, Future) and v.done() and not v.cancelled() and v.exception() is None:
            v = v.result()
        if isinstance(v, ArenaRows):
            v.release()


def _now(fn: Any, *args: Any) -> Future:
    """``fn(*args)`` run in the calling thread, as a finished future (its error kept in it)."""
    fut: Future = Future()
    try:
        fut.set_result(fn(*args))
    except BaseException as exc:  # noqa: BLE001 - re-raised where the result is taken, as from a pool
        fut.set_exception(exc)
    return fut


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
