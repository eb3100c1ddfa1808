"""What one compute does, decided once before any task runs (:func:`decide`): the validated
request, its fingerprint and version id, the views, and what it inherits from an ``extends=``
parent (:class:`~featstore.compute._extends.Growth`: the shards it references, the layout and
arrays it keeps). The driver hands this :class:`ComputePlan` down to the claim, the tasks and
the manifest instead of returning to the parent's growth in pieces; the teacher in the loop
(:mod:`featstore.online`) plans with the same function, so both make the same version.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property

from featstore._json import JSONObject
from featstore._user_types import FieldKey, Item, MapDataset

from featstore.errors import EmptyDataset, InvalidInput, VersionsMisaligned
from featstore.versions import LINK, Alignment, adopt_views, check_views_of, link
from featstore.versions import (dataset_digest, dataset_fingerprint, describe_key, fingerprint, model_digest,
                                sampled_digest)
from featstore.format import chunk_label
from featstore.format import RESERVED_FIELDS
from featstore.format import ArraySpec, ArrayStats, Base, Layout, Manifest, ShardReceipt, ViewsSpec, check_spread
from featstore._allowed_names import check_name
from featstore.codecs import TOKEN_FIELDS
from featstore.versions import DIGEST_FIELD
from featstore.compute._batches import collate_batch
from featstore._user_code import dataset_length, read_item
from featstore.codecs import summarize
from featstore.compute._extends import Growth, plan_growth
from featstore.versions import Catalog
from featstore.versions import StoredVersion
from featstore.versions import SEED_FIELD, SEED_POLICY, VIEW_FIELD, Augment, Views, check_replayable, replay, view_seed

from featstore.compute._options import ComputeOptions
from featstore.compute._request import ComputeRequest, normalize_keep, outputs_asked, ragged_outputs
from featstore.compute._task_spec import Probe



def _arrays_asked(request: ComputeRequest,
                  views: int | None) -> tuple[dict[str, str], dict[str, FieldKey], tuple[str, ...]]:
    """The outputs, the kept fields and the per-token outputs; no name used twice or reserved
    (the views' arrays are reserved only with views: known once ``views_of`` gave them)."""
    outputs, keep = outputs_asked(request.outputs), normalize_keep(request.keep)
    ragged = ragged_outputs(request.tokens, outputs)
    reserved = (set(RESERVED_FIELDS) | ({VIEW_FIELD, SEED_FIELD} if views is not None else set()) | set(TOKEN_FIELDS)
                | {DIGEST_FIELD})
    clash = (set(outputs) & set(keep)) | ((set(outputs) | set(keep)) & reserved)
    if clash:
        raise InvalidInput(f"array names {sorted(clash)} are used twice or reserved; rename them.")
    return outputs, keep, ragged


def _check_dataset(request: ComputeRequest, keep: dict[str, FieldKey], views: Views | None) -> int:
    """The dataset's length, after what a task would do with the first item has been done here,
    before anything runs: a missing field, or items that cannot be batched (PIL images,
    strings), fail now, naming the field and the fix."""
    n = dataset_length(request.dataset)
    if n == 0:
        raise EmptyDataset("the dataset is empty; there is nothing to compute. Check its path or filter.")
    first = _first_seen(request.dataset, n, views)
    collate_batch([first], request.input_key, keep, request.compute_options.collate, 0)
    return n


def _checked_views(k: int | None, augment: Augment | None, seed: int | None) -> Views | None:
    """K, the augment and the seed as :class:`Views` (None without views), each checked."""
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InvalidInput(f"views must be a positive int (augmented views per sample), got {k!r}.")
    if augment is None or not callable(augment):
        raise InvalidInput("views=K needs augment=fn, where fn(item, generator) -> item draws all its "
                           "randomness from the torch.Generator it is given.")
    seed = 0 if seed is None else seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidInput(f"augment_seed must be an int, got {seed!r}.")
    return Views(k, augment, seed)


def _first_seen(dataset: MapDataset, n: int, views: Views | None) -> Item:
    """The first item as Model A will see it; with views, ``augment`` is replayed twice on two
    items and must give the same bytes both times."""
    if views is None:
        return read_item(dataset, 0)
    check_replayable(dataset, views.augment, views.seed, sorted({0, n // 2}))
    return replay(views.augment, read_item(dataset, 0), view_seed(views.seed, 0, 0))


def _views_spec(views: Views) -> ViewsSpec:
    return ViewsSpec(views.k, views.seed, SEED_POLICY, describe_key(views.augment))


def views_spec(views: Views | None) -> ViewsSpec | None:
    """The views part of the fingerprint and the manifest (None without views)."""
    return None if views is None else _views_spec(views)


def _fingerprint_parts(request: ComputeRequest, keep: dict[str, FieldKey], outputs: dict[str, str],
                       ragged: tuple[str, ...], views: Views | None) -> JSONObject:
    """Everything that decides the stored bytes (see docs/how-it-works.md on fingerprints)."""
    options = request.compute_options
    return {
        **model_digest(request.model, options.model_id),  # "model" (weights) and "model_code"
        "dataset": dataset_digest(request.dataset, options.dataset_id),
        "input_key": describe_key(request.input_key),
        "keep": {k: describe_key(v) for k, v in keep.items()},
        "outputs": dict(outputs),
        # Compression never changes the values, but it changes the stored bytes (and digests).
        "codecs": {"chunk": chunk_label(options.compression), "schema": 1},
        "autocast": options.autocast,
        # only when set, so every fingerprint computed before collate existed stays the same
        **({"collate": describe_key(options.collate)} if options.collate is not None else {}),
        # Only with views, so versions without them keep their ids.
        **({} if views is None else {"views": asdict(_views_spec(views))}),
        **({} if request.tokens is None else {"tokens": {"mask": describe_key(request.tokens.mask),
                                                         "outputs": list(ragged),
                                                         "max_tokens": request.tokens.max_tokens,
                                                         **request.tokens.identity()}}),
    }


def _check_parent_spread(parent: StoredVersion, options: ComputeOptions) -> None:
    """A child reads its parent's shards where the parent's spread put them, with its own
    spread: so it keeps the parent's (leave ``spread_prefixes`` out, or give the same)."""
    spread = parent.manifest.layout.spread
    if options.spread_prefixes not in (None, spread):
        raise InvalidInput(f"extends={parent.ref!r} keeps the parent's spread over {spread} prefixes; leave "
                           f"ComputeOptions.spread_prefixes out (got {options.spread_prefixes}).")


def _adopt_base(base: StoredVersion, parent: StoredVersion | None, views: int | None, augment: Augment | None,
                augment_seed: int | None, samples_per_shard: int | None) -> tuple[int | None, int, int]:
    """``views_of``: the base's views, seed and shard size (what is given must agree)."""
    if parent is not None:
        raise InvalidInput("views_of= and extends= do not combine: compute the version on the whole dataset "
                           "with views_of alone.")
    views, augment_seed = adopt_views(base, views, augment, augment_seed)
    spp = base.manifest.layout.samples_per_shard
    if samples_per_shard not in (None, spp):
        raise VersionsMisaligned(f"views_of={base.ref!r} keeps that version's {spp} samples per shard (so both are "
                                 f"read with one plan); leave samples_per_shard out (got {samples_per_shard}).",
                                 ("samples per shard",))
    return views, augment_seed, spp


def _check_views_extends(parent: StoredVersion | None, views: int | None) -> None:
    """Views and ``extends`` do not combine yet: refuse before anything runs."""
    if parent is None:
        return
    if views is not None:
        raise InvalidInput(f"views= together with extends= is not supported yet; compute the version with "
                           f"views without extends (a full compute), or extend {parent.ref} without views.")
    if parent.views is not None:
        raise InvalidInput(f"{parent.ref} has augmented views; extends= of a version with views is not "
                           "supported yet. Compute the bigger dataset without extends.")


def _dataset_sample(parts: JSONObject, dataset: MapDataset) -> str | None:
    """The sampled content digest (already in the fingerprint unless a dataset_id replaced it)."""
    digest = part.get("digest") if isinstance(part := parts["dataset"], dict) else None
    if isinstance(digest, str):
        return digest
    try:
        return sampled_digest(dataset)
    except InvalidInput:  # items featstore cannot digest: such a version cannot be extended
        return None


@dataclass(frozen=True, eq=False)
class ComputePlan:
    """What one compute call does, decided once (by :func:`decide`): the request and what was
    decided of it (the arrays asked for, the views and shard size, adopted from ``views_of`` or
    ``extends``), its fingerprint and version id, and what it inherits from a parent.
    Everything below reads it; nothing below decides it again: ``store.compute``'s driver and
    the teacher in the loop (:mod:`featstore.online`) plan with it alike."""

    name: str
    request: ComputeRequest  # as given
    n: int  # samples in the dataset
    outputs: dict[str, str]  # output -> canonical codec name
    keep: dict[str, FieldKey]  # kept field -> key in the item
    ragged: tuple[str, ...]  # the per-token outputs
    views: Views | None  # K, augment and seed as decided (None: one view as the items are)
    samples_per_shard: int | None  # as given, or the parent's / the base's
    parts: JSONObject  # the fingerprint's parts, as the manifest records them
    fingerprint: str
    growth: Growth | None  # an ``extends=`` parent: the shards referenced, layout and arrays kept
    dataset_sample: str | None

    @property
    def digests(self) -> bool:
        """Whether the version stores each sample's input digest: wherever the items can be
        digested (the sampled ones could), unless it grows a parent stored without them."""
        if self.growth is not None:
            return DIGEST_FIELD in self.growth.parent.manifest.arrays
        return self.dataset_sample is not None

    @property
    def vid(self) -> str:
        return self.fingerprint[:16]

    @property
    def options(self) -> ComputeOptions:
        return self.request.compute_options

    @property
    def view_count(self) -> int | None:
        """K (None without views): what receipts, claims and commits count units by."""
        return None if self.views is None else self.views.k

    @property
    def views_spec(self) -> ViewsSpec | None:
        return views_spec(self.views)

    @property
    def bases(self) -> tuple[Base, ...]:
        """The parent's shards this version references in place (none without a parent)."""
        return self.growth.bases if self.growth is not None else ()

    @cached_property
    def inherited(self) -> tuple[ShardReceipt, ...]:
        """Digests and statistics of the referenced shards (read once, from the parent's records)."""
        return tuple(self.growth.inherited_receipts()) if self.growth is not None else ()

    def arrays(self, probed: dict[str, ArraySpec]) -> dict[str, ArraySpec]:
        """The arrays to store: as the probe found them, or the parent's."""
        return self.growth.adopt_arrays(probed) if self.growth is not None else probed

    def chunk_rows(self) -> int | None:
        return self.growth.layout.chunk_rows if self.growth is not None else self.options.chunk_rows

    def spread(self) -> int:
        return self.growth.layout.spread if self.growth is not None else check_spread(self.options.spread_prefixes)

    def layout(self, probe: Probe, local: bool) -> tuple[Layout, dict[str, ArraySpec]]:
        """The layout and arrays a run claims for what the probe found (before a claim adopts a
        concurrent run's); ``local``: whether the store is on a local disk."""
        from featstore.compute._layout import planned_layout

        return planned_layout(self, probe, local)

    def manifest(self, layout: Layout, arrays: dict[str, ArraySpec]) -> Manifest:
        """The version's manifest as far as it is known before any shard is computed (what an
        online reader reads; the commit adds statistics, records, times and libraries)."""
        return Manifest(id=self.vid, name=self.name, fingerprint=self.fingerprint, fingerprint_parts=dict(self.parts),
                        layout=layout, arrays=arrays, stats={}, created_at="", timings={}, libraries={},
                        bases=self.bases, dataset_sample=self.dataset_sample, views=self.views_spec,
                        source_fingerprint=dataset_fingerprint(self.request.dataset))

    def stats(self, receipts: list[ShardReceipt], arrays: dict[str, ArraySpec]) -> dict[str, ArrayStats]:
        """The manifest's statistics over every shard, the inherited ones included."""
        if self.growth is None:
            return summarize((r.stats for r in receipts), arrays)
        reused = self.growth.reused
        return self.growth.summarize(self.inherited, [r for r in receipts if r.index not in reused], arrays)


def decide(catalog: Catalog, name: str, request: ComputeRequest, *, fresh: bool = False) -> ComputePlan:
    """Validate a compute of ``request`` into feature set ``name`` and decide what it does (see
    :class:`ComputePlan`): the plan ``store.compute`` runs and the teacher in the loop reads.

    ``fresh``: ``request.augment`` (without views) is a fresh augmentation every epoch (the
    teacher in the loop's): its outputs are never stored, and the fingerprint records it, so
    the id is no stored version's.
    """
    check_name(name)
    k, augment, seed = request.view_count, request.view_augment, request.given_view_seed
    if fresh:
        if k is not None or request.views_of is not None:
            raise InvalidInput("a fresh augmentation is augment= without views= and views_of=.")
        augment = None
    parent = catalog.open(request.extends) if request.extends is not None else None
    base = None if request.views_of is None else catalog.open(request.views_of)
    samples_per_shard = request.samples_per_shard
    if base is not None:
        k, seed, samples_per_shard = _adopt_base(base, parent, k, augment, seed, samples_per_shard)
    elif k is None and augment is not None:
        raise InvalidInput("augment= needs views=featstore.Views(k=K, augment=fn) (K augmented views per sample are "
                           "computed and stored); for one augmented view pass k=1.")
    _check_views_extends(parent, k)
    if parent is not None:
        spp = parent.manifest.layout.samples_per_shard
        if samples_per_shard not in (None, spp):
            raise InvalidInput(f"extends={parent.ref!r} keeps the parent's {spp} samples per shard; "
                               f"leave samples_per_shard out (got {samples_per_shard}).")
        samples_per_shard = spp
        _check_parent_spread(parent, request.compute_options)
    views = _checked_views(k, augment, seed)
    outputs, keep, ragged = _arrays_asked(request, k)
    n = _check_dataset(request, keep, views)
    parts = _fingerprint_parts(request, keep, outputs, ragged, views)
    if fresh:  # outputs of one epoch's draw: an id no stored version has
        parts["fresh_augment"] = describe_key(request.augment)
    if base is not None:
        check_views_of(base, Alignment.of_parts(parts["dataset"], _dataset_sample(parts, request.dataset),
                                                views_spec(views)))
        parts = {**parts, LINK: link(base)}
    growth = None
    if parent is not None:
        growth = plan_growth(parent, request.dataset, parts, n)
        parts = {**parts, "extends": parent.fingerprint}
    return ComputePlan(name, request, n, outputs, keep, ragged, views, samples_per_shard, parts, fingerprint(parts),
                       growth, _dataset_sample(parts, request.dataset))
