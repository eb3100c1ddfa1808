"""What one shard task is asked to do (:class:`TaskSpec`): the store and version, Model A's
input and outputs, the layout and arrays, the view, per-token outputs; and what the probe
finds (:class:`Probe`). Built from a :class:`~featstore.compute.ComputePlan` (by the driver and
by the teacher in the loop alike), read by the task and its write side."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from featstore.format import ArraySpec, Layout
from featstore.codecs import Tokens
from featstore.monitor import TOPIC
from featstore.storage import Storage
from featstore._user_types import Collate, FieldKey
from featstore.versions import DIGEST_FIELD
from featstore.versions import version_key, view_key
from featstore.versions import SEED_FIELD, Augment

if TYPE_CHECKING:
    from featstore.compute._decision import ComputePlan


@dataclass(frozen=True)
class ArrayProbe:
    """One array as the probe batch had it: the per-sample shape and dtype every batch must
    keep, and the share of bytes zstd saves on the batch as stored (what
    ``compression="auto"`` decides on)."""

    shape: tuple[int, ...]
    dtype: str
    saving: float


@dataclass(frozen=True)
class Probe:
    """What Model A's first samples showed (:func:`~featstore.compute.probe`): every array
    (outputs, their parts, kept fields), and the mean real tokens per sample (per-token
    outputs: what sizes their shards; 0 without)."""

    arrays: dict[str, ArrayProbe]
    tokens_per_sample: float = 0.0
    #: Whether A's inputs differ in size among the probed samples (where batches may be cut by
    #: size, the driver joins small shards into one task: :mod:`featstore.compute._windows`).
    sizes_vary: bool = False

    def __getitem__(self, name: str) -> ArrayProbe:
        return self.arrays[name]

    def __contains__(self, name: object) -> bool:
        return name in self.arrays

    def dtypes(self, views: bool) -> dict[str, str]:
        """Every array's dtype as the first batch had it (with views, the replay seeds too)."""
        return {k: a.dtype for k, a in self.arrays.items()} | ({SEED_FIELD: "int64"} if views else {})



@dataclass(frozen=True)
class TaskSpec:
    """Everything a shard task needs, small and picklable (no tensors, no secrets in logs)."""

    storage: Storage
    name: str
    vid: str
    model_key: str
    input_key: FieldKey
    keep: dict[str, FieldKey]
    outputs: dict[str, str]
    arrays: dict[str, ArraySpec]
    layout: Layout
    batch_size: int
    allow_nonfinite: bool
    autocast: str | None
    threads: int
    topic: str
    dtypes: dict[str, str] = field(default_factory=dict)  # per array, as the first batch had them
    tune_allocator: bool = True
    serial_forward: bool = False  # this process's tasks take turns at the forward (see _FORWARD_TURN)
    collate: Collate | None = None  # the user's collate for A's input batch (None: default_collate)
    view: int | None = None  # the augmented view these shards belong to (None: no views)
    augment: Augment | None = None  # fn(item, generator) -> item, with views
    augment_seed: int = 0
    tokens: Tokens | None = None  # per-token outputs: which, and the real-token mask
    ragged: tuple[str, ...] = ()  # the per-token outputs
    digests: bool = False  # store each sample's input digest (featstore.versions._digests)
    group_by_length: bool = True  # batches may be cut by input size (featstore.compute._windows)

    @classmethod
    def of(cls, plan: ComputePlan, storage: Storage, model_key: str, *, threads: int = 0,
           serial_forward: bool = False) -> TaskSpec:
        """The probe's spec for ``plan`` (view 0 with views: the probe sees A's input as the
        first view has it); :meth:`planned` adds what the probe decided."""
        req, options = plan.request, plan.options
        return cls(storage, plan.name, plan.vid, model_key, req.input_key, plan.keep, plan.outputs, {},
                   Layout(plan.n, 1, 1), req.batch_size, options.allow_nonfinite, options.autocast, threads, TOPIC,
                   tune_allocator=options.tune_allocator, serial_forward=serial_forward, collate=options.collate,
                   view=None if plan.views is None else 0, augment=None if plan.views is None else plan.views.augment,
                   augment_seed=0 if plan.views is None else plan.views.seed, tokens=req.tokens, ragged=plan.ragged,
                   digests=plan.digests, group_by_length=options.group_by_length)

    def planned(self, layout: Layout, arrays: dict[str, ArraySpec], probe: Probe) -> TaskSpec:
        """This spec with the layout and arrays the version was claimed with, and the dtypes
        every batch must keep (as the probe found them)."""
        return replace(self, layout=layout, arrays=arrays, dtypes=probe.dtypes(self.view is not None),
                       digests=DIGEST_FIELD in arrays)

    @property
    def key(self) -> str:
        """The group the shards are written to: the version's, or its view's."""
        return view_key(version_key(self.name, self.vid), self.view)

    def unit(self, index: int) -> int:
        """Shard ``index`` as the progress events number it: with views, view-major over every
        view's shards (so the dashboard counts each (view, shard) once)."""
        return index if self.view is None else self.view * self.layout.n_shards + index
