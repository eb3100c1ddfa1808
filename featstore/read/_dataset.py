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
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from featstore.codecs._parts import assemble, expand_fields
from featstore.codecs._ragged import LENGTHS, OFFSETS, RaggedRows, concat_rows, offsets, pad_value, padded
from featstore.errors import InvalidInput
from featstore.format import SERVED_SOURCES
from featstore.read._assignment import ConsumerPlan, UniformShards, consumer_plan, consumer_span
from featstore.read._elastic import EpochOrder
from featstore.read._epoch_state import EpochState, Iteration
from featstore.read._gather import BatchRows, window_rows
from featstore.read._objects import scope_identity
from featstore.read._options import ReaderOptions
from featstore.read._slices import slice_reads, slice_rows
from featstore.read._sources import (Caches, Epoch, ProcessReads, ShardSource, Window, WindowRows, default_cache_bytes,
                                     read_windows)
from featstore.read._views import ViewReading
from featstore.read._worker_share import in_worker
from featstore.versions._committed import HasStoredVersion, StoredVersion, stored

#: What a dataset's rows come from in one process, given that process's reads of the stored
#: version: by default the stored sources (:attr:`ProcessReads.sources`); the online reader
#: (:mod:`featstore.online`) computes them.
SourceFactory = Callable[[ProcessReads], list[ShardSource]]


def stored_sources(reads: ProcessReads) -> list[ShardSource]:
    """The stored version's sources (the default :data:`SourceFactory`)."""
    return reads.sources


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
    under torchdata's ``StatefulDataLoader``; a state resumes the epoch under any split with the
    same global batch (world size x DataLoader workers: :class:`featstore.StatefulLoader` for
    torchdata's per-worker states; see ``docs/elastic.md``).

    Its parts: the epochs, placement and resume points shared with DataLoader workers
    (:class:`~featstore.read._epoch_state.EpochState`), the view each epoch reads and the
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
            f for f, a in version.manifest.arrays.items() if a.source in SERVED_SOURCES))
        missing = sorted(set(fields) - set(version.manifest.arrays))
        if missing:
            raise InvalidInput(f"version {version.id} has no arrays {missing}; it has "
                               f"{sorted(version.manifest.arrays)}.")
        self.fields = tuple(fields)
        layout = version.manifest.layout
        self.order = EpochOrder(UniformShards(layout.n_samples, layout.samples_per_shard), self.options.seed,
                                self.options.shuffle, self.options.shuffle_window or 4 * layout.samples_per_shard)
        self._epochs = EpochState(version, self.options, self.order, rank, world_size)
        self._sources_for = sources
        self._reads: tuple[ProcessReads, list[ShardSource]] | None = None
        disk = self.options.disk_options() if not version.storage.is_local else None
        self._caches = Caches(scope_identity(version) if self.options.cache else "",
                              (self.options.cache_bytes or default_cache_bytes()) if self.options.memory else 0,
                              disk.resolved() if disk is not None else None)
        if self._caches.memory_bytes or self._caches.disk is not None:
            # This process uses the caches from now on: the memory tier is removed only after
            # this process and every DataLoader worker have left, the disk tier's entries of this
            # version stay while it lives (see featstore.read).
            self._process()

    def _process(self) -> ProcessReads:
        """This process's reads of the version (made afresh in a new process)."""
        if self._reads is None or self._reads[0].pid != os.getpid():
            reads = ProcessReads(self.version, self.fields, self._viewing, self._caches, self.options)
            self._reads = (reads, self._sources_for(reads))
        return self._reads[0]

    def process_sources(self) -> list[ShardSource]:
        """Where this process's rows come from (made once per process)."""
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
    @property
    def rank(self) -> int:
        """This process's rank, resolved now (:class:`~featstore.DistributedSetupError` if it
        cannot be)."""
        return self._epochs.placement().check().rank

    @property
    def world_size(self) -> int:
        """The world size, resolved now."""
        return self._epochs.placement().check().world

    @property
    def partition(self) -> str:
        return self._epochs.partition(self.world_size)

    # -- epochs -------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch of the latest iteration since the last :meth:`set_epoch` (else the epoch
        the next iteration reads); shared with every DataLoader worker."""
        return self._epochs.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.set_epoch(value)

    @property
    def reading_epoch(self) -> int | None:
        """The epoch this process's current iteration reads (None before one): what a reader
        built on this one joins its rows with (:class:`~featstore.read.MultiTeacherDataset`)."""
        it = self._epochs.local.current
        return None if it is None else it.epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration read ``epoch`` (later ones count on from it). Optional: each
        new iteration reads the next epoch by itself.

        Works with ``persistent_workers=True``: the workers read it from shared memory when the
        next epoch's iteration starts. A call after that iteration started (Lightning starts the
        first epoch's DataLoader before ``on_train_epoch_start``) applies to the next one.
        """
        self._epochs.set_epoch(epoch)

    # -- the plan -----------------------------------------------------------------------
    def plan(self, worker: int = 0, num_workers: int = 0) -> ConsumerPlan:
        """This rank's plan of :attr:`epoch` for one DataLoader worker (``num_workers=0``: the
        main process)."""
        placement, w = self._epochs.placement().check(), max(1, num_workers)
        return consumer_plan(
            self.order.source, seed=self.options.seed, epoch=self.epoch,  # type: ignore[arg-type]
            shuffle=self.options.shuffle, consumers=placement.world * w, cid=placement.rank * w + worker,
            partition=self._epochs.partition(placement.world), window=self.order.window,  # type: ignore[arg-type]
        )

    def batches_per_rank(self, num_workers: int = 0) -> int:
        """How many batches this rank yields this epoch with ``num_workers`` DataLoader workers."""
        return sum(self.plan(w, num_workers).n_batches(self.options.batch_size, self.options.drop_last)
                   for w in range(max(1, num_workers)))

    # -- resume -------------------------------------------------------------------------
    def state_dict(self, batches_seen: int | None = None, num_workers: int | None = None) -> dict[str, Any]:
        """Where this rank is in the epoch, to resume with :meth:`load_state_dict`.

        ``batches_seen`` is the number of batches (steps) the training loop consumed this epoch,
        those before a resume included; without it, the batches this process yielded are used
        (right for ``num_workers=0``). ``num_workers`` is the DataLoader's; without it, the
        number the workers of the last iteration recorded (None before any iteration: then the
        state resumes only under the same split, unchecked).

        The state carries the epoch's global ``"progress"``: it resumes under any split with the
        same global batch (see :meth:`load_state_dict`). Inside a DataLoader worker (torchdata's
        ``StatefulDataLoader`` asks each worker), the state of that worker alone.
        """
        return self._epochs.state_dict(batches_seen, num_workers)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume mid-epoch: the next iteration reads the rest of the saved epoch, every
        remaining sample once and none of the seen ones, deterministically.

        A state with ``"progress"`` (this featstore's) resumes under any world size and number
        of DataLoader workers whose global batch (world size x ``batch_size``) is the saved
        one's; :class:`InvalidInput` says which world sizes can. The seed, shuffle, view policy
        and shuffle window must match. An older state resumes only under the split it was saved
        with (world size here, the number of workers when the next iteration starts). A
        DataLoader worker's state (torchdata's) is loaded by that worker, for its next iteration;
        :class:`featstore.StatefulLoader` loads one saved with another number of workers."""
        self._epochs.load_state_dict(state)

    def state_from_workers(self, states: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The rank-level state made of a loader's per-worker states (what
        :class:`featstore.StatefulLoader` loads under another number of workers)."""
        return self._epochs.from_workers(states)

    # -- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        # Started here, not in the generator: torchdata asks a worker for its state right after
        # iter(), before the first batch, and that state must be this iteration's. In a worker,
        # an error is raised by the first next() instead: DataLoader creates a persistent worker's
        # next iterator outside its error handling, where the error would kill the worker silently.
        try:
            it = self._epochs.start()
            self._viewing.start_epoch(it.epoch)
        except Exception as exc:  # noqa: BLE001 - re-raised by the first next(), in the DataLoader's handling
            if not in_worker():
                raise
            return raising(exc)
        return self._iterate(it)

    def _iterate(self, it: Iteration) -> Iterator[dict[str, torch.Tensor]]:
        local = self._epochs.local
        windows = read_windows(self.process_sources(), self._epoch(it), self.options.prefetch,
                               self.version.manifest.layout.samples_per_shard)
        for batch in self._batches(windows, it):
            local.yielded += 1
            yield batch

    def _epoch(self, it: Iteration) -> Epoch:
        """The iteration as its sources see it: one window per slice of its share, where each
        starts in the epoch (a resumed share's windows come from other consumers' plans: they
        start nowhere this consumer owns), and the rows already seen."""
        consumers, partition = it.split.consumers, it.split.partition
        n = len(self.version)
        at = consumer_span(n, consumers, it.cid, partition)[0] if it.whole else n
        windows = []
        for i, sl in enumerate(it.share.slices):
            windows.append(Window(i, slice_reads(sl, self.options.shuffle)[0], at))
            at += windows[-1].size if it.whole else 0
        return Epoch(it.epoch, it.cid, consumers, partition, tuple(windows), it.skip_rows)

    def __getstate__(self) -> dict[str, Any]:
        # maps, file handles and counts stay in their process
        return {**self.__dict__, "_reads": None}

    def _batches(self, windows: Iterator[tuple[Window, dict[str, WindowRows]]],
                 it: Iteration) -> Iterator[dict[str, torch.Tensor]]:
        """Cut windows into batches: each batch is one gather of its rows from the window (the
        window is never permuted as a whole, which would copy it once more)."""
        bs = self.options.batch_size
        carry: dict[str, BatchRows] | None = None
        for window, arrays in windows:
            drop, n = window.drop, window.size - window.drop
            order = None  # unshuffled: the rows read, in order
            if self.options.shuffle:  # the slice's rows in yield order, as indices into the rows read
                order = slice_rows(it.share.slices[window.number], self.options.seed, it.epoch, True).order[drop:]
                n = len(order)
            pos = 0
            while pos < n:  # each step fills the batch begun (``carry``), or cuts the next one
                end = min(n, pos + bs - (0 if carry is None else len(carry["index"])))
                rows = window_rows(arrays, order, drop, pos, end)
                carry = rows if carry is None else {k: concat_rows([carry[k], rows[k]]) for k in arrays}
                pos = end
                if len(carry["index"]) == bs:
                    yield self.to_batch(carry)
                    carry = None
        if carry is not None and not self.options.drop_last:
            yield self.to_batch(carry)

    def to_batch(self, arrays: dict[str, Any]) -> dict[str, torch.Tensor]:
        """A batch's rows (stored dtypes, ``"index"`` included) as its tensors, decoded (what
        a reader built on this one, :class:`~featstore.read.MixtureDataset`, yields)."""
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
        p = self._epochs.published()
        where = f"rank={p.rank}/{p.world}" if p.resolved else "rank unresolved"
        return f"FeatureDataset({self.version.name}@{self.version.id}, {where}, {self.options})"


def raising(exc: BaseException) -> Iterator[Any]:
    """An iterator whose first next() raises ``exc``."""
    raise exc
    yield  # a generator
