"""What one shard task is asked to do (:class:`TaskSpec`): the store and version, Model A's
input and outputs, the layout and arrays, the view, per-token outputs. Built by the driver,
read by the task and its write side."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


from featstore.format._manifests import ArraySpec, Layout
from featstore.codecs._ragged import Tokens
from featstore.storage import Storage
from featstore.versions._keys import version_key, view_key



@dataclass(frozen=True)
class TaskSpec:
    """Everything a shard task needs, small and picklable (no tensors, no secrets in logs)."""

    storage: Storage
    name: str
    vid: str
    model_key: str
    input_key: Any
    keep: dict[str, Any]
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
    collate: Any = None  # the user's collate for A's input batch (None: default_collate)
    view: int | None = None  # the augmented view these shards belong to (None: no views)
    augment: Any = None  # fn(item, generator) -> item, with views
    augment_seed: int = 0
    tokens: Tokens | None = None  # per-token outputs: which, and the real-token mask
    ragged: tuple[str, ...] = ()  # the per-token outputs

    @property
    def key(self) -> str:
        """The group the shards are written to: the version's, or its view's."""
        return view_key(version_key(self.name, self.vid), self.view)

    def unit(self, index: int) -> int:
        """Shard ``index`` as the progress events number it: with views, view-major over every
        view's shards (so the dashboard counts each (view, shard) once)."""
        return index if self.view is None else self.view * self.layout.n_shards + index
