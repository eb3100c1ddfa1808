"""Several teachers read on the same rows: one ``IterableDataset`` over aligned versions.

``store.dataset({"a": ref_a, "b": ref_b}, ...)`` (or a list: labels ``t0``, ``t1``, ...) gives a
:class:`MultiTeacherDataset`. Its versions must hold outputs for the same rows
(:func:`featstore.versions._alignment.check_aligned`: the same dataset, length, views and shards; checked
when it is made, before any batch). Each batch then holds every teacher's outputs for the same
(index, view):

    {"index": [B], "view": [B], "a/features": ..., "a/logits": ..., "b/logits.ids": ..., ...}

A teacher's arrays are prefixed by its label and ``/`` (the names :func:`featstore.kd.ensemble`
takes: ``ensemble(batch, ["a/logits", "b/logits"])``); ``index`` and ``view`` come once, and so
do the fields ``source=`` joins (unprefixed, augmented with the row's view seed, as for one
version).

How: one :class:`~featstore.FeatureDataset` per teacher, all with the same options. The plan is
a pure function of the layout, the options, the epoch and the (rank, worker) consumer
(:mod:`featstore.read.plans._assignment`), and the view an epoch reads of the view count and the seed
(:func:`featstore.views.epoch_view`), so aligned versions get the same plan and the same view:
each teacher's reader reads its own bytes of that plan (one view, each row once per epoch, no
more than read alone) with its own caches, prefetch and storage, and the batches are zipped. Every
batch's rows are checked to be the same in each teacher. Sharding over DataLoader workers and DDP
ranks, shuffling, ``set_epoch``, caches and S3 are the single reader's; resume saves one state per
teacher (``{"teachers": {label: state}}``), for ``state_dict(batches_seen=k)`` and torchdata's
per-worker states alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.utils.data import IterableDataset

from featstore._allowed_names import check_field
from featstore.errors import InvalidInput, VersionsMisaligned
from featstore.read.plans._assignment import ConsumerPlan
from featstore.read._dataset import FeatureDataset, raising
from featstore.read._options import ReaderOptions
from featstore.read._views import ViewReading
from featstore.read.state._worker_share import in_worker
from featstore.versions._alignment import check_aligned
from featstore.versions._committed import HasStoredVersion, StoredVersion, stored
from featstore.versions._views import VIEW_FIELD

MULTI_SCHEMA = "featstore.multi_teacher_state"
#: Keys every teacher's batch has and the joined batch holds once.
SHARED = ("index", VIEW_FIELD)
Versionish = StoredVersion | HasStoredVersion


def teacher_labels(versions: Mapping[str, Versionish] | Sequence[Versionish]) -> dict[str, StoredVersion]:
    """``{label: version}``: a mapping's keys (checked: a letter, then letters, digits or ``_``),
    or ``t0``, ``t1``, ... for a list."""
    if isinstance(versions, Mapping):
        labelled = {check_field(label): stored(v) for label, v in versions.items()}
    elif isinstance(versions, Sequence) and not isinstance(versions, str):
        labelled = {f"t{i}": stored(v) for i, v in enumerate(versions)}
    else:
        raise InvalidInput("several teachers are a dict {label: version or ref} or a list of them.")
    if len(labelled) < 1:
        raise InvalidInput("give at least one teacher: store.dataset({'a': ref_a, 'b': ref_b}).")
    return labelled


class MultiTeacherDataset(IterableDataset):
    """Stream several aligned versions (teachers) on the same rows; see the module docstring.

    ``fields`` may be a dict ``{label: [arrays]}`` to read other arrays from each teacher (a
    teacher left out reads all of its arrays); ``source``/``augment``/``source_fields``/``source_id``
    join the student's input once (:class:`~featstore.viewreading.ViewReading`, checked against
    the first teacher). Every other option is :class:`~featstore.ReaderOptions`' and applies to
    every teacher.

    >>> ds = store.dataset({"a": "cnn-a/train", "b": "vit-b/train"}, batch_size=256, seed=0,
    ...                    source=train_set, augment=augment)
    >>> for batch in DataLoader(ds, batch_size=None, num_workers=2):
    ...     loss = kd.kd_loss(student(batch["input"]), kd.ensemble(batch, ["a/logits", "b/logits"]))
    """

    def __init__(self, versions: Mapping[str, Versionish] | Sequence[Versionish], *, rank: int | None = None,
                 world_size: int | None = None, options: ReaderOptions | None = None, source: Any = None,
                 augment: Any = None, source_fields: Any = None, source_id: str | None = None,
                 **option_fields: Any) -> None:
        super().__init__()
        self.versions = teacher_labels(versions)
        check_aligned(self.versions)
        fields = option_fields.pop("fields", None)
        per_teacher = fields if isinstance(fields, Mapping) else {label: fields for label in self.versions}
        unknown = sorted(set(per_teacher) - set(self.versions))
        if unknown:
            raise InvalidInput(f"fields names teachers {unknown}; the teachers are {list(self.versions)}.")
        self.teachers = {label: FeatureDataset(v, rank=rank, world_size=world_size, options=options,
                                               **option_fields, fields=_fields(per_teacher.get(label)))
                         for label, v in self.versions.items()}
        self.options = replace(self._first.options, fields=None)  # fields are per teacher
        self._viewing = ViewReading(self._first.version, self.options, source, augment, source_fields, source_id)

    @property
    def _first(self) -> FeatureDataset:
        return next(iter(self.teachers.values()))

    # -- what the single reader offers, for all teachers at once ------------------------
    @property
    def epoch(self) -> int:
        """The epoch (see :attr:`FeatureDataset.epoch`), the same for every teacher."""
        return self._first.epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration read ``epoch`` (every teacher)."""
        for ds in self.teachers.values():
            ds.set_epoch(epoch)

    def plan(self, worker: int = 0, num_workers: int = 0) -> ConsumerPlan:
        """The one plan every teacher reads (see :meth:`FeatureDataset.plan`)."""
        return self._first.plan(worker, num_workers)

    def batches_per_rank(self, num_workers: int = 0) -> int:
        """Batches this rank yields this epoch (see :meth:`FeatureDataset.batches_per_rank`)."""
        return self._first.batches_per_rank(num_workers)

    def clear_cache(self) -> None:
        """Empty every teacher's caches (see :meth:`FeatureDataset.clear_cache`)."""
        for ds in self.teachers.values():
            ds.clear_cache()

    # -- resume -------------------------------------------------------------------------
    def state_dict(self, batches_seen: int | None = None, num_workers: int | None = None) -> dict[str, Any]:
        """One state per teacher, to resume with :meth:`load_state_dict` (the arguments are
        :meth:`FeatureDataset.state_dict`'s; inside a DataLoader worker, that worker's)."""
        return {"schema": MULTI_SCHEMA, "schema_version": 1,
                "teachers": {label: ds.state_dict(batches_seen, num_workers) for label, ds in self.teachers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume mid-epoch: every teacher's reader skips the batches already seen."""
        if not isinstance(state, dict) or state.get("schema") != MULTI_SCHEMA:
            raise InvalidInput("this is not a multi-teacher dataset's state (MultiTeacherDataset.state_dict()); "
                               "a single version's state resumes a dataset over that version alone.")
        saved = state["teachers"]
        if set(saved) != set(self.teachers):
            raise InvalidInput(f"the state is for teachers {sorted(saved)}, this dataset reads "
                               f"{sorted(self.teachers)}; resume with the same teachers.")
        for label, ds in self.teachers.items():
            ds.load_state_dict(saved[label])

    def state_from_workers(self, states: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The rank-level state made of a loader's per-worker states, teacher by teacher (what
        :class:`featstore.StatefulLoader` loads under another number of workers); None where a
        teacher's cannot be made."""
        per = {label: ds.state_from_workers([s["teachers"][label] for s in states if "teachers" in s])
               for label, ds in self.teachers.items()}
        if any(v is None for v in per.values()):
            return None
        return {"schema": MULTI_SCHEMA, "schema_version": 1, "teachers": per}

    # -- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        # Each teacher's iteration starts here, as a single reader's does in __iter__ (torchdata
        # asks for a worker's state right after iter()); a worker's error is raised by next().
        iterators = {label: iter(ds) for label, ds in self.teachers.items()}
        try:
            epoch = self._first.reading_epoch
            self._viewing.start_epoch(0 if epoch is None else epoch)
        except Exception as exc:  # noqa: BLE001 - re-raised by the first next() in a worker
            if not in_worker():
                raise
            return raising(exc)
        labels = list(iterators)
        return (self._join(labels, batches, n) for n, batches in enumerate(zip(*iterators.values(), strict=True)))

    def _join(self, labels: list[str], batches: Sequence[dict[str, torch.Tensor]], n: int) -> dict[str, torch.Tensor]:
        first = batches[0]
        for label, b in zip(labels[1:], batches[1:], strict=True):
            if not all(torch.equal(first[k], b[k]) for k in SHARED if k in first):
                raise VersionsMisaligned(f"batch {n}: teacher {label!r} read other rows (or views) than "
                                         f"{labels[0]!r}; report this, with the two versions' manifests.",
                                         ("rows",))
        out = {"index": first["index"]}
        for label, b in zip(labels, batches, strict=True):
            out.update({f"{label}/{k}": t for k, t in b.items() if k not in SHARED})
        out = self._viewing.add(out)
        if VIEW_FIELD in first and not torch.equal(first[VIEW_FIELD], out[VIEW_FIELD]):
            raise VersionsMisaligned(f"batch {n}: the teachers read view {int(first[VIEW_FIELD][0])}, the source "
                                     f"join view {int(out[VIEW_FIELD][0])}; report this.", ("view",))
        return out

    def __repr__(self) -> str:
        refs = ", ".join(f"{label}={v.ref}" for label, v in self.versions.items())
        return f"MultiTeacherDataset({refs}, {self.options})"


def _fields(fields: Any) -> tuple[str, ...] | None:
    if fields is None:
        return None
    return (fields,) if isinstance(fields, str) else tuple(fields)
