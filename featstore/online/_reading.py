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
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from featstore._user_code import read_items
from featstore.compute._decision import ComputePlan, _dataset_sample, _fingerprint_parts, _validate, views_spec
from featstore.compute._driver import planned_arrays
from featstore.compute._options import ComputeOptions
from featstore.compute._shard_task import _collate, _forward, _seed_field, _store_batch, probe, worker_model
from featstore.compute._shard_writing import device_stage, encodes_on_device
from featstore.compute._shard_writing import open_arrays as _open_arrays
from featstore.compute._shard_writing import shard_buffers as _shard_buffers
from featstore.compute._shard_writing import write_shard as _write_shard
from featstore.compute._transfer import Offloader
from featstore.errors import DeviceSetupError, InvalidInput
from featstore.format._manifests import Layout, Manifest
from featstore.online._fill import FillState, ShardWrites, owned, try_commit
from featstore.online._inputs import InputPrefetch
from featstore.read import (Epoch, FeatureDataset, ProcessReads, ShardSource, UniformShards, Window, WindowRead,
                            WindowRows, dropped_pieces)
from featstore.versions._catalog import Catalog
from featstore.versions._committed import Version
from featstore.versions._keys import receipt_key, view_key
from featstore.versions._lifecycle import Claim
from featstore.versions._views import SEED_FIELD, ViewDataset, Views, epoch_seeds, replay, views_arguments
from featstore.versions._fingerprints import describe_key, fingerprint


@dataclass(frozen=True, eq=False)
class Teacher:
    """Model A in the loop: what ``store.dataset(name, teacher=Teacher(...))`` runs in the
    consuming process (see :mod:`featstore.online`). The arguments are ``store.compute``'s.

    Attributes:
        model: an ``nn.Module`` or a zero-argument factory (built once per process).
        dataset: the map-style dataset A runs on.
        outputs: ``{output name: codec}``, as for ``compute``.
        input_key: which field of an item goes into A.
        keep: per-sample fields carried beside A's outputs.
        device: where A runs in the consuming process: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``
            (CUDA cannot be used in forked DataLoader workers: use ``num_workers=0``, or the
            ``spawn`` start method).
        fill: also write the shards computed into the version, which commits once every shard
            is written; later epochs, runs and students read it (:mod:`featstore.online._fill`).
        batch_size: samples per forward of A (the stored reader's ``batch_size`` is B's).
        samples_per_shard: rows per shard, as for ``compute`` (None: chosen the same way).
        options: :class:`~featstore.ComputeOptions` (ids, autocast, compression, collate, ...).
        views: :class:`~featstore.Views` (K replayable augmented views, stored with ``fill``),
            as for ``compute``. (``views=K`` with ``augment=fn, augment_seed=S`` still works for
            one release, with a ``DeprecationWarning``.)
        augment: without ``views``: a fresh augmentation every epoch, ``fn(item, generator)``
            (online only, never stored; the reader's ``source=`` join replays it for B).
        augment_seed: deprecated, with ``views=K`` only: the views' seed.

    >>> teacher = featstore.Teacher(model=model_a, dataset=train_set, outputs={"features": "float16"})
    >>> ds = store.dataset("cnn-a/train", batch_size=256, teacher=teacher)         # online
    >>> ds = store.dataset("cnn-a/train", batch_size=256, teacher=replace(teacher, fill=True))
    """

    model: Any
    dataset: Any
    outputs: Mapping[str, str] | None = None
    input_key: Any = "input"
    keep: Sequence[Any] | Mapping[str, Any] = ()
    device: str = "cpu"
    fill: bool = False
    batch_size: int = 256
    samples_per_shard: int | None = None
    options: ComputeOptions | None = None
    views: Views | int | None = None
    augment: Any = None
    augment_seed: int | None = None
    _views: tuple[int | None, Any, int] = field(init=False, repr=False, compare=False, default=(None, None, 0))

    def __post_init__(self) -> None:
        if self.views is None:
            if self.augment_seed is not None:
                raise InvalidInput("augment_seed= names the seed of views: pass "
                                   "views=featstore.Views(k=K, augment=fn, seed=S) (augment= alone is a fresh "
                                   "augmentation every epoch, which has no seed of its own).")
            resolved = (None, self.augment, 0)
        else:
            k, augment, seed = views_arguments(self.views, self.augment, self.augment_seed, caller="Teacher",
                                               stacklevel=5)
            resolved = (k, augment, seed or 0)
        object.__setattr__(self, "_views", resolved)
        if not isinstance(self.fill, bool):
            raise InvalidInput(f"fill must be True or False, got {self.fill!r}.")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise InvalidInput(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}.") from None
        if device.type not in ("cpu", "cuda"):
            raise InvalidInput(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}.")
        if self.fresh and self.fill:
            raise InvalidInput(
                "fill=True with a fresh augmentation (augment= without views=) would store outputs of one "
                "random draw as if they could be replayed; they are never stored. Compute K replayable "
                "views instead (views=K with augment=fn draws from the generator it is given), or keep fill=False.")

    @property
    def fresh(self) -> bool:
        """Whether A sees a fresh (non-replayable) augmentation every epoch."""
        return self.augment is not None and self.views is None

    @property
    def view_count(self) -> int | None:
        """K, the views per sample (None without views)."""
        return self._views[0]

    @property
    def view_augment(self) -> Any:
        """The augment: the views' (with views), else the fresh one (or None)."""
        return self._views[1]

    @property
    def view_seed(self) -> int:
        """The views' seed (0 without views)."""
        return self._views[2]

    def torch_device(self) -> torch.device:
        """The device A runs on; :class:`DeviceSetupError` for CUDA where there is none."""
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise DeviceSetupError(f"Teacher(device={self.device!r}) asks for CUDA, but torch sees no GPU here; "
                                   "pass device='cpu', or run where a GPU is visible.")
        return device


@dataclass(frozen=True, eq=False)
class Planned:
    """The version a teacher's outputs make (not committed): what the reader reads and the
    fill writes and commits."""

    teacher: Teacher
    plan: ComputePlan
    version: Version
    spec: Any  # the shard tasks' TaskSpec (arrays, layout, dtypes), view None
    claim: Claim | None  # with fill: the version folder's claim

    @property
    def vid(self) -> str:
        return self.plan.vid

    @property
    def req(self) -> Any:
        return self.plan.req

    @property
    def parts(self) -> dict[str, Any]:
        return self.plan.parts

    @property
    def fp(self) -> str:
        return self.plan.fingerprint


def plan_teacher(catalog: Catalog, name: str, teacher: Teacher) -> Planned | Version:
    """The version ``store.compute(name, ...)`` would commit for the teacher's arguments, planned
    without computing it: the committed one itself if it exists and ``fill`` is asked."""
    from featstore.compute._task_spec import TaskSpec
    from featstore.monitor._events import TOPIC

    options = teacher.options or ComputeOptions(progress=False)
    device = teacher.torch_device()
    fresh = teacher.fresh
    req = _validate(name, teacher.dataset, teacher.input_key, teacher.keep, teacher.outputs, teacher.batch_size,
                    teacher.samples_per_shard, options, teacher.view_count, None if fresh else teacher.view_augment,
                    teacher.view_seed)
    parts = _fingerprint_parts(req, teacher.model, teacher.dataset, options)
    if fresh:  # outputs of one epoch's draw: an id no stored version has
        parts["fresh_augment"] = describe_key(teacher.augment)
    fp = fingerprint(parts)
    plan = ComputePlan(req, parts, fp, None, _dataset_sample(parts, teacher.dataset))
    vid = plan.vid
    if teacher.fill and (existing := catalog.committed(name, vid)) is not None:
        return existing
    base = TaskSpec(catalog.storage, name, vid, f"{vid}-online-{os.getpid()}-{id(teacher):x}", req.input_key, req.keep,
                    req.outputs, {}, Layout(req.n, 1, 1), req.batch_size, options.allow_nonfinite, options.autocast,
                    0, TOPIC, tune_allocator=False, collate=options.collate,
                    view=None if req.views is None else 0, augment=req.augment, augment_seed=req.augment_seed)
    probed = probe(base, teacher.model, teacher.dataset, req.n, device)
    layout, arrays = planned_arrays(catalog, plan, probed, options)
    claim = None
    if teacher.fill:
        claim = catalog.claim(name, vid, layout, arrays, (), req.views)
        layout, arrays = claim.layout, claim.arrays
    dtypes = {k: d for k, (_, d, _) in probed.items()} | ({} if req.views is None else {SEED_FIELD: "int64"})
    spec = replace(base, arrays=arrays, layout=layout, dtypes=dtypes, view=None)
    manifest = Manifest(id=vid, name=name, fingerprint=fp, fingerprint_parts=parts, layout=layout, arrays=arrays,
                        stats={}, created_at="", timings={}, libraries={}, views=views_spec(req))
    return Planned(teacher, plan, Version(catalog.storage, manifest), spec, claim)


class FreshAugment(torch.utils.data.Dataset):
    """``dataset`` as A sees it in epoch ``epoch`` under a fresh augmentation: item ``i``
    augmented with the seed the reader's ``source=`` join uses for (seed, epoch, i)."""

    def __init__(self, dataset: Any, augment: Any, seed: int, epoch: int) -> None:
        self.dataset, self.augment, self.seed, self.epoch = dataset, augment, int(seed), int(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        return replay(self.augment, self.dataset[i], int(epoch_seeds(self.seed, self.epoch, [i])[0]))


def shard_batches(spec: Any, index: int) -> list[tuple[int, int]]:
    """The batches ``[b0, b1)`` A runs on for shard ``index`` (``compute``'s: ``spec.batch_size``
    rows from the shard's first)."""
    start, stop = spec.layout.shard_range(index)
    return [(b0, min(b0 + spec.batch_size, stop)) for b0 in range(start, stop, spec.batch_size)]


def shard_buffers(spec: Any, net: torch.nn.Module, dataset: Any, index: int, device: torch.device,
                  inputs: InputPrefetch | None = None) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """Shard ``index`` as ``compute`` stores it: every array's rows (stored dtype) and their
    statistics, A run in ``compute``'s batches (:func:`shard_batches`); ``inputs``: where A's
    inputs were planned to be read ahead."""
    buffers, stats = _shard_buffers(spec, index), {}
    start, _ = spec.layout.shard_range(index)
    offload, on_device = Offloader(device), encodes_on_device(device)
    for b0, b1 in shard_batches(spec, index):
        items = inputs.get(dataset, b0, b1) if inputs is not None else read_items(dataset, range(b0, b1))
        x, kept = _collate(spec, items, b0, pinned=device.type == "cuda")
        outs = _forward(spec, net, x, b0, b1 - b0, device)
        if on_device:
            outs = device_stage(spec, outs, None, b0, 0)
        host = offload.to_host({**outs, **kept, **_seed_field(spec, b0, b1)})
        _store_batch(spec, host, b0, b1, start, 0, buffers, stats)
    return buffers, stats


class ComputedSource(ShardSource):
    """Where an online reader's rows come from (the :class:`~featstore.read._sources.ShardSource`
    of :class:`OnlineDataset`, one per process): Model A computes each window's shards, whole,
    in the consuming thread, a window at a time as the batches need it. With ``fill``, the
    shards this consumer owns are written (:class:`ShardWrites`), those already stored are read,
    and once every shard of the epoch's view is stored the epoch reads the stored version's own
    sources and tries the commit."""

    def __init__(self, planned: Planned, reads: ProcessReads) -> None:
        self.planned, self.reads, self.options = planned, reads, reads.options
        self.fields = reads.fields
        self._net: torch.nn.Module | None = None  # built on this process's first computed shard
        self.writers: dict[int | None, Any] = {}  # view -> the zarr arrays written
        self.fill, self.writes, self.inputs = FillState(), ShardWrites(), InputPrefetch()
        self.owned_left: set[int] = set()  # this iteration's shards to write, not yet written
        self.stored: list[ShardSource] | None = None  # this epoch reads the stored version's sources
        self.dropped: list[int] = []
        self.spec, self.seen = planned.spec, planned.teacher.dataset

    @property
    def filling(self) -> bool:
        return self.planned.teacher.fill

    @property
    def device(self) -> torch.device:
        return self.planned.teacher.torch_device()

    @property
    def net(self) -> torch.nn.Module:
        if self._net is None:
            self._net = worker_model(self.planned.teacher.model, self.planned.spec.model_key, 0, self.device)
        return self._net

    def _catalog(self) -> Catalog:
        return Catalog(self.reads.storage)  # this process's storage: neither fork- nor loop-safe

    def _views(self) -> list[int | None]:
        views = self.planned.version.views
        return [None] if views is None else list(range(views))

    def begin(self, epoch: Epoch) -> None:
        version, view = self.planned.version, self.reads.viewing.view
        self.spec = replace(self.planned.spec, view=view, storage=self.reads.storage)
        self.seen = self._seen(epoch.number, view)
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
        for window in epoch.windows:
            self.owned_left |= {p.shard for p, own in zip(window.pieces, owned(window.pieces, window.at, n),
                                                           strict=True) if own}
        for window in epoch.todo:
            ranges += [r for p in window.pieces if not self.fill.holds(view, p.shard)
                       for r in shard_batches(self.spec, p.shard)]
        self.dropped = self._dropped(epoch) if self.filling else []
        self.owned_left |= set(self.dropped)
        self.owned_left -= self.fill.done.get(view, set())
        ranges += [r for shard in self.dropped for r in shard_batches(self.spec, shard)]
        self.inputs.plan(self.seen, ranges)

    def read(self, window: Window, reads: Executor) -> WindowRead:
        if self.stored is not None:
            return WindowRead.joined([s.read(window, reads) for s in self.stored])
        return WindowRead([], lambda: self._window_rows(window))  # computed when its batches are cut

    def near(self, windows: Sequence[Window]) -> bool:
        return self.stored is None or all(s.near(windows) for s in self.stored)

    def end(self, finished: bool) -> None:
        if self.stored is not None:
            for s in self.stored:
                s.end(finished)
            if finished:
                try_commit(self._catalog(), self.planned, self.fill, self._views())
            return
        try:
            for shard in self.dropped if finished else ():  # stored, never yielded: the fill completes this epoch
                if not self.fill.holds(self.spec.view, shard):
                    self._computed(shard, write=True)
        except BaseException:
            finished = False
            raise
        finally:
            if not finished:  # an abandoned or failed epoch: the shards computed are still stored
                for view, shard in self.writes.drain_quietly():
                    self.fill.done.setdefault(view, set()).add(shard)
        if self.filling and not self._written(self.writes.drain()):  # every consumer tries at its epoch's end
            try_commit(self._catalog(), self.planned, self.fill, self._views())

    def _dropped(self, epoch: Epoch) -> list[int]:
        """The shards whose first row lies in the tail that ``partition="drop"`` leaves out of
        this epoch: the last consumer owns them (without ``shuffle`` the same tail is dropped
        every epoch, and the fill would never complete)."""
        if epoch.partition != "drop" or epoch.consumer != epoch.consumers - 1:
            return []
        layout = self.planned.version.manifest.layout
        tail = dropped_pieces(UniformShards(layout.n_samples, layout.samples_per_shard), seed=self.options.seed,
                              epoch=epoch.number, shuffle=self.options.shuffle, consumers=epoch.consumers)
        return [p.shard for p in tail if p.lo == 0]

    def _seen(self, epoch: int, view: int | None) -> Any:
        """The dataset as A sees it this epoch (this epoch's view, or fresh draws)."""
        t = self.planned.teacher
        if view is not None:
            return ViewDataset(t.dataset, t.view_augment, t.view_seed, view)
        if t.fresh:
            return FreshAugment(t.dataset, t.augment, self.options.seed, epoch)
        return t.dataset

    def _window_rows(self, window: Window) -> dict[str, WindowRows]:
        """One window's rows of every read array, in window order."""
        specs = self.planned.version.manifest.arrays
        arrays = {f: np.empty((window.size, *specs[f].shape), dtype=specs[f].dtype) for f in self.fields}
        off, view = 0, self.spec.view
        for piece, own in zip(window.pieces, owned(window.pieces, window.at, len(self.planned.version)), strict=True):
            out = {f: arrays[f][off:off + piece.size] for f in self.fields}
            off += piece.size
            if self.filling and own and not self.fill.holds(view, piece.shard) and self.reads.storage.exists(
                    receipt_key(view_key(self.planned.version.key, view), piece.shard)):
                self.fill.done.setdefault(view, set()).add(piece.shard)  # another run wrote it since
            if self.filling and self.fill.holds(view, piece.shard):
                for f in self.fields:
                    self.reads.read_rows(f, piece.shard, piece.lo, piece.hi, out[f])
                continue
            rows = self._computed(piece.shard, write=self.filling and own)
            for f in self.fields:
                out[f][...] = rows[f][piece.lo:piece.hi]
        return dict(arrays)

    def _computed(self, shard: int, write: bool) -> dict[str, np.ndarray]:
        """Shard ``shard`` computed by A; with ``write``, stored with its receipt on the
        consumer's writer thread (:class:`ShardWrites`) while A goes on."""
        spec = self.spec
        buffers, stats = shard_buffers(spec, self.net, self.seen, shard, self.device, self.inputs)
        if write:
            if spec.view not in self.writers:
                self.writers[spec.view] = _open_arrays(spec)
            self._written(self.writes.submit((spec.view, shard), _write_shard, spec, self.writers[spec.view], shard,
                                             buffers, stats))
        else:
            self._written(self.writes.finished())
        return buffers

    def _written(self, done: list[Any]) -> bool:
        """Record finished shard writes; whoever writes the epoch's last owned shard commits.
        Whether the commit was tried (so the epoch's end does not list the receipts again)."""
        for view, shard in done:
            self.fill.done.setdefault(view, set()).add(shard)
            self.owned_left.discard(shard)
        if done and not self.owned_left:
            try_commit(self._catalog(), self.planned, self.fill, self._views())
            return True
        return False


class OnlineDataset(FeatureDataset):
    """A :class:`~featstore.FeatureDataset` whose rows Model A computes as it reads (see
    :mod:`featstore.online`); with ``Teacher(fill=True)`` it also writes and commits them.
    Everything but where the rows come from is the stored reader's: its source is a
    :class:`ComputedSource`.

    >>> ds = store.dataset("cnn-a/train", batch_size=256, teacher=featstore.Teacher(model=a, dataset=train_set))
    >>> ds.version.id == store.compute("cnn-a/train", model=a, dataset=train_set).id
    True
    """

    def __init__(self, planned: Planned, *, version_class: type[Version] = Version, **options: Any) -> None:
        """``version_class``: what :meth:`committed` returns (the store's :class:`~featstore.Version`)."""
        self._planned = planned
        self._version_class = version_class
        super().__init__(planned.version, sources=_OnlineSources(planned), **options)
        if planned.teacher.fresh and planned.req.n != len(planned.teacher.dataset):
            raise InvalidInput("the teacher's dataset changed length while it was planned.")

    @property
    def teacher(self) -> Teacher:
        return self._planned.teacher

    @property
    def filling(self) -> bool:
        return self._planned.teacher.fill

    def committed(self) -> Version | None:
        """The filled version once committed (None before, and always without ``fill``)."""
        if not self.filling:
            return None
        v = Catalog(self._process().storage).committed(self.version.name, self.version.id)
        return None if v is None else self._version_class(v.storage, v.manifest)

    def __repr__(self) -> str:
        mode = "fill" if self.filling else "online"
        return f"OnlineDataset({mode}, {self.version.name}@{self.version.id}, {self.options})"


@dataclass(frozen=True)
class _OnlineSources:
    """The :data:`~featstore.read._dataset.SourceFactory` of an online reader (picklable)."""

    planned: Planned

    def __call__(self, reads: ProcessReads) -> list[ShardSource]:
        return [ComputedSource(self.planned, reads)]


def online_dataset(catalog: Catalog, name: str, teacher: Teacher, **options: Any) -> FeatureDataset:
    """``store.dataset(name, teacher=...)``: an :class:`OnlineDataset`, or with ``fill`` a plain
    :class:`~featstore.FeatureDataset` over the version once it is committed."""
    if not isinstance(teacher, Teacher):
        raise InvalidInput("teacher= takes featstore.Teacher(model=..., dataset=..., outputs={...}).")
    if "@" in name:
        raise InvalidInput(f"with teacher=, name the feature set ({name.split('@')[0]!r}), not a version: the "
                           "teacher's arguments decide the version.")
    planned = plan_teacher(catalog, name, teacher)
    if isinstance(planned, Version):
        return FeatureDataset(planned, **options)
    return OnlineDataset(planned, version_class=catalog.version_class, **options)
