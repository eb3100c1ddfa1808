"""What one compute call does, decided once before any task runs (:func:`decide`): the validated
request, its fingerprint and version id, the views, and what it inherits from an ``extends=``
parent (:class:`~featstore.compute._extends.Growth`: the shards it references, the layout and
arrays it keeps). The driver hands this :class:`ComputePlan` down to the claim, the tasks and
the manifest instead of returning to the parent's growth in pieces.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any


from featstore.errors import EmptyDataset, InvalidInput, VersionsMisaligned
from featstore.versions._alignment import LINK, Alignment, adopt_views, check_views_of, link
from featstore.versions._fingerprints import dataset_digest, describe_key, fingerprint, model_digest, sampled_digest
from featstore.format._arrays import chunk_label
from featstore.format._keys import RESERVED_FIELDS
from featstore.format._manifests import ArraySpec, Base, ShardReceipt, ViewsSpec, check_spread
from featstore._allowed_names import check_field, check_name
from featstore.codecs._parts import check_output_codec
from featstore.codecs._ragged import TOKEN_FIELDS, Tokens
from featstore.compute._batches import collate_batch
from featstore._user_code import dataset_length, read_item
from featstore.codecs._statistics import summarize
from featstore.compute._extends import Growth, plan_growth
from featstore.versions._catalog import Catalog
from featstore.versions._committed import Version
from featstore.versions._views import SEED_FIELD, SEED_POLICY, VIEW_FIELD, check_replayable, replay, view_seed

from featstore.compute._options import ComputeOptions



@dataclass(frozen=True)
class _Request:
    """A validated ``compute`` call (what the fingerprint and the tasks are built from)."""

    name: str
    n: int
    input_key: Any
    keep: dict[str, Any]
    outputs: dict[str, str]
    batch_size: int
    samples_per_shard: int | None
    views: int | None = None
    augment: Any = None
    augment_seed: int = 0
    tokens: Tokens | None = None
    ragged: tuple[str, ...] = ()  # the per-token outputs


def normalize_keep(keep: Sequence[Any] | Mapping[str, Any]) -> dict[str, Any]:
    """``["target"]`` -> ``{"target": "target"}``; ``{"label": 1}`` stays; ints get ``field<i>``."""
    if isinstance(keep, str):
        keep = [keep]
    pairs = keep.items() if isinstance(keep, Mapping) else ((k if isinstance(k, str) else f"field{k}", k) for k in keep)
    return {check_field(name): key for name, key in pairs}


def _validate(name: str, dataset: Any, input_key: Any, keep: Sequence[Any] | Mapping[str, Any],
              outputs: Mapping[str, str] | None, batch_size: int, samples_per_shard: int | None,
              options: "ComputeOptions", views: int | None = None, augment: Any = None,
              augment_seed: int = 0, tokens: Tokens | None = None) -> _Request:
    """Check every argument before anything runs; bad input raises with what to change."""
    check_name(name)
    if outputs is None:
        outputs = {"features": "float32"}
    if not isinstance(outputs, Mapping) or not outputs:
        raise InvalidInput("outputs must be a non-empty dict like {'features': 'float16'}.")
    outputs = {check_field(k): check_output_codec(v) for k, v in outputs.items()}
    keep_map = normalize_keep(keep)
    reserved = set(RESERVED_FIELDS) | ({VIEW_FIELD, SEED_FIELD} if views is not None else set()) | set(TOKEN_FIELDS)
    if tokens is not None and not isinstance(tokens, Tokens):
        raise InvalidInput("tokens= takes featstore.Tokens(mask=fn, max_tokens=N), e.g. "
                           "Tokens(mask=lambda x: x['attention_mask'], max_tokens=512).")
    ragged = tokens.ragged_outputs(list(outputs)) if tokens is not None else ()
    clash = (set(outputs) & set(keep_map)) | ((set(outputs) | set(keep_map)) & reserved)
    if clash:
        raise InvalidInput(f"array names {sorted(clash)} are used twice or reserved; rename them.")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidInput(f"batch_size must be a positive int, got {batch_size!r}.")
    if options.autocast not in (None, "float16", "bfloat16"):
        raise InvalidInput("ComputeOptions.autocast must be None, 'float16' or 'bfloat16'.")
    n = dataset_length(dataset)
    if n == 0:
        raise EmptyDataset("the dataset is empty; there is nothing to compute. Check its path or filter.")
    first = _first_seen(dataset, n, views, augment, augment_seed)
    # What a task would do with the first item, here, before anything runs: a missing field, or
    # items that cannot be batched (PIL images, strings), fail now, naming the field and the fix.
    collate_batch([first], input_key, keep_map, options.collate, 0)
    return _Request(name, n, input_key, keep_map, outputs, batch_size, samples_per_shard,
                    views, augment, augment_seed, tokens, ragged)


def _first_seen(dataset: Any, n: int, views: int | None, augment: Any, augment_seed: int) -> Any:
    """The first item as Model A will see it, after checking the views arguments; with views,
    ``augment`` is replayed twice on two items and must give the same bytes both times."""
    if views is None:
        if augment is not None:
            raise InvalidInput("augment= needs views=K (K augmented views per sample are computed and "
                               "stored); for one augmented view pass views=1.")
        return read_item(dataset, 0)
    if isinstance(views, bool) or not isinstance(views, int) or views < 1:
        raise InvalidInput(f"views must be a positive int (augmented views per sample), got {views!r}.")
    if not callable(augment):
        raise InvalidInput("views=K needs augment=fn, where fn(item, generator) -> item draws all its "
                           "randomness from the torch.Generator it is given.")
    if isinstance(augment_seed, bool) or not isinstance(augment_seed, int):
        raise InvalidInput(f"augment_seed must be an int, got {augment_seed!r}.")
    check_replayable(dataset, augment, augment_seed, sorted({0, n // 2}))
    return replay(augment, read_item(dataset, 0), view_seed(augment_seed, 0, 0))


def views_spec(req: _Request) -> ViewsSpec | None:
    """The views part of the fingerprint and the manifest (None without views)."""
    if req.views is None:
        return None
    return ViewsSpec(req.views, req.augment_seed, SEED_POLICY, describe_key(req.augment))


def _fingerprint_parts(req: _Request, model: Any, dataset: Any, options: "ComputeOptions") -> dict[str, Any]:
    """Everything that decides the stored bytes (see docs/how-it-works.md on fingerprints)."""
    return {
        **model_digest(model, options.model_id),  # "model" (weights) and "model_code"
        "dataset": dataset_digest(dataset, options.dataset_id),
        "input_key": describe_key(req.input_key),
        "keep": {k: describe_key(v) for k, v in req.keep.items()},
        "outputs": req.outputs,
        # Compression never changes the values, but it changes the stored bytes (and digests).
        "codecs": {"chunk": chunk_label(options.compression), "schema": 1},
        "autocast": options.autocast,
        # only when set, so every fingerprint computed before collate existed stays the same
        **({"collate": describe_key(options.collate)} if options.collate is not None else {}),
        # Only with views, so versions without them keep their ids.
        **({} if req.views is None else {"views": asdict(views_spec(req))}),
        **({} if req.tokens is None else {"tokens": {"mask": describe_key(req.tokens.mask), "outputs": list(req.ragged),
                                                     "max_tokens": req.tokens.max_tokens,
                                                     **req.tokens.identity()}}),
    }

def _check_parent_spread(parent: Version, options: ComputeOptions) -> None:
    """A child reads its parent's shards where the parent's spread put them, with its own
    spread: so it keeps the parent's (leave ``spread_prefixes`` out, or give the same)."""
    spread = parent.manifest.layout.spread
    if options.spread_prefixes not in (None, spread):
        raise InvalidInput(f"extends={parent.ref!r} keeps the parent's spread over {spread} prefixes; leave "
                           f"ComputeOptions.spread_prefixes out (got {options.spread_prefixes}).")


def _adopt_base(base: Version, parent: Version | None, views: int | None, augment: Any, augment_seed: int | None,
                samples_per_shard: int | None) -> tuple[int | None, int, int]:
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


def _check_views_extends(parent: Version | None, views: int | None) -> None:
    """Views and ``extends`` do not combine yet: refuse before anything runs."""
    if parent is None:
        return
    if views is not None:
        raise InvalidInput(f"views= together with extends= is not supported yet; compute the version with "
                           f"views without extends (a full compute), or extend {parent.ref} without views.")
    if parent.views is not None:
        raise InvalidInput(f"{parent.ref} has augmented views; extends= of a version with views is not "
                           "supported yet. Compute the bigger dataset without extends.")


def _dataset_sample(parts: Mapping[str, Any], dataset: Any) -> str | None:
    """The sampled content digest (already in the fingerprint unless a dataset_id replaced it)."""
    digest = parts["dataset"].get("digest")
    if digest is not None:
        return digest
    try:
        return sampled_digest(dataset)
    except InvalidInput:  # items featstore cannot digest: such a version cannot be extended
        return None


@dataclass(frozen=True)
class ComputePlan:
    """What one compute call does, decided once: the request, its fingerprint and version id,
    the views, and what it inherits from a parent. Everything below reads it; nothing below
    decides it again."""

    req: _Request
    parts: dict[str, Any]  # the fingerprint's parts, as the manifest records them
    fingerprint: str
    growth: Growth | None  # an ``extends=`` parent: the shards referenced, layout and arrays kept
    dataset_sample: str | None

    @property
    def vid(self) -> str:
        return self.fingerprint[:16]

    @property
    def views(self) -> ViewsSpec | None:
        return views_spec(self.req)

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

    def chunk_rows(self, options: ComputeOptions) -> int | None:
        return self.growth.layout.chunk_rows if self.growth is not None else options.chunk_rows

    def spread(self, options: ComputeOptions) -> int:
        return self.growth.layout.spread if self.growth is not None else check_spread(options.spread_prefixes)

    def stats(self, receipts: list[ShardReceipt], arrays: dict[str, ArraySpec]) -> dict[str, dict]:
        """The manifest's statistics over every shard, the inherited ones included."""
        if self.growth is None:
            return summarize((r.stats for r in receipts), arrays)
        return self.growth.summarize(self.inherited, receipts[self.growth.first_own:], arrays)


def decide(catalog: Catalog, name: str, *, model: Any, dataset: Any, input_key: Any, keep: Any, outputs: Any,
           batch_size: int, samples_per_shard: int | None, options: ComputeOptions, extends: Any,
           views: int | None, augment: Any, augment_seed: int | None, tokens: Tokens | None,
           views_of: Any = None) -> ComputePlan:
    """Validate a compute call and decide what it does (see :class:`ComputePlan`)."""
    parent = catalog.open(extends) if extends is not None else None
    base = None if views_of is None else catalog.open(views_of)
    if base is not None:
        views, augment_seed, samples_per_shard = _adopt_base(base, parent, views, augment, augment_seed,
                                                             samples_per_shard)
    _check_views_extends(parent, views)
    augment_seed = 0 if augment_seed is None else augment_seed
    if parent is not None:
        spp = parent.manifest.layout.samples_per_shard
        if samples_per_shard not in (None, spp):
            raise InvalidInput(f"extends={parent.ref!r} keeps the parent's {spp} samples per shard; "
                               f"leave samples_per_shard out (got {samples_per_shard}).")
        samples_per_shard = spp
        _check_parent_spread(parent, options)
    req = _validate(name, dataset, input_key, keep, outputs, batch_size, samples_per_shard, options,
                    views, augment, augment_seed, tokens)
    parts = _fingerprint_parts(req, model, dataset, options)
    if base is not None:
        check_views_of(base, Alignment.of_parts(parts["dataset"], _dataset_sample(parts, dataset), views_spec(req)))
        parts = {**parts, LINK: link(base)}
    growth = None if parent is None else plan_growth(parent, dataset, parts, req.n)
    if growth is not None:
        parts = {**parts, "extends": parent.fingerprint}
    return ComputePlan(req, parts, fingerprint(parts), growth, _dataset_sample(parts, dataset))
