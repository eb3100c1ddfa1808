"""FeatureDataset: the one reader, a torch ``IterableDataset`` over typed streams.

Every way of reading is this class with other streams (:mod:`featstore.read._streams`): one
version, a weighted mixture of versions (:func:`mix`), several teachers' aligned versions read
on the same rows (``store.dataset({"a": ..., "b": ...})``), several teachers inside a mixture,
and Model A run in the consuming process (``store.dataset(name, teacher=...)``: a stream whose
rows :mod:`featstore.online` computes). One pipeline reads them all:

1. **Plan** the epoch (pure, :mod:`featstore.read.plans`): one version's plan, or the mixture's,
   split over ranks and DataLoader workers; resumed under any split (:mod:`featstore.read.state`).
2. **Read**: per process, one source per (stream, array) chosen once (mapped in place, through
   the node's caches, decoded, or computed online: :mod:`featstore.read.shards`); each window of
   the consumer's share is read ahead, every stream's span of it at once.
3. **Cut** batches: one gather per array per batch (:mod:`featstore.read._gather`), decoded,
   with ``"index"`` (each row's sample in its version), ``"source"`` (a mixture: each row's
   stream), ``"view"`` (versions with views) and the joined input (``source=``).

Each (rank, DataLoader worker) pair reads only its own span of the epoch's plan, with reads issued
ahead on a thread pool so S3 latency hides behind Model B's step. The store is opened lazily inside
each worker process, so it is safe under fork and spawn.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from featstore._keywords import keywords_of
from featstore.codecs import LENGTHS, OFFSETS, RaggedRows, assemble, offsets, pad_value, padded
from featstore.errors import InvalidInput
from featstore.read._gather import Rows, SliceRows, joined
from featstore.read._options import ReadCall, ReadKeywords, read_call
from featstore.read._streams import Member, ReadStream, Stream, Versionish, Versions, resolve
from featstore.read._views import StreamViews
from featstore.read.plans import (ConsumerPlan, EpochOrder, MixStream, Mixture, Slice, UniformShards, consumer_plan,
                                  consumer_span, run_starts, slice_reads, slice_rows, stream_samples)
from featstore.read.shards import (Caches, Epoch, Labelled, ProcessReads, ShardSource, Span, StreamSources, Unit,
                                   default_cache_bytes, read_spans, scope_identity)
from featstore.read.state import EpochState, Iteration, OrderOptions, in_worker
from featstore.versions import VIEW_FIELD

#: A batch: ``{array: tensor, ..., "index": tensor}``.
Batch = dict[str, torch.Tensor]
#: The batch column naming each row's stream (a mixture's).
SOURCE = "source"
#: What a reader reads: one version, several teachers' (``{label: version}``), a stream, or streams.
Streams = Versions | Stream | Sequence[Stream]


class FeatureDataset(IterableDataset[Batch]):
    """Stream committed versions into Model B's training loop: one version, a mixture of them
    (:func:`featstore.mix`), several teachers on the same rows, or Model A run in the loop.

    >>> ds = store.dataset("cnn-a/train", batch_size=256, shuffle=True, seed=0)
    >>> loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    >>> for epoch in range(3):              # each pass over the loader reads the next epoch
    ...     for batch in loader:
    ...         batch["features"].shape, batch["index"].shape   # [256, 512], [256]

    ``streams``: a version (``store.open(ref)``), several teachers' (``{label: version}`` or a
    list: labels ``t0``, ``t1``, ...; their arrays come as ``"<label>/<array>"``), a
    :class:`~featstore.Stream`, or a list of streams (a mixture, as :func:`featstore.mix` makes).

    **Epochs.** Each new iteration reads the next epoch (new order, next view): every
    ``for batch in loader`` pass (all its DataLoader workers together, persistent or not), or
    ``iter(ds)`` in a process. ``set_epoch(e)`` makes the next one read ``e`` (it wins over the
    count, which continues from it); ``load_state_dict`` resumes the saved epoch.

    **Ranks.** Rank and world size are found when each epoch's iteration starts, not when the
    dataset is built: ``rank=``/``world_size=``, else ``torch.distributed``, else ``RANK`` and
    ``WORLD_SIZE``. DataLoader workers use what the training process resolved when it started
    them; a placement that changes under persistent workers, or that cannot be resolved, raises
    :class:`~featstore.DistributedSetupError`.

    **Length.** ``len(ds)`` is the batches this rank yields per epoch (``DataLoader(ds,
    batch_size=None)``'s convention, which Lightning and ``transformers.Trainer`` count steps
    with) for ``num_workers=`` DataLoader workers (else as many as the last iteration had).

    **Resume.** :meth:`state_dict`/:meth:`load_state_dict` per rank, or per DataLoader worker
    under torchdata's ``StatefulDataLoader``; a state resumes the epoch under any split with the
    same global batch (world size x ``batch_size``; :class:`featstore.StatefulLoader` for
    torchdata's per-worker states; see ``docs/elastic.md``).
    """

    @keywords_of(ReadKeywords, first="streams: a version, several teachers' ({label: version}), a Stream, or a "
                                     "list of streams (a mixture).")
    def __init__(self, streams: Streams, **keywords: Any) -> None:
        call = read_call(keywords)
        given, mixture = _streams_of(streams)
        self._setup(given, call, mixture)

    @classmethod
    def of(cls, streams: Sequence[Stream], call: ReadCall, *, mixture: bool) -> FeatureDataset:
        """A reader of ``streams`` with ``call``'s keywords, already checked (what :func:`mix` and
        :mod:`featstore.online` build); ``mixture``: planned as a mixture (each row's stream in
        ``"source"``), else one stream as one version is."""
        ds = cls.__new__(cls)
        ds._setup(streams, call, mixture)
        return ds

    def _setup(self, given: Sequence[Stream], call: ReadCall, mixture: bool) -> None:
        super().__init__()
        self.options = options = call.options
        if call.join is not None:
            if len(given) > 1:
                raise InvalidInput("source= joins one version's dataset; a mixture's streams each name their own: "
                                   "featstore.Stream(version, ..., join=featstore.Join(dataset)).")
            if given[0].join is not None:
                raise InvalidInput("the stream already has a join: give source= or Stream(join=...), not both.")
            given = [Stream(given[0].version, given[0].proportion, given[0].repeat, given[0].choose, call.join,
                            given[0].rows)]
        self.streams: tuple[ReadStream, ...] = resolve(given, options.fields)
        weighted = any(s.proportion is not None or s.repeat is not None or s.choose is not None for s in self.streams)
        self.is_mixture = mixture or weighted or call.epoch_size is not None
        if self.is_mixture and any(s.rows.online for s in self.streams):
            raise InvalidInput("a teacher run in the loop reads one version's plan (each consumer computes, and a fill "
                               "writes, the shards it owns); it cannot be a stream of a mixture. Compute it first "
                               "(store.compute or Teacher(fill=True)), then mix the stored version.")
        layouts = [UniformShards(s.first.manifest.layout.n_samples, s.first.manifest.layout.samples_per_shard)
                   for s in self.streams]
        self.mixture: Mixture | None = None
        if self.is_mixture:
            self.mixture = Mixture(tuple(MixStream(lay, s.proportion, s.repeat, s.choose)
                                         for lay, s in zip(layouts, self.streams, strict=True)), call.epoch_size)
        window = options.shuffle_window or 4 * max(lay.per_shard for lay in layouts)
        self.order = EpochOrder(self.mixture if self.mixture is not None else layouts[0], options.seed,
                                options.shuffle, window)
        any_views = any(s.first.views is not None for s in self.streams)
        self._views = [StreamViews(s.first, options.view if s.first.views is not None or not any_views else None,
                                   options.seed, s.join) for s in self.streams]
        self._epochs = EpochState(tuple(s.identity() for s in self.streams), OrderOptions.of(options), self.order,
                                  call.rank, call.world_size)
        self._workers = call.num_workers
        memory = (options.cache_bytes or default_cache_bytes()) if options.memory else 0
        self._caches = [[self._member_caches(m, memory) for m in s.members] for s in self.streams]
        self._proc: _Process | None = None
        if any(c.memory_bytes or c.disk is not None for cs in self._caches for c in cs):
            # This process uses the caches from now on: the memory tier is removed only after
            # this process and every DataLoader worker have left, the disk tier's entries of this
            # version stay while it lives (see featstore.read).
            self._process()

    def _member_caches(self, member: Member, memory: int) -> Caches:
        disk = self.options.disk_options() if not member.version.storage.is_local else None
        return Caches(scope_identity(member.version) if self.options.cache else "", memory,
                      disk.resolved() if disk is not None else None)

    # -- what is read ---------------------------------------------------------------------
    @property
    def version(self) -> Versionish:
        """The version read (the first stream's, as it was given: a :class:`featstore.Version`)."""
        return self.streams[0].members[0].given

    @property
    def versions(self) -> list[Versionish] | dict[str, Versionish]:
        """Each stream's version (a mixture's ``"source"`` indexes them); several teachers on
        the same rows: ``{label: version}``."""
        if len(self.streams) == 1 and self.streams[0].members[0].label is not None:
            return {str(m.label): m.given for m in self.streams[0].members}
        return [s.members[0].given for s in self.streams]

    @property
    def fields(self) -> tuple[str, ...]:
        """The arrays read (of the first stream's version; several teachers: ``label/array``)."""
        return tuple(m.key(f) for m in self.streams[0].members for f in m.fields)

    @property
    def counts(self) -> tuple[int, ...]:
        """Each stream's samples per epoch."""
        return self.mixture.counts() if self.mixture is not None else (len(self.streams[0].first),)

    def samples(self, epoch: int | None = None) -> list[np.ndarray]:
        """Each stream's samples of epoch ``epoch`` (None: :attr:`epoch`), in its passes' order:
        what a mixture draws of each version (without replacement until it is exhausted); one
        version read alone: all of its samples. A map-style view of the epoch reads them
        (:class:`featstore.hf.SoftLabels` over a mixture)."""
        e = self.epoch if epoch is None else epoch
        if self.mixture is None:
            return [np.arange(len(self.streams[0].first), dtype=np.int64)]
        return [stream_samples(self.mixture, k, seed=self.options.seed, epoch=e, shuffle=self.options.shuffle)
                for k in range(len(self.streams))]

    @property
    def online(self) -> bool:
        """Whether Model A computes the rows in the consuming process (``store.dataset(name, teacher=...)``)."""
        return any(s.rows.online for s in self.streams)

    def committed(self) -> Versionish | None:
        """A teacher in the loop with ``fill=True``: the filled version once committed (None
        before, and for any other stream)."""
        return self.streams[0].rows.committed(self.process_reads())

    # -- one process's reads ----------------------------------------------------------------
    def _process(self) -> _Process:
        """This process's reads and sources (made afresh in a new process)."""
        if self._proc is None or self._proc.pid != os.getpid():
            self._proc = _Process.of(self.streams, self._views, self._caches, self.options.shuffle)
        return self._proc

    def process_reads(self, stream: int = 0, member: int = 0) -> ProcessReads:
        """This process's reads of a stream's version (the first stream's first by default)."""
        return self._process().reads[stream][member]

    def process_sources(self, stream: int = 0) -> list[ShardSource]:
        """Where this process's rows of a stream come from (made once per process)."""
        return list(self._process().sources[stream].sources)

    def clear_cache(self) -> None:
        """Empty the versions' caches for every process on the machine: the shared memory
        (``cache="memory"``) and the disk tier's entries (``cache="disk"``); the next reads
        decode from storage again (a process keeps what it has mapped).

        >>> ds = store.dataset("cnn-a/train", cache="memory", cache_bytes=8 * 2**30)
        >>> ds.clear_cache()
        """
        for reads in self._process().reads:
            for r in reads:
                r.clear_cache()

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
        """The epoch this process's current iteration reads (None before one)."""
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
        main process); one version's (a mixture's plan is :mod:`featstore.read.plans`')."""
        source = self.order.source
        if not isinstance(source, UniformShards):
            raise InvalidInput("plan() gives one version's plan; a mixture's is featstore.read.plans.epoch_share.")
        placement, w = self._epochs.placement().check(), max(1, num_workers)
        return consumer_plan(source, seed=self.options.seed, epoch=self.epoch, shuffle=self.options.shuffle,
                             consumers=placement.world * w, cid=placement.rank * w + worker,
                             partition=self._epochs.partition(placement.world), window=self.order.window)

    def batches_per_rank(self, num_workers: int = 0) -> int:
        """How many batches this rank yields per epoch with ``num_workers`` DataLoader workers."""
        placement = self._epochs.placement().check()
        split = self._epochs.split(placement.world, num_workers)
        n, bs = self.order.source.n_samples, self.options.batch_size
        total = 0
        for w in range(split.per_rank):
            start, stop = consumer_span(n, split.consumers, placement.rank * split.per_rank + w, split.partition)
            rows = max(0, stop - start) if n else 0
            total += rows // bs if self.options.drop_last else -(-rows // bs)
        return total

    def __len__(self) -> int:
        """The batches this rank yields per epoch (see the class docstring)."""
        workers = self._workers
        if workers is None:
            workers = _asking_loader_workers(sys._getframe(1))
        if workers is None:
            workers = self._epochs.last_workers()
        return self.batches_per_rank(workers or 0)

    # -- resume -------------------------------------------------------------------------
    def state_dict(self, batches_seen: int | None = None, num_workers: int | None = None) -> dict[str, Any]:
        """Where this rank is in the epoch, to resume with :meth:`load_state_dict` (a
        :class:`~featstore.read.state.ReaderState`'s plain-JSON form).

        ``batches_seen`` is the number of batches (steps) the training loop consumed this epoch,
        those before a resume included; without it, the batches this process yielded are used
        (right for ``num_workers=0``). ``num_workers`` is the DataLoader's; without it, the
        number the workers of the last iteration recorded, else the reader's ``num_workers=``
        (None before any iteration: then the state resumes only under the same split, unchecked).

        The state carries the epoch's global progress: it resumes under any split with the same
        global batch (see :meth:`load_state_dict`). Inside a DataLoader worker (torchdata's
        ``StatefulDataLoader`` asks each worker), the state of that worker alone.
        """
        if num_workers is None and self._epochs.last_workers() is None:
            num_workers = self._workers
        return self._epochs.state_dict(batches_seen, num_workers)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume mid-epoch: the next iteration reads the rest of the saved epoch, every
        remaining sample once and none of the seen ones, deterministically.

        A state with the epoch's progress resumes under any world size and number of DataLoader
        workers whose global batch (world size x ``batch_size``) is the saved one's;
        :class:`InvalidInput` says which world sizes can. The streams, seed, shuffle, view policy
        and shuffle window must match. An older state (featstore before the progress existed)
        resumes only under the split it was saved with. A DataLoader worker's state (torchdata's)
        is loaded by that worker, for its next iteration; :class:`featstore.StatefulLoader` loads
        one saved with another number of workers. States saved by an older featstore load too
        (one version's, a mixture's, several teachers')."""
        self._epochs.load_state_dict(state)

    def state_from_workers(self, states: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The rank-level state made of a loader's saved dataset states (torchdata's: one per
        DataLoader worker, or the rank's own without workers); None where it cannot be made
        with the epoch's progress (what :class:`featstore.StatefulLoader` loads under another
        number of workers)."""
        return self._epochs.from_workers(states)

    # -- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        # Started here, not in the generator: torchdata asks a worker for its state right after
        # iter(), before the first batch, and that state must be this iteration's. In a worker,
        # an error is raised by the first next() instead: DataLoader creates a persistent worker's
        # next iterator outside its error handling, where the error would kill the worker silently.
        try:
            it = self._epochs.start()
            for v in self._views:
                v.start_epoch(it.epoch)
            if self._workers is not None and max(1, self._workers) != it.split.per_rank:
                warnings.warn(f"this reader was told num_workers={self._workers} but is read by "
                              f"{it.split.workers} DataLoader workers: len() counted the batches of the former.",
                              stacklevel=2)
        except Exception as exc:  # noqa: BLE001 - re-raised by the first next(), in the DataLoader's handling
            if not in_worker():
                raise
            return _raising(exc)
        return self._iterate(it)

    def _iterate(self, it: Iteration) -> Iterator[Batch]:
        local = self._epochs.local
        for batch in self._batches(it):
            local.yielded += 1
            yield batch

    def _todo(self, it: Iteration) -> list[tuple[Slice, int]]:
        """The slices this iteration reads and the rows of each already seen (a continued
        share's first windows): a slice read to its end before is left out."""
        out, skip = [], it.skip_rows
        for sl in it.share.slices:
            if skip >= len(sl.rows):
                skip -= len(sl.rows)
                continue
            out.append((sl, skip))
            skip = 0
        return out

    def _epochs_of(self, it: Iteration, todo: list[tuple[Slice, int]], units: list[Unit]) -> list[Epoch]:
        """Each stream's view of the iteration, as its sources learn it: every span of the
        consumer's share (with where it starts in the epoch, for the online fill's ownership:
        a whole share's windows start at the consumer's span; a resumed one's nowhere it owns)
        and the spans read."""
        split, n = it.split, self.order.source.n_samples
        at = consumer_span(n, split.consumers, it.cid, split.partition)[0] if it.whole else n
        spans: list[list[Span]] = [[] for _ in self.streams]
        for i, sl in enumerate(it.share.slices):
            reads = slice_reads(sl, self.options.shuffle)
            for k, run in enumerate(reads):
                if run:
                    spans[k].append(Span(i, run, at if it.whole and not self.is_mixture else n))
            at += sl.window.size if it.whole else 0
        return [Epoch(it.epoch, it.cid, split.consumers, split.partition, self.options.seed, self.options.shuffle,
                      tuple(spans[k]), tuple(span for u in units if (span := u[k]) is not None))
                for k in range(len(self.streams))]

    def _batches(self, it: Iteration) -> Iterator[Batch]:
        """Cut the iteration's slices into batches (across slice boundaries): each slice's rows
        of every stream are read ahead, then each batch is one gather per array."""
        proc, o = self._process(), self.options
        todo = self._todo(it)
        index = {id(sl): i for i, sl in enumerate(it.share.slices)}
        units: list[Unit] = []
        for sl, _ in todo:
            reads = slice_reads(sl, o.shuffle)
            units.append(tuple(Span(index[id(sl)], run) if run else None for run in reads))
        epochs = self._epochs_of(it, todo, units)
        bs, single = o.batch_size, len(self.streams) == 1
        parts: list[Rows] = []
        held = 0
        for i, arrays in enumerate(read_spans(proc.sources, epochs, units, o.prefetch)):
            sl, drop = todo[i]
            rows = slice_rows(sl, o.seed, it.epoch, o.shuffle)
            labels = rows.streams[drop:]
            if single:
                local = rows.order[drop:] if o.shuffle else None  # unshuffled: the rows read, in order
            else:  # each stream's rows read start where the rows read of the streams before end
                starts = run_starts([sum(p.size for p in run) for run in rows.reads])
                local = (rows.order - starts[rows.streams])[drop:]
            cut = SliceRows(arrays, labels, local, held, bs, drop if single and not o.shuffle else 0)
            pos, n = 0, len(labels)
            while pos < n:
                take = min(bs - held, n - pos)
                part = cut.rows(pos, pos + take)
                pos += take
                if take == bs:
                    yield self._batch(part)
                    continue
                parts.append(part)
                held += take
                if held == bs:
                    yield self._batch(joined(parts, len(self.streams)))
                    parts, held = [], 0
        if parts and not o.drop_last:
            yield self._batch(joined(parts, len(self.streams)))

    def _batch(self, rows: Rows) -> Batch:
        """One batch from its rows (grouped by stream): decoded once, as the first stream's (the
        streams' codecs agree), with ``"index"``, ``"source"`` (a mixture), ``"view"`` and the join."""
        out: Batch = {}
        for member in self.streams[0].members:
            flat: Batch = {}
            for f in member.fields:
                flat.update(self._decoded(member, f, rows.arrays[member.key(f)]))
            out.update({member.key(k): t for k, t in assemble(member.version.manifest.arrays, flat).items()})
        index = np.ascontiguousarray(rows.arrays["index"])
        out["index"] = torch.from_numpy(index)
        if self.is_mixture:
            out[SOURCE] = torch.from_numpy(rows.labels.astype(np.int64, copy=False))
        return self._joined(out, index, rows.labels)

    def _decoded(self, member: Member, field: str, rows: Any) -> Batch:
        """One array's rows as its tensors: a per-token array flat with ``<output>.offsets``, or
        padded with ``<output>.lengths`` (``ragged="padded"``)."""
        version = member.version
        if not isinstance(rows, RaggedRows):
            return {field: version.decode(field, rows)}
        flat, lengths = version.decode(field, rows.flat), torch.from_numpy(rows.lengths.astype(np.int64))
        name = version.manifest.arrays[field].output or field
        if self.options.ragged == "padded":
            return {field: padded(flat, lengths, pad_value(field, flat.dtype)), f"{name}.{LENGTHS}": lengths}
        return {field: flat, f"{name}.{OFFSETS}": torch.from_numpy(offsets(rows.lengths))}

    def _joined(self, batch: Batch, index: np.ndarray, labels: np.ndarray) -> Batch:
        """``"view"`` and each stream's joined input, for its rows (a batch's rows are grouped by stream)."""
        views = [v.view for v in self._views]
        viewed = any(v is not None for v in views)
        if not viewed and all(v.join is None for v in self._views):
            return batch  # most reads: nothing to add, and no per-stream bounds to find
        bounds = np.searchsorted(labels, np.arange(len(self.streams) + 1)) if len(self.streams) > 1 \
            else np.array([0, len(labels)])
        if viewed:
            batch[VIEW_FIELD] = torch.from_numpy(np.repeat(np.array([-1 if v is None else v for v in views],
                                                                    dtype=np.int64), np.diff(bounds)))
        parts = [v.joined(index[bounds[k]:bounds[k + 1]]) for k, v in enumerate(self._views) if v.join is not None]
        if not parts:
            return batch
        got = parts[0] if len(parts) == 1 else {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        clash = sorted(set(got) & set(batch))
        if not self._views[0].names_fields:
            got = {k: t for k, t in got.items() if k not in batch}
        elif clash:
            raise InvalidInput(f"source fields {clash} clash with the batch's stored fields; rename them "
                               "with source_fields={'new_name': key}.")
        batch.update(got)
        return batch

    def __getstate__(self) -> dict[str, Any]:
        # maps, file handles and counts stay in their process
        return {**self.__dict__, "_proc": None}

    def __repr__(self) -> str:
        p = self._epochs.published()
        where = f"rank={p.rank}/{p.world}" if p.resolved else "rank unresolved"
        what = ", ".join("+".join((f"{m.label}=" if m.label else "") + m.version.ref for m in s.members)
                         for s in self.streams)
        counts = f", counts={self.counts}" if self.is_mixture else ""
        return f"FeatureDataset({what}{counts}, {where}, {self.options})"


@dataclass
class _Process:
    """One process's reads of every stream's versions and the sources its rows come from."""

    pid: int
    reads: list[list[ProcessReads]]
    sources: list[StreamSources]

    @classmethod
    def of(cls, streams: Sequence[ReadStream], views: Sequence[StreamViews], caches: Sequence[Sequence[Caches]],
           reuse_buffers: bool) -> _Process:
        reads, sources = [], []
        for s, viewing, member_caches in zip(streams, views, caches, strict=True):
            stream_reads: list[ProcessReads] = []
            stream_sources: list[ShardSource] = []
            for m, c in zip(s.members, member_caches, strict=True):
                r = ProcessReads(m.version, m.fields, viewing, c, reuse_buffers)
                stream_reads.append(r)
                got = s.rows.sources(r)
                stream_sources += got if m.label is None else [Labelled(m.label, g) for g in got]
            reads.append(stream_reads)
            sources.append(StreamSources(stream_sources, s.first.manifest.layout.samples_per_shard))
        return cls(os.getpid(), reads, sources)


def _streams_of(given: Streams) -> tuple[list[Stream], bool]:
    """The streams a reader was given, and whether they are a mixture (a list of streams)."""
    if isinstance(given, Stream):
        return [given], False
    if isinstance(given, Sequence) and not isinstance(given, str) and given and \
            all(isinstance(s, Stream) for s in given):
        return [s for s in given if isinstance(s, Stream)], True
    return [Stream(given)], False  # type: ignore[arg-type]  # a version, or several teachers': Stream checks


def _asking_loader_workers(frame: FrameType | None) -> int | None:
    """The ``num_workers`` of the DataLoader whose ``len()`` asks for this reader's (None: the
    caller is not one). A rank's batches depend on how many workers split its share (each cuts
    its own last batch), and ``len(loader)`` (Lightning's step estimates, ``tqdm(loader)``,
    ``list(loader)``) asks before the first iteration has told the reader."""
    caller = None if frame is None else frame.f_locals.get("self")
    return caller.num_workers if isinstance(caller, DataLoader) and frame is not None \
        and frame.f_code.co_name == "__len__" else None


def _raising(exc: BaseException) -> Iterator[Batch]:
    """An iterator whose first next() raises ``exc``."""
    raise exc
    yield  # a generator
