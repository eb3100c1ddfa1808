"""A rerun that knows what changed: the content check of a compute against a stored version.

A version's id comes from Model A, the outputs and the dataset's *sampled* identity (its length
and 16 evenly spaced items: :mod:`featstore.versions._fingerprints`), which a rerun can compute
at once. What it cannot see is an edited item elsewhere. Every version now stores each sample's
input digest (:mod:`featstore.versions._digests`), so a rerun decides with them:

- **The same id is committed**: the items of the dataset given are digested (a pass without A:
  :func:`check_shards`, on the Dask cluster, or in this process where reading every item is
  cheap) and compared with the stored digests. None differs: the stored version is returned.
  Some differ: the version to compute is a new one, whose fingerprint adds the content digest
  of the items given, and which references every shard of the stored one whose items are
  unchanged (:func:`~featstore.compute._extends.reuse`): only the others are computed.
- **The id is new**, and the feature set holds a version of the same Model A and outputs (the
  newest, a *donor*) with digests at some of the same sampled positions: the same pass finds its
  unchanged shards, and the new version references them.

The stored version is trusted without a pass when the caller vouches for the content
(``ComputeOptions(dataset_id=...)``), when the dataset proves its content is the one recorded
(a Hugging Face ``datasets.Dataset``'s own fingerprint, :func:`dataset_fingerprint`), and for a
version written before digests existed (its identity stays the sampled one, with a
:class:`~featstore.errors.FingerprintWarning` that says so).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from featstore._json import JSONObject
from featstore._user_code import read_item
from featstore._user_types import MapDataset
from featstore.compute._decision import ComputePlan
from featstore.compute._extends import reuse
from featstore.compute._shard_rows import read_inputs
from featstore.errors import FingerprintWarning, InvalidInput
from featstore.format import shard_digest
from featstore.versions import Catalog
from featstore.versions import StoredVersion
from featstore.versions import DIGEST_FIELD, content_digest, item_digest
from featstore.versions import dataset_fingerprint, fingerprint, sample_positions

log = logging.getLogger("featstore")

#: Fingerprint parts a donor may differ in: the dataset's identity and where its shards came from.
_DATA_PARTS = frozenset({"dataset", "extends"})
#: Items read at once by a check task (bounds its memory, not its speed).
_CHECK_BATCH = 256
#: Sample indices of changed items a check keeps, per shard and in the report.
_SHOWN = 10
#: A check estimated to take less than this in this process does not start a Dask cluster.
IN_PROCESS_S = 2.0


@dataclass(frozen=True)
class ShardCheck:
    """One shard of the dataset given, against the stored version (what a check task returns):
    how many of its items differ from the stored ones (an item beyond the stored version's
    rows counts as changed), the first of them, and the sha256 of its digests (what its
    receipt will record)."""

    index: int
    changed: int
    first: tuple[int, ...]
    digest: str


def check_shards(stored: StoredVersion, dataset: MapDataset, shards: Sequence[int], n: int) -> list[ShardCheck]:
    """The check task: digest every item of ``shards`` (cut as ``stored`` cuts its shards; the
    dataset has ``n`` items) and compare each with the digest ``stored`` holds for its row. Reads
    the items as a compute does, without Model A."""
    spp = stored.manifest.layout.samples_per_shard
    digests = stored if stored.views is None else stored.view(0)  # every view holds the same digests
    out = []
    for shard in shards:
        start, stop = shard * spp, min((shard + 1) * spp, n)
        got = np.concatenate([_digests(dataset, b0, min(b0 + _CHECK_BATCH, stop))
                              for b0 in range(start, stop, _CHECK_BATCH)])
        have = min(stop, len(stored))
        differ = np.ones(stop - start, dtype=bool)
        if have > start:
            differ[:have - start] = (digests.read_rows(DIGEST_FIELD, start, have) != got[:have - start]).any(axis=1)
        where = np.flatnonzero(differ)
        out.append(ShardCheck(shard, len(where), tuple(int(i) + start for i in where[:_SHOWN]), shard_digest(got)))
    return out


def _digests(dataset: MapDataset, b0: int, b1: int) -> np.ndarray:
    found = read_inputs(dataset, b0, b1, True).digests
    assert found is not None  # asked for
    return found


@dataclass(frozen=True)
class ContentCheck:
    """Every shard of the dataset given, checked against a stored version."""

    stored: StoredVersion
    shards: tuple[ShardCheck, ...]
    n: int  # items checked: the dataset's length
    seconds: float

    @property
    def changed(self) -> int:
        """Items that differ from the stored version's (or that it does not hold)."""
        return sum(s.changed for s in self.shards)

    @property
    def first_changed(self) -> tuple[int, ...]:
        return tuple(i for s in self.shards for i in s.first)[:_SHOWN]

    def unchanged(self) -> list[int]:
        """The shards that can be referenced in place: the same items over the same rows (none
        of a version with views, which references no other's shards yet)."""
        layout = self.stored.manifest.layout
        if self.stored.views is not None:
            return []
        mine = replace(layout, n_samples=self.n)
        return [s.index for s in self.shards if s.changed == 0 and s.index < layout.n_shards
                and layout.shard_range(s.index) == mine.shard_range(s.index)]

    @property
    def content(self) -> str:
        """The content digest of the dataset given, as a version cut like the stored one records it."""
        return content_digest(s.digest for s in self.shards)


@dataclass(frozen=True)
class ComputeReport:
    """What one ``store.compute`` call did (``version.report`` of the version it returned).

    Attributes:
        computed: whether Model A ran (False: a stored version was returned as it is).
        check: how the dataset given was compared with the stored version: ``"digests"`` (every
            item's input digest), ``"dataset_id"`` (``ComputeOptions(dataset_id=...)``: the caller
            vouches for it), ``"dataset fingerprint"`` (a ``datasets.Dataset``'s own content
            fingerprint, the one recorded), ``"sampled"`` (a version written before per-sample
            digests: 16 sampled items), or ``"none"`` (nothing stored to compare with).
        items_checked: items digested by the check (0 without one).
        items_changed: items whose digest differs from the stored one (None: not known).
        first_changed: the first of them (up to 10 indices).
        shards_computed: shards Model A computed; ``shards_reused``: shards referenced in place
            from ``reused_from`` (``name@id``) or an ``extends=`` parent.
        check_s: seconds the check took.
    """

    computed: bool
    check: str
    items_checked: int = 0
    items_changed: int | None = None
    first_changed: tuple[int, ...] = ()
    shards_computed: int = 0
    shards_reused: int = 0
    reused_from: str | None = None
    check_s: float = 0.0

    def to_json(self) -> JSONObject:
        """As the command line's ``--json`` prints it."""
        return {"computed": self.computed, "check": self.check, "items_checked": self.items_checked,
                "items_changed": self.items_changed, "first_changed": list(self.first_changed),
                "shards_computed": self.shards_computed, "shards_reused": self.shards_reused,
                "reused_from": self.reused_from, "check_s": self.check_s}

    def describe(self) -> str:
        """One line for the terminal."""
        if self.check == "digests":
            changed = f"{self.items_changed} of {self.items_checked} items changed"
            if self.first_changed:
                changed += f" (first: {', '.join(map(str, self.first_changed[:5]))})"
        else:
            changed = {"none": "nothing to compare with", "dataset_id": "dataset_id given: items not checked",
                       "dataset fingerprint": "the dataset's own fingerprint is the one recorded",
                       "sampled": "identified by 16 sampled items (a version written before per-sample digests)"
                       }.get(self.check, self.check)
        return (f"{changed}; {self.shards_computed} shards computed, {self.shards_reused} reused"
                + (f" from {self.reused_from}" if self.reused_from else ""))


def trusted(stored: StoredVersion, plan: ComputePlan) -> str | None:
    """Why ``stored`` (committed under the plan's id) is returned without reading the dataset
    (the report's ``check``), or None when its items must be checked."""
    if plan.options.dataset_id is not None:
        return "dataset_id"
    if DIGEST_FIELD not in stored.manifest.arrays or stored.views is not None:
        if DIGEST_FIELD not in stored.manifest.arrays:
            warnings.warn(FingerprintWarning(
                f"{stored.ref} was computed before featstore stored each sample's input digest: it is identified "
                "by its length and 16 sampled items, so an item edited elsewhere is not seen and the stored outputs "
                f"are returned. To check every item, delete it (featstore delete {stored.storage.url} {stored.ref}) "
                "and compute again."), stacklevel=4)
            return "sampled"
        return None
    fp = dataset_fingerprint(plan.request.dataset)
    if fp is not None and fp == stored.manifest.source_fingerprint:
        return "dataset fingerprint"
    return None


def donor_for(catalog: Catalog, plan: ComputePlan) -> StoredVersion | None:
    """The newest committed version of the plan's feature set that a new version can reuse
    shards of: the same Model A, outputs and fields, with input digests, laid out as the plan
    allows, and holding the same item at one of the sampled positions at least (else reading
    every item to compare would find nothing to reuse)."""
    if plan.growth is not None or plan.views is not None or not plan.digests or plan.request.views_of is not None:
        return None
    mine = {k: v for k, v in plan.parts.items() if k not in _DATA_PARTS}
    candidates = []
    for v in catalog.versions(plan.name):
        m = v.manifest
        if v.views is not None or DIGEST_FIELD not in m.arrays or m.schema_version < 2:
            continue
        if {k: x for k, x in m.fingerprint_parts.items() if k not in _DATA_PARTS} != mine:
            continue
        if plan.samples_per_shard not in (None, m.layout.samples_per_shard):
            continue
        if plan.options.spread_prefixes not in (None, m.layout.spread):
            continue
        candidates.append(v)
    for v in sorted(candidates, key=lambda v: v.manifest.created_at, reverse=True):
        if _shares_an_item(v, plan.request.dataset, plan.n):
            return v
    return None


def _shares_an_item(stored: StoredVersion, dataset: MapDataset, n: int) -> bool:
    """Whether one of the sampled positions of ``dataset`` holds the item ``stored`` holds there."""
    return any(stored.read_rows(DIGEST_FIELD, i, i + 1)[0].tobytes() == item_digest(read_item(dataset, i))
               for i in sample_positions(n) if i < len(stored))


#: ``run(stored, shard groups) -> their checks``: where a check's tasks run (a runner's ``check``).
CheckRunner = Callable[[StoredVersion, list[list[int]]], list[ShardCheck]]


def in_process(dataset: MapDataset, n: int, progress: bool) -> CheckRunner:
    """A :data:`CheckRunner` calling :func:`check_shards` here, one group after the other, with
    a progress bar over the items."""
    def run(stored: StoredVersion, groups: list[list[int]]) -> list[ShardCheck]:
        return collect_checks(stored, n, progress, (check_shards(stored, dataset, g, n) for g in groups))
    return run


def collect_checks(stored: StoredVersion, n: int, progress: bool,
                   results: Iterable[list[ShardCheck]]) -> list[ShardCheck]:
    """Every group's checks as ``results`` yields them (computed here, or Dask tasks as they
    finish), the progress bar over the items moved on by each group's shards."""
    bar = check_bar(n, stored.name) if progress else None
    out: list[ShardCheck] = []
    try:
        for got in results:
            out += got
            if bar is not None:
                bar.update(sum(checked_rows(stored, c.index, n) for c in got))
    finally:
        if bar is not None:
            bar.close()
    return out


def checked_rows(stored: StoredVersion, shard: int, n: int) -> int:
    """The items of shard ``shard`` of a dataset of ``n`` cut as ``stored`` cuts its shards."""
    spp = stored.manifest.layout.samples_per_shard
    return max(0, min((shard + 1) * spp, n) - shard * spp)


def check_bar(n: int, name: str) -> Any:
    """The check's progress bar over the ``n`` items (tqdm, to stderr)."""
    import sys

    from tqdm.auto import tqdm

    return tqdm(total=n, unit="item", unit_scale=True, desc=f"check {name}", file=sys.stderr, dynamic_ncols=True)


def cheap_here(dataset: MapDataset, n: int) -> bool:
    """Whether reading and digesting every item in this process is expected to take less than
    :data:`IN_PROCESS_S` (timed on the sampled positions): then no cluster is started for it."""
    at = sample_positions(n)
    t0 = time.perf_counter()
    for i in at:
        item_digest(read_item(dataset, i))
    return (time.perf_counter() - t0) / len(at) * n < IN_PROCESS_S


def check_content(stored: StoredVersion, n: int, run: CheckRunner, per_task: int) -> ContentCheck:
    """Check every shard of a dataset of ``n`` items against ``stored`` (cut as it cuts its
    shards), ``per_task`` shards per task, on ``run``."""
    t0 = time.perf_counter()
    spp = stored.manifest.layout.samples_per_shard
    shards = list(range(-(-n // spp)))
    groups = [shards[i:i + per_task] for i in range(0, len(shards), per_task)]
    got = sorted(run(stored, groups), key=lambda s: s.index)
    if [s.index for s in got] != shards:
        raise InvalidInput(f"the content check returned shards {[s.index for s in got][:10]}, not {shards[:10]}")
    return ContentCheck(stored, tuple(got), n, round(time.perf_counter() - t0, 3))


def reusing(plan: ComputePlan, check: ContentCheck, changed_content: bool) -> ComputePlan:
    """The plan of the version to compute after ``check``: referencing the checked version's
    unchanged shards; with ``changed_content`` (the checked version holds the plan's id, with
    other items), under a new id whose fingerprint adds the content digest of the items given."""
    parts = dict(plan.parts)
    if changed_content:
        dataset = parts["dataset"]
        parts["dataset"] = {**(dataset if isinstance(dataset, dict) else {}), "content": check.content}
    growth = reuse(check.stored, check.unchanged())
    return replace(plan, parts=parts, fingerprint=fingerprint(parts) if changed_content else plan.fingerprint,
                   growth=growth if growth.bases else None,
                   samples_per_shard=check.stored.manifest.layout.samples_per_shard)
