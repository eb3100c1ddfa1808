"""Model A in the loop, planned: :class:`Teacher` (a compute request plus where A runs and whether
to fill) and :func:`plan_teacher`, the version ``store.compute`` would commit for the same
arguments, planned by compute's own planner (:func:`featstore.compute.decide`, the same
fingerprint, id, views, ``extends`` and ``views_of`` decisions, per-token outputs) and sized by
compute's probe and layout, run on the teacher's device (a fresh augmentation:
:mod:`featstore.online._reading`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from featstore._user_types import MapDataset
from featstore.compute import ComputePlan, ComputeRequest, TaskSpec, decide, probe
from featstore.errors import DeviceSetupError, InvalidInput
from featstore.versions import Catalog
from featstore.versions import Claim
from featstore.versions import StoredVersion
from featstore.versions import ViewDataset, fresh_view


@dataclass(frozen=True, eq=False)
class Teacher(ComputeRequest):
    """Model A in the loop: what ``store.dataset(name, teacher=Teacher(...))`` runs in the
    consuming process (see :mod:`featstore.online`). It takes ``store.compute``'s keywords
    (:class:`~featstore.compute.ComputeRequest`) and plans the version that compute would
    commit of them; ``device`` and ``fill`` say where A runs and whether its outputs are stored.

    Attributes:
        device: where A runs in the consuming process: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``
            (CUDA cannot be used in forked DataLoader workers: use ``num_workers=0``, or the
            ``spawn`` start method).
        fill: also write the shards computed into the version, which commits once every shard
            is written; later epochs, runs and students read it (:mod:`featstore.online._fill`).
            Not with a fresh augmentation (never stored) nor with ``extends`` (the parent's
            shards are referenced, not written: compute the child with ``store.compute``).

    ``augment`` without ``views`` (and without ``views_of``) is a fresh augmentation every epoch
    (online only, never stored; the reader's ``source=`` join replays it for B).
    ``batch_size`` is A's (the stored reader's ``batch_size`` is B's).

    >>> teacher = featstore.Teacher(model=model_a, dataset=train_set, outputs={"features": "float16"})
    >>> ds = store.dataset("cnn-a/train", batch_size=256, teacher=teacher)         # online
    >>> ds = store.dataset("cnn-a/train", batch_size=256, teacher=replace(teacher, fill=True))
    """

    device: str = field(default="cpu", kw_only=True)
    fill: bool = field(default=False, kw_only=True)

    caller: ClassVar[str] = "Teacher"

    def __post_init__(self) -> None:
        if self.views is None and self.views_of is None and self.augment_seed is not None:
            raise InvalidInput("augment_seed= names the seed of views: pass "
                               "views=featstore.Views(k=K, augment=fn, seed=S) (augment= alone is a fresh "
                               "augmentation every epoch, which has no seed of its own).")
        super().__post_init__()
        if not isinstance(self.fill, bool):
            raise InvalidInput(f"fill must be True or False, got {self.fill!r}.")
        try:
            kind = torch.device(self.device).type
        except (RuntimeError, TypeError):
            kind = None
        if kind not in ("cpu", "cuda"):
            raise InvalidInput(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}.")
        if self.fresh and self.fill:
            raise InvalidInput(
                "fill=True with a fresh augmentation (augment= without views=) would store outputs of one "
                "random draw as if they could be replayed; they are never stored. Compute K replayable "
                "views instead (views=K with augment=fn draws from the generator it is given), or keep fill=False.")
        if self.extends is not None and self.fill:
            raise InvalidInput("fill=True with extends= is not supported: the child references its parent's shards "
                               "instead of writing them. Compute it with store.compute(..., extends=...), or read "
                               "it online (fill=False).")

    @property
    def fresh(self) -> bool:
        """Whether A sees a fresh (non-replayable) augmentation every epoch."""
        return self.augment is not None and self.views is None and self.views_of is None

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
    version: StoredVersion
    spec: TaskSpec  # the shard tasks' spec (arrays, layout, dtypes), view None
    claim: Claim | None  # with fill: the version folder's claim

    @property
    def vid(self) -> str:
        return self.plan.vid

    def seen(self, view: int | None, epoch: int, seed: int) -> MapDataset:
        """The dataset as A sees it: view ``view``'s items (the views as planned: given, or
        ``views_of``'s), or, under a fresh augmentation, epoch ``epoch``'s draw for the reader's
        ``seed``, or the items as they are."""
        dataset, views, fresh = self.teacher.dataset, self.plan.views, self.teacher.augment
        if view is not None and views is not None:
            return ViewDataset(dataset, views.augment, views.seed, view)
        if self.teacher.fresh and fresh is not None:
            return fresh_view(dataset, fresh, seed, epoch)
        return dataset


def plan_teacher(catalog: Catalog, name: str, teacher: Teacher) -> Planned | StoredVersion:
    """The version ``store.compute(name, ...)`` would commit for the teacher's arguments, planned
    without computing it (compute's :func:`~featstore.compute.decide`, its probe on the
    teacher's device and its layout): the committed one itself if it exists and ``fill`` is
    asked."""
    plan = decide(catalog, name, teacher, fresh=teacher.fresh)
    if teacher.fill and (existing := catalog.committed(name, plan.vid)) is not None:
        return existing
    return _planned(catalog, teacher, plan)


def plan_new(catalog: Catalog, name: str, teacher: Teacher) -> Planned:
    """:func:`plan_teacher` for a name nothing was committed under (a scratch version): always
    the plan, even with ``fill``."""
    return _planned(catalog, teacher, decide(catalog, name, teacher, fresh=teacher.fresh))


def _planned(catalog: Catalog, teacher: Teacher, plan: ComputePlan) -> Planned:
    """The plan made concrete: probed on the teacher's device, laid out, and with ``fill``
    claimed."""
    base = TaskSpec.of(plan, catalog.storage, f"{plan.vid}-online-{os.getpid()}-{id(teacher):x}")
    probed = probe(base, teacher.model, teacher.dataset, plan.n, teacher.torch_device())
    layout, arrays = plan.layout(probed, catalog.storage.is_local)
    claim = None
    if teacher.fill:
        claim = catalog.commits.claim(plan.name, plan.vid, layout, arrays, plan.bases, plan.view_count)
        layout, arrays = claim.layout, claim.arrays
    spec = replace(base.planned(layout, arrays, probed), view=None)
    return Planned(teacher, plan, StoredVersion(catalog.storage, plan.manifest(layout, arrays)), spec, claim)
