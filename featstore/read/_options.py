"""The reader's keywords, declared once: :class:`ReaderOptions` (batches, shuffle windows, caches,
views, per-token form), and :class:`ReadKeywords`, every keyword a reader takes (the options, and
the rank, the DataLoader workers, the source join, a mixture's epoch size), checked once when a
reader is made (:func:`read_call`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from featstore._keywords import given, inherit_attributes
from featstore._user_types import FieldKey, MapDataset
from featstore.codecs import RAGGED_FORMS
from featstore.errors import InvalidInput
from featstore.read.plans import PARTITIONS
from featstore.read.shards import DiskCacheOptions
from featstore.versions import Augment

#: ``source_fields=``: the source item's fields to join (a list of keys, or batch name -> key).
SourceFields = Sequence[FieldKey] | Mapping[str, FieldKey] | None

@dataclass(frozen=True)
class Join:
    """The student's own input beside A's stored outputs: each row's ``source[index]``,
    augmented with that row's seed (the view's with views, else one drawn from the reader's
    seed, the epoch and the index), checked to be the dataset the version was computed on.

    Attributes:
        source: the map-style dataset the version was computed on.
        augment: with views, the function they were computed with (the joined input is then
            the view A saw); without, a fresh augmentation of the student's input each epoch.
        fields: the item's fields to join (None: all of a dict item but those the batch holds,
            ``input`` for a tensor, ``field<i>`` for a tuple), or batch name -> key.
        source_id: the ``dataset_id`` the version was computed with, if it was.
    """

    source: MapDataset
    augment: Augment | None = None
    fields: SourceFields = None
    source_id: str | None = None


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
        fields: the arrays to read (None: all but the views' ``view_seed``); with several
            teachers, ``{label: [arrays]}`` reads other arrays of each (a teacher left out reads all).
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
    fields: tuple[str, ...] | Mapping[str, tuple[str, ...]] | None = None
    cache: str | None = None
    cache_bytes: int | None = None
    cache_dir: str | None = None
    disk_bytes: int | None = None
    disk_policy: str = "keep"
    view: str | int | None = None
    ragged: str = "flat"

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", _fields(self.fields))  # lists as tuples: states compare them
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


def _fields(value: object) -> tuple[str, ...] | dict[str, tuple[str, ...]] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Mapping):
        return {str(k): _fields(v) for k, v in value.items()}  # type: ignore[misc]  # a label's arrays: a tuple
    if isinstance(value, Sequence):
        return tuple(str(f) for f in value)
    raise InvalidInput(f"fields must be a list of array names (or {{teacher label: [arrays]}}), got {value!r}.")


@dataclass(frozen=True, kw_only=True)
class ReadKeywords(ReaderOptions):
    """Every keyword a reader takes (``store.dataset``, ``featstore.mix``, ``Version.dataset``,
    :class:`~featstore.FeatureDataset`): :class:`ReaderOptions`' fields, and the ones below.

    Attributes:
        options: the :class:`ReaderOptions` to start from (the keywords given override its fields).
        rank: this process's DDP rank; ``world_size``: the ranks. None: found when each epoch's
            iteration starts (``torch.distributed``, else ``RANK``/``WORLD_SIZE``).
        world_size: see ``rank``.
        num_workers: the DataLoader workers per rank that will read it: what ``len()`` counts
            this rank's batches with, and what ``state_dict()`` records. None: as many as the last
            iteration had (0 before one).
        source: the dataset to join to every row (the student's input, beside A's outputs; see
            :class:`~featstore.read.Join`); ``augment``, ``source_fields``, ``source_id``: the join's.
            A mixture's streams each take their own :class:`~featstore.read.Join`.
        augment: see ``source``.
        source_fields: see ``source``.
        source_id: see ``source``.
        epoch_size: a mixture's samples per epoch with proportions (None: the streams' sizes summed).
    """

    options: ReaderOptions | None = None
    rank: int | None = None
    world_size: int | None = None
    num_workers: int | None = None
    source: MapDataset | None = None
    augment: Augment | None = None
    source_fields: SourceFields = None
    source_id: str | None = None
    epoch_size: int | None = None

    def __init_subclass__(cls, **kwargs: object) -> None:
        """A reader's entry with keywords of its own (``store.dataset``: ``teacher``) documents them all."""
        super().__init_subclass__(**kwargs)
        inherit_attributes(cls)


#: The fields of :class:`ReaderOptions` (the rest of :class:`ReadKeywords` is the reader's own).
OPTION_FIELDS = tuple(f.name for f in fields(ReaderOptions))


@dataclass(frozen=True)
class ReadCall:
    """A reader's keywords, checked and grouped: its options, placement, DataLoader workers, join
    (of its one stream) and a mixture's epoch size."""

    options: ReaderOptions
    rank: int | None = None
    world_size: int | None = None
    num_workers: int | None = None
    join: Join | None = None
    epoch_size: int | None = None


def read_call(keywords: dict[str, Any], cls: type[ReadKeywords] = ReadKeywords) -> ReadCall:
    """The :class:`ReadCall` of the keywords a reader was given (checked by ``cls``: an unknown
    keyword is a ``TypeError``, a bad option :class:`InvalidInput`)."""
    k = given(cls, keywords)
    options = replace(k.options or ReaderOptions(), **{f: v for f, v in keywords.items() if f in OPTION_FIELDS})
    if k.source is None and (k.augment is not None or k.source_fields is not None or k.source_id is not None):
        raise InvalidInput("augment=, source_fields= and source_id= need source= (the dataset to join).")
    join = None if k.source is None else Join(k.source, k.augment, k.source_fields, k.source_id)
    if k.num_workers is not None and (isinstance(k.num_workers, bool) or not isinstance(k.num_workers, int)
                                      or k.num_workers < 0):
        raise InvalidInput(f"num_workers must be an int >= 0 (the DataLoader's), got {k.num_workers!r}.")
    return ReadCall(options, k.rank, k.world_size, k.num_workers, join, k.epoch_size)
