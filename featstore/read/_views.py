"""The reader's part of augmented views: the view each epoch reads, and the source join.

:class:`ViewReading` is what :class:`~featstore.read.FeatureDataset` adds for a version with
views (one view per epoch, batches carrying ``"view"``) and for ``source=`` (the student's own
input beside A's stored outputs, checked against the version's dataset first). The arithmetic
is in :mod:`featstore.versions` (pure); this module binds it to a :class:`Version`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from featstore._json import JSONObject
from featstore._user_types import FieldKey, MapDataset
from featstore.errors import InvalidInput, SourceMismatch
from featstore.read._options import ReaderOptions
from featstore.versions._fingerprints import dataset_digest, describe_key, sample_positions
from featstore.versions._committed import StoredVersion
from featstore.versions import InputCheck
from featstore.versions._views import (VIEW_FIELD, Augment, SourceJoin, check_view_mode, epoch_seeds, epoch_view,
                                       normalize_fields, view_seeds)

#: ``source_fields=``: the source item's fields to join (a list of keys, or batch name -> key).
SourceFields = Sequence[FieldKey] | Mapping[str, FieldKey] | None


class ViewReading:
    """What a :class:`FeatureDataset` adds for views and for the source join, in one place.

    Per epoch it picks the view to read (:meth:`start_epoch`: :attr:`reading` is the version
    bound to that view) and completes each batch (:meth:`add`): ``"view"``, and with
    ``source`` the student's input, rebuilt as ``augment(source[index], generator)`` with that
    row's seed: the view's seed with views (the pixels A saw), else a fresh seed per
    (reader seed, epoch, index). ``source_fields`` picks the item's fields (None: all of a dict
    item but those the batch already holds, ``input`` for a tensor, ``field<i>`` for a tuple).
    Before any batch, ``source`` must match the dataset the version was computed on (its length
    and sampled content digest, or ``source_id`` where the version was computed with
    ``dataset_id``), and with views ``augment`` must be the one the version was computed with;
    then each item joined must be the one its row was computed from (the version's input
    digests, where it stores them): :class:`SourceMismatch` if not, naming the item.
    """

    def __init__(self, version: StoredVersion, options: ReaderOptions, source: MapDataset | None,
                 augment: Augment | None, source_fields: SourceFields, source_id: str | None) -> None:
        self.version = version
        self.mode = check_view_mode(options.view, version.views)
        self.seed = options.seed
        self.view: int | None = None
        self.reading = version
        self.epoch = 0
        self.join: SourceJoin | None = None
        self.start_epoch(0)  # bound to a view from the start (shard formats are read from it)
        if source is None:
            if augment is not None or source_fields is not None:
                raise InvalidInput("augment= and source_fields= need source= (the dataset to join).")
            return
        check_source(version, source, source_id)
        views = version.manifest.views
        if views is not None:
            if augment is None:
                raise InvalidInput(f"{version.ref} holds augmented views: pass augment= (the function it "
                                   "was computed with) so the joined input is the view A saw.")
            if describe_key(augment) != views.augment:
                raise SourceMismatch(f"augment is not the function {version.ref} was computed with (its "
                                     "source differs); pass that same function, or recompute the views.")
        self.join = SourceJoin(source, augment, normalize_fields(source_fields), InputCheck.of(version))

    def start_epoch(self, epoch: int) -> None:
        """Pick this epoch's view (and the version bound to it)."""
        self.epoch = epoch
        views = self.version.views
        if self.mode is not None and views is not None:  # a mode is set exactly when there are views
            self.view = epoch_view(views, self.mode, self.seed, epoch)
            self.reading = self.version.view(self.view)

    def add(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``"view"`` and the joined source fields. With ``source_fields=None`` the item's fields
        the batch already holds (a kept ``target``) are left out; a named field that clashes
        with a stored one is refused."""
        if self.view is not None:
            batch[VIEW_FIELD] = torch.full(batch["index"].shape, self.view, dtype=torch.int64)
        if self.join is None:
            return batch
        index = batch["index"].numpy()
        seeds = None
        if self.join.augment is not None:
            views = self.version.manifest.views
            seeds = (epoch_seeds(self.seed, self.epoch, index) if self.view is None or views is None
                     else view_seeds(views.seed, self.view, index))
        joined = self.join.rows(index, seeds)
        clash = sorted(set(joined) & set(batch))
        if self.join.fields is None:
            joined = {k: t for k, t in joined.items() if k not in batch}
        elif clash:
            raise InvalidInput(f"source fields {clash} clash with the batch's stored fields; rename them "
                               "with source_fields={'new_name': key}.")
        batch.update(joined)
        return batch


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
