"""The reader's options: :class:`ReaderOptions` (batches, shuffle windows, caches, ranks, views'
join...), checked once when a dataset is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from featstore.codecs._ragged import RAGGED_FORMS
from featstore.errors import InvalidInput
from featstore.read.plans._assignment import PARTITIONS
from featstore.read.shards._cache import DiskCacheOptions

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
            mapped back to back (:mod:`featstore.read`). ``"disk"`` keeps a remote store's shard
            objects on the node's disk (:mod:`featstore.read`): one download per object
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
        if self.cache not in ("disk", "memory+disk") and (self.cache_dir is not None or self.disk_policy != "keep"):
            raise InvalidInput("cache_dir and disk_policy configure the disk tier: pass cache='disk' or "
                               "cache='memory+disk' with them.")
        if self.disk_bytes is not None and self.cache != "memory+disk":
            raise InvalidInput("disk_bytes is the disk tier's budget under cache='memory+disk'; with "
                               "cache='disk', cache_bytes is the disk's budget.")
        self.disk_options()  # the disk tier's own options check its policy

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
