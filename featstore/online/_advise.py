"""Which mode pays: measure Model A, the store and Model B on this machine, predict each mode's
wall time for E epochs, K views and S students, and recommend the fastest, saying why.

The prediction is pure arithmetic on seconds per sample (:class:`Costs`), tested by grids:

- **online**: every student runs A every epoch: ``S·E·N·(teacher + student)``;
- **compute-then-read**: A once per view, written, then every student reads every epoch:
  ``K·N·(teacher + write) + S·E·N·(read + student)``;
- **fill**: the first students' first epochs run A and write (one view per epoch) while they
  train, every later epoch reads: per student, ``F·N·(teacher + write + student) +
  (E - F)·N·(read + student)`` with ``F`` the views still missing (at most ``E``).

``teacher`` is what a consumer pays per sample to read and collate A's input, run A and encode
its outputs (:func:`featstore.compute.compute_shard`); ``write`` storing the encoded shard with its
receipt; ``read`` the stored reader's epoch; ``student`` Model B's step. :func:`measure` takes
them from a scratch version of the first ``samples`` items, filled, read back and deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from featstore.errors import InvalidInput

if TYPE_CHECKING:  # the advisor's arithmetic imports none of them (torch, Dask, zarr)
    import torch

    from featstore.format import Layout
    from featstore.online._teacher import Teacher
    from featstore.storage import Storage
    from featstore.store import FeatureStore
    from featstore.versions import StoredVersion

#: Model B's step on one batch, timed by :func:`measure` (what it returns is ignored).
Student = Callable[["dict[str, torch.Tensor]"], object]

MODES = ("online", "compute-then-read", "fill")


@dataclass(frozen=True)
class Costs:
    """Measured seconds per sample (and the stored bytes per sample of one view)."""

    teacher_s: float
    write_s: float
    read_s: float
    student_s: float = 0.0
    bytes_per_sample: float = 0.0
    plan_s: float = 0.0  # once per run: fingerprint digests and the probe batch
    compute_fixed_s: float = 0.0  # once per compute: its cluster, probe task, claim and commit

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise InvalidInput(f"Costs.{f.name} must be a non-negative number of seconds, got {value!r}.")


@dataclass(frozen=True)
class Workload:
    """What the training runs: ``samples`` per epoch, ``epochs`` per student, ``views`` stored
    views per sample, ``students`` trained one after another on the same teacher."""

    samples: int
    epochs: int = 1
    views: int = 1
    students: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInput(f"Workload.{f.name} must be a positive int, got {value!r}.")


def terms(c: Costs, w: Workload) -> dict[str, dict[str, float]]:
    """Each mode's predicted seconds split by what pays them: ``teacher`` (A and its input),
    ``write``, ``read``, ``student`` and the fixed ``setup`` (planning; compute's cluster).

    >>> terms(Costs(1e-3, 1e-4, 1e-5), Workload(1000, epochs=2))["online"]["teacher"]
    2.0
    """
    n, e, k, s = w.samples, w.epochs, w.views, w.students

    def mode(runs: int, writes: int, reads: int, setup: float) -> dict[str, float]:
        """``runs`` passes of A over the samples, ``writes`` stored, ``reads`` read back."""
        return {"teacher": runs * n * c.teacher_s, "write": writes * n * c.write_s, "read": reads * n * c.read_s,
                "student": s * e * n * c.student_s, "setup": setup}

    filled = min(k, s * e)  # the views the first epochs compute, one an epoch (every later epoch reads)
    return {"online": mode(s * e, 0, 0, s * c.plan_s),
            "compute-then-read": mode(k, k, s * e, c.plan_s + c.compute_fixed_s),
            "fill": mode(filled, filled, s * e - filled, s * c.plan_s)}


def predict(c: Costs, w: Workload) -> dict[str, float]:
    """Each mode's predicted wall time in seconds.

    >>> predict(Costs(teacher_s=2e-3, write_s=1e-4, read_s=1e-4), Workload(10_000, epochs=10))
    {'online': 200.0, 'compute-then-read': 31.0, 'fill': 30.0}
    """
    return {mode: round(sum(parts.values()), 9) for mode, parts in terms(c, w).items()}


def bound(parts: dict[str, float]) -> str:
    """What a mode's time is mostly spent on: ``compute`` (A), ``write``, ``read``, ``student`` or
    ``setup``.

    >>> bound({"teacher": 3.0, "write": 5.0, "read": 1.0, "student": 0.0})
    'write'
    """
    name = max(parts, key=lambda k: parts[k])
    return "compute" if name == "teacher" else name


def recommend(c: Costs, w: Workload) -> tuple[str, str]:
    """The fastest mode and why (which cost bounds it, and what the next best would pay).

    >>> recommend(Costs(1e-4, 5e-3, 1e-3), Workload(1000, epochs=2))[0]
    'online'
    """
    t = terms(c, w)
    times = predict(c, w)
    best = min(MODES, key=lambda m: (times[m], MODES.index(m)))
    runner = min((m for m in MODES if m != best), key=lambda m: times[m])
    why = {
        "online": (f"running A every epoch ({c.teacher_s * 1e3:.3g} ms/sample) costs less than writing its "
                   f"outputs ({c.write_s * 1e3:.3g} ms/sample) and reading them back ({c.read_s * 1e3:.3g} "
                   f"ms/sample)"),
        "compute-then-read": (f"A ({c.teacher_s * 1e3:.3g} ms/sample) is paid once per view instead of "
                              f"{w.epochs * w.students} times; the stored epochs cost {c.read_s * 1e3:.3g} ms/sample"),
        "fill": (f"A ({c.teacher_s * 1e3:.3g} ms/sample) is paid once per view, during the first epochs' "
                 f"training instead of before it; later epochs read at {c.read_s * 1e3:.3g} ms/sample"),
    }[best]
    return best, (f"{best} is {bound(t[best])}-bound, {runner} would be {bound(t[runner])}-bound: {why} "
                  f"({times[best]:.3g} s against {times[runner]:.3g} s for {runner}).")


@dataclass(frozen=True)
class Advice:
    """What :func:`advise` measured and predicts."""

    costs: Costs
    workload: Workload
    predicted: dict[str, float]
    mode: str
    reason: str

    def table(self) -> str:
        """The prediction as a Markdown table (mode, predicted seconds, what bounds it)."""
        t = terms(self.costs, self.workload)
        rows = ["| mode | predicted s | teacher s | write s | read s | student s | setup s | bound |",
                "|---|---:|---:|---:|---:|---:|---:|---|"]
        for m in MODES:
            p = t[m]
            mark = " (recommended)" if m == self.mode else ""
            rows.append(f"| {m}{mark} | {self.predicted[m]:.3g} | {p['teacher']:.3g} | {p['write']:.3g} | "
                        f"{p['read']:.3g} | {p['student']:.3g} | {p['setup']:.3g} | {bound(p)} |")
        return "\n".join(rows)

    def to_json(self) -> dict[str, Any]:
        return {"costs": dataclasses.asdict(self.costs), "workload": dataclasses.asdict(self.workload),
                "predicted_s": self.predicted, "recommended": self.mode, "reason": self.reason}


def measure(store: FeatureStore, teacher: Teacher, *, samples: int = 1024, batch_size: int = 256,
            student: Student | None = None) -> Costs:
    """Measure :class:`Costs` on this machine and ``store``: the teacher is planned as training
    would plan it (timed: ``plan_s``; it gives the real shard layout), then a scratch version of
    the first ``samples`` items (at least one real shard) is computed shard by shard in that
    layout (timed: A and its input, then the write; one shard first, untimed, to warm A up),
    committed, read back with the stored reader (``student(batch)`` timed on each batch, if
    given) and deleted; last the same items are computed by ``store.compute`` into another
    scratch version (deleted): what it takes beyond those per-sample costs is
    ``compute_fixed_s``."""
    from featstore.online._teacher import plan_new

    if not isinstance(samples, int) or samples < 1:
        raise InvalidInput(f"samples must be a positive int, got {samples!r}.")
    plain = dataclasses.replace(teacher, fill=False, views=None, augment=None)
    t0 = time.perf_counter()
    real = plan_new(store.catalog, "advise/plan", plain)
    plan_s = time.perf_counter() - t0
    layout = real.version.manifest.layout
    tag, scratch = _scratch_teacher(plain, min(real.plan.n, max(samples, layout.samples_per_shard)), layout)
    costs = _scratch(store, f"advise/scratch-{tag}", scratch, batch_size, student)
    fixed = _compute_fixed_s(store, f"advise/compute-{tag}", scratch, costs.teacher_s + costs.write_s)
    return dataclasses.replace(costs, plan_s=plan_s, compute_fixed_s=fixed)


def _scratch_teacher(teacher: Teacher, n: int, layout: Layout) -> tuple[str, Teacher]:
    """A fresh tag for scratch versions, and the teacher of their first ``n`` items, filling:
    in the real layout's shards and chunks (the write's cost per shard is part of its rate),
    quiet, and named by that tag (no dataset or model digest to take)."""
    from featstore.compute import DatasetPrefix

    tag = uuid.uuid4().hex[:12]
    options = dataclasses.replace(teacher.compute_options, progress=False, dataset_id=f"advise-{tag}",
                                  model_id=f"advise-{tag}", chunk_rows=layout.chunk_rows)
    return tag, dataclasses.replace(teacher, dataset=DatasetPrefix(teacher.dataset, n), fill=True, options=options,
                                    samples_per_shard=layout.samples_per_shard)


def _compute_fixed_s(store: FeatureStore, name: str, teacher: Teacher, per_sample_s: float) -> float:
    """Seconds ``store.compute`` spends beyond A and the writes (its cluster's start and close,
    the probe task, claim, commit): a real compute of the teacher's request into scratch version
    ``name`` (deleted after), less its samples times the per-sample cost measured shard by shard."""
    from featstore.compute import ComputeRequest

    request = {f.name: getattr(teacher, f.name) for f in dataclasses.fields(ComputeRequest) if f.init}
    t0 = time.perf_counter()
    try:
        store.compute(name, **request)
        took = time.perf_counter() - t0
    finally:
        _remove_scratch(store, name)  # whatever the compute left
    return max(0.0, took - len(teacher.dataset) * per_sample_s)


def _scratch(store: FeatureStore, name: str, teacher: Teacher, batch_size: int, student: Student | None) -> Costs:
    """The per-sample costs (A, the write, the read, B and the stored bytes) on scratch version
    ``name`` of the teacher's items."""
    from featstore.compute import compute_shard, open_arrays, shard_batches, worker_model, write_shard
    from featstore.online._fill import FillState, try_commit
    from featstore.online._inputs import InputPrefetch
    from featstore.online._teacher import plan_new

    planned = plan_new(store.catalog, name, teacher)
    try:
        spec, device = planned.spec, teacher.torch_device()
        net = worker_model(teacher.model, spec.model_key, 0, device)
        compute_shard(spec, net, teacher.dataset, 0, device)  # warm-up: A's first forward sets up its kernels
        arrays = open_arrays(spec)
        shards = range(spec.layout.n_shards)
        inputs = InputPrefetch(spec.digests)  # A's inputs read a batch ahead, as the online reader reads them
        inputs.plan(teacher.dataset, [r for shard in shards for r in shard_batches(spec, shard)])
        t0 = time.perf_counter()
        computed = [compute_shard(spec, net, teacher.dataset, shard, device, inputs.get) for shard in shards]
        t1 = time.perf_counter()
        for shard, rows in zip(shards, computed, strict=True):
            write_shard(spec, arrays, shard, rows.arrays(), rows.stats)
        t_teacher, t_write = t1 - t0, time.perf_counter() - t1
        try_commit(store.catalog, planned, FillState())
        version = store.catalog.open(planned.version.ref)
        stored = _shard_bytes(store.storage, version.key)
        t_read, t_student = _read_epoch(version, batch_size, student)
    finally:
        _remove_scratch(store, name)
    n = len(teacher.dataset)
    return Costs(t_teacher / n, t_write / n, t_read / n, t_student / n, stored / n)


def _shard_bytes(storage: Storage, key: str) -> int:
    """Bytes of the shard objects under ``key`` (``<array>/c/<shard>/...``), not the version's
    few metadata objects."""
    from featstore.storage import FsspecStorage

    if not isinstance(storage, FsspecStorage):  # every backend featstore ships is one
        raise InvalidInput(f"advise measures stored bytes through fsspec; {type(storage).__name__} is not an "
                           "FsspecStorage: measure on a local or S3 store.")
    return sum(size for k, size in storage.fs.du(storage.path(key), total=False).items() if "/c/" in k)


def _read_epoch(version: StoredVersion, batch_size: int, student: Student | None) -> tuple[float, float]:
    """Seconds reading one shuffled epoch with the stored reader (B's step excluded), and B's:
    the second of two epochs, as in training (the first pays this process's one-time set-up)."""
    from featstore.read import FeatureDataset

    ds = FeatureDataset(version, batch_size=batch_size, shuffle=True, seed=0)
    for _ in range(2):
        t_student = 0.0
        t0 = time.perf_counter()
        for batch in ds:
            if student is not None:
                s0 = time.perf_counter()
                student(batch)
                t_student += time.perf_counter() - s0
        took = time.perf_counter() - t0
    return took - t_student, t_student


def _remove_scratch(store: FeatureStore, name: str) -> None:
    """Delete the scratch feature set ``name`` (``advise/<tag>``: its versions, committed or not,
    and everything in them) and, on a local store, the ``advise`` folder if it is left empty: the
    advisor leaves nothing in the user's store (``gc`` has nothing of it to find). A folder
    another run still uses is not empty, and stays."""
    store.storage.delete(name, recursive=True)
    if store.storage.is_local:  # object stores have no folders: the keys are gone with the objects
        with contextlib.suppress(OSError):  # not empty (another advise runs), or already gone
            os.rmdir(store.storage.path(name.rpartition("/")[0]))


def advise(store: FeatureStore, teacher: Teacher, workload: Workload, *, samples: int = 1024, batch_size: int = 256,
           student: Student | None = None, costs: Costs | None = None) -> Advice:
    """Measure (unless ``costs`` are given), predict every mode for ``workload`` and recommend one.

    >>> advice = featstore.advise(store, featstore.Teacher(model=a, dataset=train_set,
    ...                           outputs={"features": "float16"}), featstore.Workload(len(train_set), epochs=10))
    >>> print(advice.table()); print(advice.reason)
    """
    costs = costs or measure(store, teacher, samples=samples, batch_size=batch_size, student=student)
    mode, reason = recommend(costs, workload)
    return Advice(costs, workload, predict(costs, workload), mode, reason)
