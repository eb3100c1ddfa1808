"""Online mode: Model A runs in the consuming process and the reader yields the stored reader's
batches; with ``fill=True`` the shards it computes become the version (:mod:`featstore.online._fill`).

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

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from featstore.compute._shard_rows import compute_shard, shard_batches
from featstore.compute._shard_task import worker_model
from featstore.compute._shard_writing import open_arrays, write_shard
from featstore.compute._task_spec import TaskSpec
from featstore.errors import InvalidInput
from featstore.online._fill import FillState, ShardWrites, owned, try_commit
from featstore.online._teacher import Planned, Teacher, plan_teacher
from featstore.online._inputs import InputPrefetch
from featstore.read._assignment import ConsumerPlan, Piece, UniformShards, consumer_span, dropped_pieces
from featstore.read._dataset import FeatureDataset
from featstore.versions._catalog import Catalog
from featstore.versions._committed import HasStoredVersion, StoredVersion
from featstore.versions._keys import receipt_key, view_key

#: What the face gives to turn the committed version into the user's (:class:`featstore.Version`).
PublicVersion = Callable[[StoredVersion], HasStoredVersion]


def shard_buffers(spec: TaskSpec, net: torch.nn.Module, dataset: Any, index: int, device: torch.device,
                  inputs: InputPrefetch | None = None) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """Shard ``index`` as ``compute`` stores it (:func:`featstore.compute.compute_shard`): every
    array's rows (stored dtype) and their statistics; ``inputs``: where A's inputs were planned
    to be read ahead."""
    rows = compute_shard(spec, net, dataset, index, device, None if inputs is None else inputs.get)
    return rows.buffers, rows.stats


@dataclass
class _Online:
    """What one process keeps: its Model A, the arrays it writes, what it knows is stored."""

    net: torch.nn.Module
    device: torch.device
    pid: int = field(default_factory=os.getpid)
    writers: dict[int | None, Any] = field(default_factory=dict)  # view -> the zarr arrays written
    fill: FillState = field(default_factory=FillState)
    writes: ShardWrites = field(default_factory=ShardWrites)
    inputs: InputPrefetch = field(default_factory=InputPrefetch)
    owned_left: set[int] = field(default_factory=set)  # this iteration's shards to write, not yet written


class OnlineDataset(FeatureDataset):
    """A :class:`~featstore.FeatureDataset` whose rows Model A computes as it reads (see
    :mod:`featstore.online`); with ``Teacher(fill=True)`` it also writes and commits them.

    >>> ds = store.dataset("cnn-a/train", batch_size=256, teacher=featstore.Teacher(model=a, dataset=train_set))
    >>> ds.version.id == store.compute("cnn-a/train", model=a, dataset=train_set).id
    True
    """

    def __init__(self, planned: Planned, *, public: PublicVersion | None = None, **options: Any) -> None:
        """``public``: wraps what :meth:`committed` returns (the face passes :class:`featstore.Version`)."""
        self._planned = planned
        self._public = public
        self._online_state: _Online | None = None
        super().__init__(planned.version, **options)
        if planned.teacher.fresh and planned.req.n != len(planned.teacher.dataset):
            raise InvalidInput("the teacher's dataset changed length while it was planned.")

    @property
    def teacher(self) -> Teacher:
        return self._planned.teacher

    @property
    def filling(self) -> bool:
        return self._planned.teacher.fill

    def committed(self) -> StoredVersion | HasStoredVersion | None:
        """The filled version once committed (None before, and always without ``fill``)."""
        if not self.filling:
            return None
        v = Catalog(self._proc.storage).committed(self.version.name, self.version.id)
        return v if v is None or self._public is None else self._public(v)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_online_state": None}

    def _online(self) -> _Online:
        st = self._online_state
        if st is None or st.pid != os.getpid():
            device = self.teacher.torch_device()
            st = _Online(worker_model(self.teacher.model, self._planned.spec.model_key, 0, device), device)
            self._online_state = st
        return st

    def _fill_views(self) -> list[int | None]:
        return [None] if self.version.views is None else list(range(self.version.views))

    def _windows(self, plan: ConsumerPlan, skip: int) -> Iterator[tuple[int, int, dict[str, np.ndarray]]]:
        """This epoch's windows: read where the fill already stored them (all of them: the
        stored reader's own path), else computed by A."""
        it, st = self._local.current, self._online()
        # this process's storage: a filesystem object is neither fork- nor loop-safe
        spec = replace(self._planned.spec, view=self._viewing.view, storage=self._proc.storage)
        if self.filling:
            st.fill.refresh(self._proc.storage, self.version, [spec.view])
            if st.fill.complete(self.version.manifest.layout.n_shards, [spec.view]):
                yield from super()._windows(plan, skip)
                try_commit(Catalog(self._proc.storage), self._planned, st.fill, self._fill_views())
                return
        st.owned_left = set()
        world = it.placement.world
        start, _ = consumer_span(len(self.version), world * max(1, it.workers), it.cid, self._partition(world))
        seen = self._seen(it.epoch)
        # the shards this consumer writes this epoch (once all are, it tries the commit at once),
        # and A's batches, which are read a batch ahead
        pos, n, ranges = start, len(self.version), []
        for window in plan.windows:
            st.owned_left |= {p.shard for p, own in zip(window, owned(window, pos, n), strict=True) if own}
            size = sum(p.size for p in window)
            if pos - start + size > skip:
                ranges += [r for p in window if not st.fill.holds(spec.view, p.shard)
                           for r in shard_batches(spec, p.shard)]
            pos += size
        dropped = self._dropped(it, world) if self.filling else []
        st.owned_left |= set(dropped)
        st.owned_left -= st.fill.done.get(spec.view, set())
        ranges += [r for shard in dropped for r in shard_batches(spec, shard)]
        st.inputs.plan(seen, ranges)
        pos = start
        try:
            for wi, window in enumerate(plan.windows):
                size = sum(p.size for p in window)
                if pos - start + size > skip:
                    mine = owned(window, pos, len(self.version))
                    yield wi, max(0, skip - (pos - start)), self._window_rows(st, spec, seen, window, mine)
                pos += size
            for shard in dropped:  # stored, never yielded: the fill completes in this epoch
                if not st.fill.holds(spec.view, shard):
                    self._computed(st, spec, seen, shard, write=True)
        except BaseException:  # an abandoned or failed epoch: the shards computed are still stored
            for view, shard in st.writes.drain_quietly():
                st.fill.done.setdefault(view, set()).add(shard)
            raise
        if self.filling:
            if not self._written(st, st.writes.drain()):  # every consumer tries at its epoch's end
                try_commit(Catalog(self._proc.storage), self._planned, st.fill, self._fill_views())

    def _dropped(self, it: Any, world: int) -> list[int]:
        """The shards whose first row lies in the tail that ``partition="drop"`` leaves out of
        this epoch: the last consumer owns them (without ``shuffle`` the same tail is dropped
        every epoch, and the fill would never complete)."""
        consumers = world * max(1, it.workers)
        if self._partition(world) != "drop" or it.cid != consumers - 1:
            return []
        layout = self.version.manifest.layout
        tail = dropped_pieces(UniformShards(layout.n_samples, layout.samples_per_shard), seed=self.options.seed,
                              epoch=it.epoch, shuffle=self.options.shuffle, consumers=consumers)
        return [p.shard for p in tail if p.lo == 0]

    def _seen(self, epoch: int) -> Any:
        """The dataset as A sees it this epoch (this epoch's view, or fresh draws)."""
        return self._planned.seen(self._viewing.view, epoch, self.options.seed)

    def _window_rows(self, st: _Online, spec: Any, seen: Any, window: tuple[Piece, ...],
                mine: list[bool]) -> dict[str, np.ndarray]:
        """One window's rows of every read array, in window order, and ``index``."""
        specs, spp = self.version.manifest.arrays, self.version.manifest.layout.samples_per_shard
        total = sum(p.size for p in window)
        arrays = {f: np.empty((total, *specs[f].shape), dtype=specs[f].dtype) for f in self.fields}
        arrays["index"] = np.concatenate(
            [np.arange(p.shard * spp + p.lo, p.shard * spp + p.hi, dtype=np.int64) for p in window])
        off = 0
        for piece, own in zip(window, mine, strict=True):
            out = {f: arrays[f][off:off + piece.size] for f in self.fields}
            off += piece.size
            if self.filling and own and not st.fill.holds(spec.view, piece.shard) and self._proc.storage.exists(
                    receipt_key(view_key(self.version.key, spec.view), piece.shard)):
                st.fill.done.setdefault(spec.view, set()).add(piece.shard)  # another run wrote it since
            if self.filling and st.fill.holds(spec.view, piece.shard):
                for f in self.fields:
                    self._read_field(piece, f, out[f])
                continue
            rows = self._computed(st, spec, seen, piece.shard, write=self.filling and own)
            for f in self.fields:
                out[f][...] = rows[f][piece.lo:piece.hi]
        return arrays

    def _computed(self, st: _Online, spec: Any, seen: Any, shard: int, write: bool) -> dict[str, np.ndarray]:
        """Shard ``shard`` computed by A; with ``write``, stored with its receipt on the
        consumer's writer thread (:class:`ShardWrites`) while A goes on."""
        buffers, stats = shard_buffers(spec, st.net, seen, shard, st.device, st.inputs)
        if write:
            if spec.view not in st.writers:
                st.writers[spec.view] = open_arrays(spec)
            self._written(st, st.writes.submit((spec.view, shard), write_shard, spec, st.writers[spec.view], shard,
                                               buffers, stats))
        else:
            self._written(st, st.writes.finished())
        return buffers

    def _written(self, st: _Online, done: list[Any]) -> bool:
        """Record finished shard writes; whoever writes the epoch's last owned shard commits.
        Whether the commit was tried (so the epoch's end does not list the receipts again)."""
        for view, shard in done:
            st.fill.done.setdefault(view, set()).add(shard)
            st.owned_left.discard(shard)
        if done and not st.owned_left:
            try_commit(Catalog(self._proc.storage), self._planned, st.fill, self._fill_views())
            return True
        return False

    def __repr__(self) -> str:
        mode = "fill" if self.filling else "online"
        return f"OnlineDataset({mode}, {self.version.name}@{self.version.id}, {self.options})"


def online_dataset(catalog: Catalog, name: str, teacher: Teacher, *, public: PublicVersion | None = None,
                   **options: Any) -> FeatureDataset:
    """``store.dataset(name, teacher=...)``: an :class:`OnlineDataset`, or with ``fill`` a plain
    :class:`~featstore.FeatureDataset` over the version once it is committed. ``public`` wraps
    the version :meth:`OnlineDataset.committed` returns (the face passes :class:`featstore.Version`)."""
    if not isinstance(teacher, Teacher):
        raise InvalidInput("teacher= takes featstore.Teacher(model=..., dataset=..., outputs={...}).")
    if "@" in name:
        raise InvalidInput(f"with teacher=, name the feature set ({name.split('@')[0]!r}), not a version: the "
                           "teacher's arguments decide the version.")
    if teacher.tokens is not None:  # planned as compute plans it (plan_teacher), not read online yet
        raise InvalidInput("a teacher with tokens= (per-token outputs) is not read online yet: compute the version "
                           "with store.compute(..., tokens=...) and read it with store.dataset(name).")
    planned = plan_teacher(catalog, name, teacher)
    if isinstance(planned, StoredVersion):
        return FeatureDataset(planned, **options)
    return OnlineDataset(planned, public=public, **options)
