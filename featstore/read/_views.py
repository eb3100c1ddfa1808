"""The reader's part of augmented views: the view each epoch reads, and the source join.

:class:`StreamViews` is what a reader's stream adds for a version with views (one view per
epoch, batches carrying ``"view"``) and for a join (:class:`~featstore.read.Join`: the student's
own input beside A's stored outputs, checked against the version's dataset first). The
arithmetic is in :mod:`featstore.versions` (pure); this module binds it to a stream's version.
"""

from __future__ import annotations

import numpy as np
import torch

from featstore._json import JSONObject
from featstore._user_types import MapDataset
from featstore.errors import InvalidInput, SourceMismatch
from featstore.read._options import Join
from featstore.versions import (InputCheck, SourceJoin, StoredVersion, check_view_mode, dataset_digest, describe_key,
                                epoch_seeds, epoch_view, normalize_fields, sample_positions, view_seeds)


class StreamViews:
    """The view a stream reads each epoch, and its join, in one place.

    Per epoch it picks the view to read (:meth:`start_epoch`: :attr:`view`, which the stream's
    reads of every teacher follow) and joins the student's input to rows (:meth:`joined`):
    ``augment(source[index], generator)`` with that row's seed: the view's seed with views (the
    pixels A saw), else a fresh seed per (reader seed, epoch, index). Before any batch, the
    join's ``source`` must match the dataset the version was computed on (its length and sampled
    content digest, or ``source_id`` where the version was computed with ``dataset_id``), and with
    views ``augment`` must be the one the version was computed with; then each item joined must be
    the one its row was computed from (the version's input digests, where it stores them):
    :class:`SourceMismatch` if not, naming the item.
    """

    def __init__(self, version: StoredVersion, mode: str | int | None, seed: int, join: Join | None) -> None:
        self.version = version
        self.mode = check_view_mode(mode, version.views)
        self.seed = seed
        self.view: int | None = None
        self.epoch = 0
        self.join: SourceJoin | None = None
        self.start_epoch(0)  # bound to a view from the start (shard formats are read from it)
        if join is None:
            return
        check_source(version, join.source, join.source_id)
        views = version.manifest.views
        if views is not None:
            if join.augment is None:
                raise InvalidInput(f"{version.ref} holds augmented views: pass augment= (the function it "
                                   "was computed with) so the joined input is the view A saw.")
            if describe_key(join.augment) != views.augment:
                raise SourceMismatch(f"augment is not the function {version.ref} was computed with (its "
                                     "source differs); pass that same function, or recompute the views.")
        self.join = SourceJoin(join.source, join.augment, normalize_fields(join.fields), InputCheck.of(version))

    def start_epoch(self, epoch: int) -> None:
        """Pick this epoch's view."""
        self.epoch = epoch
        views = self.version.views
        if self.mode is not None and views is not None:  # a mode is set exactly when there are views
            self.view = epoch_view(views, self.mode, self.seed, epoch)

    def joined(self, index: np.ndarray) -> dict[str, torch.Tensor]:
        """The joined fields of rows ``index`` (empty without a join)."""
        if self.join is None:
            return {}
        seeds = None
        if self.join.augment is not None:
            views = self.version.manifest.views
            seeds = (epoch_seeds(self.seed, self.epoch, index) if self.view is None or views is None
                     else view_seeds(views.seed, self.view, index))
        return self.join.rows(index, seeds)

    @property
    def names_fields(self) -> bool:
        """Whether the join names its fields (then one that clashes with a stored array is refused)."""
        return self.join is not None and self.join.fields is not None


def check_source(version: StoredVersion, source: MapDataset, source_id: str | None = None,
                 what: str = "source") -> None:
    """Raise :class:`SourceMismatch` unless ``source`` is the dataset ``version`` was computed on.

    >>> check_source(store.open("cnn-a/train"), train_set)   # silent when they match
    """
    recorded = version.manifest.fingerprint_parts.get("dataset")
    want: JSONObject = recorded if isinstance(recorded, dict) else {}
    try:
        n = len(source)
    except TypeError:
        raise InvalidInput("source must be a map-style dataset with __len__ and __getitem__.") from None
    if n != want.get("length"):
        raise SourceMismatch(f"source has {n} items but {version.ref} was computed on {want.get('length')}: "
                             "rows would not align. Pass the dataset the version was computed on.")
    if "id" in want:
        if source_id is not None and source_id != want["id"]:
            raise SourceMismatch(f"source_id {source_id!r} is not the dataset_id {want['id']!r} that "
                                 f"{version.ref} was computed with.")
        return  # computed with a dataset_id: only its length can be checked without source_id
    check = InputCheck.of(version)
    if check is not None:  # the sampled items one by one: a mismatch names its index
        at = sample_positions(n)
        check.check(at, [source[i] for i in at], what)
    if dataset_digest(source)["digest"] != want.get("digest"):
        raise SourceMismatch(f"source is not the dataset {version.ref} was computed on (its sampled "
                             "content digest differs): rows would silently misalign. Pass that dataset "
                             "(same items in the same order), or recompute the version on this one.")
