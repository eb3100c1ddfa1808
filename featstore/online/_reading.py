"""Online mode: Model A runs in the consuming process and the reader yields the stored reader's
batches; with ``fill=True`` the shards it computes become the version (:mod:`featstore.online._fill`).
The reader is the one :class:`~featstore.FeatureDataset`; its stream's rows come from
:class:`ComputedRows` (a :class:`~featstore.read.RowsFrom`) instead of the stored version.

``store.dataset("cnn-a/train", batch_size=256, teacher=featstore.Teacher(model=A, dataset=ds,
outputs={"features": "float16"}))`` plans the version ``store.compute`` would make of the same
arguments (the same fingerprint, id, shard layout and arrays: :func:`plan_teacher` runs the
writer's own validation, fingerprint and probe), and reads it with the same
:class:`~featstore.FeatureDataset` (plan per rank and worker, shuffle windows, ``set_epoch``,
``state_dict`` resume, ``source=`` join, views). Only where a window's rows come from differs:
instead of reading a shard, the consumer runs A on the shard's samples in the batches
``compute`` would use (``Teacher.batch_size`` rows from the shard's first), under
``torch.inference_mode``, on ``Teacher.device``, and encodes the outputs with the output's codec
(:mod:`featstore.compute`'s own encode): batches hold exactly what the stored version would give.
Per-token outputs (``tokens=``) too: a window holds each piece's token rows, as the stored
reader's per-token source gives them, so batches carry the same flat rows and offsets (or
padded rows and lengths), and a fill writes the token rows compute writes.

A consumer computes whole shards, so one that reads only a shard's tail (its span starts inside
the shard) computes the rows before it too: at most one extra shard per consumer and epoch.

``augment=fn`` without ``views`` is a *fresh* augmentation: each epoch A sees
``fn(dataset[i], torch.Generator().manual_seed(s))`` with ``s`` drawn from (reader seed, epoch,
index), the same seed the reader's ``source=`` join augments the student's input with
(``source=ds, augment=fn``), so teacher and student see the same pixels. Those outputs belong to
one epoch's draw: they are never stored (``fill=True`` with them is :class:`InvalidInput`) and the
planned fingerprint records the fresh augmentation, so its id is no stored version's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import replace
from functools import cached_property
from typing import Any

import numpy as np
import torch
import zarr

from featstore._user_code import read_items
from featstore.codecs import TOKEN_LENGTH, RaggedRows, RaggedWindow
from featstore.compute import compute_shard, open_arrays, shard_batches, worker_model, write_shard
from featstore.errors import InvalidInput
from featstore.online._fill import FillState, ShardUnit, ShardWrites, owned, try_commit
from featstore.online._inputs import InputPrefetch
from featstore.online._teacher import Planned, Teacher, plan_teacher
from featstore.read import (Epoch, FeatureDataset, Join, ProcessReads, ReadCall, RowsFrom, ShardSource, Span,
                            SpanRead, SpanRows, Stream)
from featstore.read.plans import Piece, UniformShards, dropped_pieces
from featstore.read.shards import sample_tokens
from featstore.versions import Catalog, HasStoredVersion, InputCheck, StoredVersion, receipt_key, view_key

#: What the face gives to turn the committed version into the user's (:class:`featstore.Version`).
PublicVersion = Callable[[StoredVersion], HasStoredVersion]


def computed_tokens(rows: dict[str, np.ndarray], fields: Sequence[str], piece: Piece) -> dict[str, RaggedRows]:
    """The token rows of ``piece``'s samples in each per-token array of ``fields``, from the
    rows of its shard as :func:`~featstore.compute.compute_shard` gives them (each per-token
    array the shard's token rows, sample after sample): cut by the one per-token slicing,
    :func:`featstore.read.shards.sample_tokens`."""
    if not fields:
        return {}
    counts = rows[TOKEN_LENGTH].astype(np.int64)
    starts = np.cumsum(counts) - counts  # in the shard's token rows, as compute stores them
    return sample_tokens(fields, starts[piece.lo:piece.hi], counts[piece.lo:piece.hi], lambda f, at: rows[f][at])


class ComputedSource(ShardSource):
    """Where an online reader's rows come from (the :class:`~featstore.read.shards._sources.ShardSource`
    of a teacher in the loop, one per process): Model A computes each window's shards, whole,
    in the consuming thread, a window at a time as the batches need it. With ``fill``, the
    shards this consumer owns are written (:class:`ShardWrites`), those already stored are read,
    and once every shard of the epoch's view is stored the epoch reads the stored version's own
    sources and tries the commit."""

    def __init__(self, planned: Planned, reads: ProcessReads) -> None:
        self.planned, self.reads, self.fields = planned, reads, reads.fields  # fields: ShardSource's
        self.ragged = tuple(f for f in self.fields if planned.version.manifest.arrays[f].ragged)  # per-token
        self.writers: dict[int | None, dict[str, zarr.Array[Any]]] = {}  # view -> the zarr arrays written
        self.fill, self.writes, self.inputs = FillState(), ShardWrites(), InputPrefetch(planned.spec.digests)
        self.owned_left: set[int] = set()  # this iteration's shards to write, not yet written
        self.stored: list[ShardSource] | None = None  # this epoch reads the stored version's sources
        self.dropped: list[int] = []
        self.spec, self.seen = planned.spec, planned.teacher.dataset
        # what a fill stored earlier is served only beside the items it was computed from
        self.inputs_check = InputCheck.of(planned.version, filling=True)

    @property
    def filling(self) -> bool:
        return self.planned.teacher.fill

    @property
    def device(self) -> torch.device:
        return self.planned.teacher.torch_device()

    @cached_property
    def net(self) -> torch.nn.Module:
        """Model A, built on this process's first computed shard."""
        return worker_model(self.planned.teacher.model, self.planned.spec.model_key, 0, self.device)

    def _commit(self) -> None:
        # with this process's storage: neither fork- nor loop-safe
        try_commit(Catalog(self.reads.storage), self.planned, self.fill)

    def begin(self, epoch: Epoch) -> None:
        version, view = self.planned.version, self.reads.viewing.view
        self.spec = replace(self.planned.spec, view=view, storage=self.reads.storage)
        self.seen = self.planned.seen(view, epoch.number, epoch.seed)  # this epoch's view, or fresh draws
        self.stored, self.owned_left = None, set()
        if self.filling:
            self.fill.refresh(self.reads.storage, version, [view])
            if self.fill.complete(version.manifest.layout.n_shards, [view]):
                self.stored = self.reads.sources
                for s in self.stored:
                    s.begin(epoch)
                return
        # the shards this consumer writes this epoch (once all are, it tries the commit at once),
        # and A's batches, which are read a batch ahead
        n, ranges = len(version), []
        for span in epoch.spans:
            self.owned_left |= {p.shard for p, own in zip(span.pieces, owned(span.pieces, span.at, n),
                                                           strict=True) if own}
        for span in epoch.todo:
            ranges += [r for p in span.pieces if not self.fill.holds(view, p.shard)
                       for r in shard_batches(self.spec, p.shard)]
        self.dropped = self._dropped(epoch) if self.filling else []
        self.owned_left |= set(self.dropped)
        self.owned_left -= self.fill.done.get(view, set())
        ranges += [r for shard in self.dropped for r in shard_batches(self.spec, shard)]
        self.inputs.plan(self.seen, ranges)

    def read(self, span: Span, reads: Executor) -> SpanRead:
        if self.stored is not None:
            return SpanRead.joined([s.read(span, reads) for s in self.stored])
        return SpanRead([], lambda: self._span_rows(span))  # computed when its batches are cut

    def near(self, spans: Sequence[Span]) -> bool:
        return self.stored is None or all(s.near(spans) for s in self.stored)

    def end(self, finished: bool) -> None:
        if self.stored is not None:
            for s in self.stored:
                s.end(finished)
            if finished:
                self._commit()
            return
        completed = False
        try:
            for shard in self.dropped if finished else ():  # stored, never yielded: the fill completes this epoch
                if not self.fill.holds(self.spec.view, shard):
                    self._computed(shard, write=True)
            completed = finished
        finally:
            if not completed:  # an abandoned or failed epoch: the shards computed are still stored
                for unit in self.writes.drain(quietly=True):
                    self.fill.add(unit.view, unit.shard)
        if self.filling and not self._written(self.writes.drain()):  # every consumer tries at its epoch's end
            self._commit()

    def _dropped(self, epoch: Epoch) -> list[int]:
        """The shards whose first row lies in the tail that ``partition="drop"`` leaves out of
        this epoch: the last consumer owns them (without ``shuffle`` the same tail is dropped
        every epoch, and the fill would never complete)."""
        if epoch.partition != "drop" or epoch.consumer != epoch.consumers - 1:
            return []
        layout = self.planned.version.manifest.layout
        tail = dropped_pieces(UniformShards(layout.n_samples, layout.samples_per_shard), seed=epoch.seed,
                              epoch=epoch.number, shuffle=epoch.shuffle, consumers=epoch.consumers)
        return [p.shard for p in tail if p.lo == 0]

    def _span_rows(self, span: Span) -> dict[str, SpanRows]:
        """One span's rows of every read array, in window order: the per-sample arrays into
        window buffers, the per-token ones as each piece's token rows (what the stored version's
        per-token source gives)."""
        specs = self.planned.version.manifest.arrays
        dense = [f for f in self.fields if f not in self.ragged]
        arrays = {f: np.empty((span.size, *specs[f].shape), dtype=specs[f].dtype) for f in dense}
        tokens: dict[str, list[RaggedRows]] = {f: [] for f in self.ragged}
        off, view = 0, self.spec.view
        for piece, own in zip(span.pieces, owned(span.pieces, span.at, len(self.planned.version)), strict=True):
            out = {f: arrays[f][off:off + piece.size] for f in dense}
            off += piece.size
            write = self.filling and own
            if write and not self.fill.holds(view, piece.shard) and self.reads.storage.exists(
                    receipt_key(view_key(self.planned.version.key, view), piece.shard)):
                self.fill.add(view, piece.shard)  # another run wrote it since
            if self.fill.holds(view, piece.shard):  # only a fill records shards stored
                self._check_stored(piece)
                for f in dense:
                    self.reads.read_rows(f, piece.shard, piece.lo, piece.hi, out[f])
                got = self.reads.read_tokens(self.ragged, [piece]) if self.ragged else {}
            else:
                rows = self._computed(piece.shard, write=write)
                for f in dense:
                    out[f][...] = rows[f][piece.lo:piece.hi]
                got = computed_tokens(rows, self.ragged, piece)
            for f in self.ragged:
                tokens[f].append(got[f])
        return {**arrays, **{f: RaggedWindow(parts) for f, parts in tokens.items()}}

    def _check_stored(self, piece: Piece) -> None:
        """The items of a stored piece are those its rows were computed from (a fill resumed on an
        edited dataset would otherwise serve the old items' outputs): :class:`SourceMismatch`."""
        if self.inputs_check is None:
            return
        start = piece.shard * self.planned.version.manifest.layout.samples_per_shard
        rows = range(start + piece.lo, start + piece.hi)
        self.inputs_check.check(rows, read_items(self.planned.teacher.dataset, rows), "the teacher's dataset")

    def _computed(self, shard: int, write: bool) -> dict[str, np.ndarray]:
        """Shard ``shard`` computed by A; with ``write``, stored with its receipt on the
        consumer's writer thread (:class:`ShardWrites`) while A goes on."""
        spec = self.spec
        rows = compute_shard(spec, self.net, self.seen, shard, self.device, self.inputs.get)
        if write:
            if spec.view not in self.writers:
                self.writers[spec.view] = open_arrays(spec)
            self._written(self.writes.submit(ShardUnit(spec.view, shard), write_shard, spec, self.writers[spec.view],
                                             shard, rows.arrays(), rows.stats))
        else:
            self._written(self.writes.finished())
        return rows.arrays()

    def _written(self, done: list[ShardUnit]) -> bool:
        """Record finished shard writes; whoever writes the epoch's last owned shard commits.
        Whether the commit was tried (so the epoch's end does not list the receipts again)."""
        for unit in done:
            self.fill.add(unit.view, unit.shard)
            self.owned_left.discard(unit.shard)
        if done and not self.owned_left:
            self._commit()
            return True
        return False


class ComputedRows(RowsFrom):
    """Where a teacher in the loop's rows come from: in each process, a :class:`ComputedSource`
    of the planned version (picklable: DataLoader workers make their own)."""

    def __init__(self, planned: Planned, public: PublicVersion | None = None) -> None:
        """``public``: wraps what :meth:`committed` returns (the face passes :class:`featstore.Version`)."""
        self.planned, self.public = planned, public

    def sources(self, reads: ProcessReads) -> list[ShardSource]:
        return [ComputedSource(self.planned, reads)]

    @property
    def online(self) -> bool:
        return True

    def committed(self, storage_reads: ProcessReads) -> StoredVersion | HasStoredVersion | None:
        """The filled version once committed (None before, and always without ``fill``)."""
        if not self.planned.teacher.fill:
            return None
        v = Catalog(storage_reads.storage).committed(self.planned.version.name, self.planned.version.id)
        return v if v is None or self.public is None else self.public(v)


def online_dataset(catalog: Catalog, name: str, teacher: Teacher, call: ReadCall, *,
                   public: PublicVersion | None = None) -> FeatureDataset:
    """``store.dataset(name, teacher=...)``: a :class:`~featstore.FeatureDataset` whose rows Model A
    computes as it reads (with ``fill``, writing and committing them), or over the version once
    it is committed. ``public`` wraps the versions the reader gives back (the face passes
    :class:`featstore.Version`)."""
    if not isinstance(teacher, Teacher):
        raise InvalidInput("teacher= takes featstore.Teacher(model=..., dataset=..., outputs={...}).")
    if "@" in name:
        raise InvalidInput(f"with teacher=, name the feature set ({name.split('@')[0]!r}), not a version: the "
                           "teacher's arguments decide the version.")
    planned = plan_teacher(catalog, name, teacher)
    if isinstance(planned, StoredVersion):
        if call.join is not None or InputCheck.of(planned) is None:
            return FeatureDataset.of([Stream(planned if public is None else public(planned))], call, mixture=False)
        # a join that adds no field: every row is checked against the teacher's item it was computed from
        views = planned.manifest.views
        join = Join(teacher.dataset, None if views is None else teacher.view_augment, [])
        return FeatureDataset.of([Stream(planned if public is None else public(planned), join=join)], call,
                                 mixture=False)
    if planned.teacher.fresh and planned.plan.n != len(planned.teacher.dataset):
        raise InvalidInput("the teacher's dataset changed length while it was planned.")
    version = planned.version if public is None else public(planned.version)
    return FeatureDataset.of([Stream(version, rows=ComputedRows(planned, public))], call, mixture=False)
