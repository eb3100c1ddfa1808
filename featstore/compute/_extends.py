"""Growing a version: compute only the new samples of a dataset that extends a parent's.

A child version keeps the parent's layout (rows per shard, chunk rows, codecs, compression)
and references the parent's *full* shards in place (:class:`~featstore.format.Base`
entries in its manifest); it computes the parent's last, partial shard again and every shard
after it. Its shard records cover every shard (the parent's digests and statistics copied:
metadata only), so verify, stats and a later child work across the boundary. The parent's
data outlives a ``delete`` of the parent while a child references it (see
:meth:`featstore.versions.Catalog.delete`). Writer side: builds on versions, never on the reader.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from featstore._json import JSONObject
from featstore._user_types import Item, MapDataset
from featstore.errors import DatasetMismatch, IncompatibleFormat, InvalidInput
from featstore.versions import sampled_digest
from featstore.format import ArraySpec, ArrayStats, Base, Layout, ShardReceipt
from featstore.codecs import NONFINITE_KEPT, summarize
from featstore.versions import StoredVersion

#: Fingerprint parts a child must share with its parent (all but the dataset's identity).
#: Fingerprint parts a child must share with its parent (``collate`` and ``tokens`` only where
#: set: a version without them has neither, so older parents still match).
_SHARED_PARTS = ("model", "input_key", "keep", "outputs", "codecs", "autocast", "collate", "tokens")


class DatasetPrefix:
    """The first ``n`` items of a dataset (what the parent was computed over)."""

    def __init__(self, dataset: MapDataset, n: int) -> None:
        self.dataset, self.n = dataset, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Item:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.dataset[i]


@dataclass(frozen=True)
class Growth:
    """How a version reuses another's shards: which it references in place (``bases``, where
    they are stored) and, by elimination, which it computes. The other version is an
    ``extends=`` parent (the child references its full shards), or the version a rerun found
    with some changed items (the new version references every shard whose inputs are unchanged).
    """

    parent: StoredVersion  # the version whose shards are reused
    layout: Layout  # the parent's: the new version's rows per shard and chunk rows
    bases: tuple[Base, ...]

    @property
    def reused(self) -> frozenset[int]:
        """The shards referenced in place."""
        return frozenset(i for b in self.bases for i in range(b.first, b.stop))

    def inherited_receipts(self) -> list[ShardReceipt]:
        """Digests and statistics of the referenced shards, from the parent's records."""
        reused = self.reused
        return [r for r in self.parent.shard_receipts() if r.index in reused]

    def adopt_arrays(self, arrays: Mapping[str, ArraySpec]) -> dict[str, ArraySpec]:
        """The parent's array specs (its compression too), if the child's match them."""
        # the token layout of per-token arrays follows from the shared layout and the shared
        # ``tokens`` fingerprint part (checked in plan_growth); it is not known yet here. A
        # parent stored without input digests makes a version without them (decide() knows).
        mine = {n: replace(a, compression="", tokens=()) for n, a in arrays.items() if a.source != "digest"}
        theirs = {n: replace(a, compression="", tokens=()) for n, a in self.parent.manifest.arrays.items()
                  if a.source != "digest"}
        if mine != theirs:
            raise DatasetMismatch(
                f"the outputs differ from those of {self.parent.ref} ({_describe(mine)} vs "
                f"{_describe(theirs)}); extend only a version computed with the same model and outputs.")
        return dict(self.parent.manifest.arrays)

    def summarize(self, inherited: Sequence[ShardReceipt], own: Sequence[ShardReceipt],
                  arrays: Iterable[str]) -> dict[str, ArrayStats]:
        """The child's statistics: the referenced shards' (from the records) and its own."""
        out = summarize((r.stats for r in [*inherited, *own]), list(arrays))
        reused, spp = self.reused, self.layout.samples_per_shard
        for name, s in out.items():
            before = [i for i in self.parent.manifest.stats.get(name, {}).get("nonfinite_samples", [])
                      if i // spp in reused]
            if before or "nonfinite_samples" in s:
                s["nonfinite_samples"] = sorted({*before, *s.get("nonfinite_samples", [])})[:NONFINITE_KEPT]
        return out


def _describe(arrays: Mapping[str, ArraySpec]) -> str:
    return ", ".join(f"{n}: {a.codec} {a.dtype}{list(a.shape)}" for n, a in sorted(arrays.items()))


def plan_growth(parent: StoredVersion, dataset: MapDataset, parts: JSONObject, n: int) -> Growth:
    """Check that ``dataset`` extends ``parent`` and plan the child (a typed error otherwise).

    The child must share the parent's model, fields, outputs and codecs (its fingerprint
    parts other than the dataset), be longer, and hold the parent's samples first: the
    sampled content digest of its first ``len(parent)`` items must equal the parent's.
    """
    m = parent.manifest
    if m.schema_version < 2:
        raise IncompatibleFormat(f"{parent.ref} was written before incremental versions existed "
                                 "(manifest schema 1); compute the grown dataset without extends.")
    differ = [k for k in _SHARED_PARTS if m.fingerprint_parts.get(k) != parts.get(k)]
    if differ:
        raise DatasetMismatch(f"{parent.ref} was computed with other {differ}; extends needs the same "
                              "model, input_key, keep, outputs, compression, autocast, collate and tokens.")
    if n <= len(parent):
        raise InvalidInput(f"the dataset has {n} samples, {parent.ref} already has {len(parent)}: nothing "
                           f"to add. Open {parent.ref} instead.")
    if m.dataset_sample is None:
        raise DatasetMismatch(f"{parent.ref} has no sampled content digest (its items could not be "
                              "digested), so the shared range cannot be checked; compute without extends.")
    try:
        got = sampled_digest(DatasetPrefix(dataset, len(parent)))
    except InvalidInput as exc:
        raise DatasetMismatch(f"the dataset's items cannot be digested to check the range shared with "
                              f"{parent.ref}: {exc}") from exc
    if got != m.dataset_sample:
        raise DatasetMismatch(
            f"the first {len(parent)} samples of the dataset are not those {parent.ref} was computed on "
            "(their sampled content digest differs); extends needs the parent's samples first, in "
            "the same order. Append new samples at the end, or compute without extends.")
    return _growth(parent)


def _growth(parent: StoredVersion) -> Growth:
    """A child of ``parent`` references its full shards (its last one may be partial)."""
    return reuse(parent, range(len(parent) // parent.manifest.layout.samples_per_shard))


def reuse(parent: StoredVersion, shards: Iterable[int]) -> Growth:
    """A version that references ``shards`` of ``parent`` where they are stored: in the
    parent's folder, or in the folder of the parent's own base that holds them."""
    homes: dict[int, tuple[str, str, int]] = {}
    for b in parent.manifest.bases:
        homes.update((i, (b.name, b.id, b.n_samples)) for i in range(b.first, b.stop))
    bases: list[Base] = []
    for i in sorted(set(shards)):
        name, vid, n = homes.get(i, (parent.name, parent.id, len(parent)))
        last = bases[-1] if bases else None
        if last is not None and last.stop == i and (last.name, last.id) == (name, vid):
            bases[-1] = replace(last, stop=i + 1)
        else:
            bases.append(Base(name, vid, i, i + 1, n))
    return Growth(parent, parent.manifest.layout, tuple(bases))
