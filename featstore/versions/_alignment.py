"""Whether versions hold outputs for the same rows: same samples, same views (pure).

Two teachers can be read on the same rows, or a second teacher computed on a first one's views
(``store.compute(..., views_of="teacher-a/train@<id>")``), only when both versions were computed on

- the same dataset: the same length, and the same sampled content digest (or, where either
  was computed with ``ComputeOptions(dataset_id=...)`` and no digest could be taken, the same
  ``dataset_id``); the digest samples items first to last, so it also sees the order;
- the same views: none for both, or the same count K, the same ``augment_seed``, the same seed
  policy and the same ``augment`` (by its source digest). View ``v`` of sample ``i`` is then the
  same augmented input in both versions (:mod:`featstore.versions._views`).

:class:`Alignment` is that identity, read from a manifest (:meth:`Alignment.of`) or from a
compute request (:meth:`Alignment.of_parts`); :func:`differences` names what two of them do
not share. :class:`~featstore.VersionsMisaligned` carries those names in ``differs``.

A version computed with ``views_of=`` records the link as the ``views_of`` entry of its
fingerprint parts (``{"name": ..., "id": ...}``), so it is part of the fingerprint and stored
in the manifest; :func:`views_of` reads it back.

>>> Alignment(80, "ab12", None, None, None, None, None).differs(Alignment(81, "ab12", None, None, None, None, None))
['dataset length (80 vs 81)']
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from featstore._json import JSON, JSONObject
from featstore.errors import InvalidInput, VersionsMisaligned
from featstore.format import Manifest, ViewsSpec
from featstore.versions._committed import StoredVersion
from featstore.versions._views import Augment

#: The fingerprint parts' key of the link to the version whose views a compute reused.
LINK = "views_of"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 20 else text[:17] + "...'"


@dataclass(frozen=True)
class Alignment:
    """What a version's rows are: the dataset's length and identity, and its views."""

    length: int
    digest: str | None  # the sampled content digest (None: not digestible, named by an id)
    dataset_id: str | None
    views: int | None  # K, or None without views
    seed: int | None
    policy: str | None
    augment: JSON  # the augment's identity (ViewsSpec.augment)

    @classmethod
    def of_parts(cls, dataset: JSON, sample: str | None, views: ViewsSpec | None) -> "Alignment":
        """From a fingerprint's ``dataset`` part, the sampled digest and the views spec."""
        part = dataset if isinstance(dataset, dict) else {}
        digest, length, dataset_id = part.get("digest"), part.get("length", -1), part.get("id")
        digest = digest if isinstance(digest, str) and digest else sample
        length = length if isinstance(length, int) else -1
        dataset_id = dataset_id if isinstance(dataset_id, str) else None
        if views is None:
            return cls(length, digest, dataset_id, None, None, None, None)
        return cls(length, digest, dataset_id, views.count, views.seed, views.policy, views.augment)

    @classmethod
    def of(cls, manifest: Manifest) -> "Alignment":
        """A committed version's alignment, from its manifest."""
        return cls.of_parts(manifest.fingerprint_parts.get("dataset", {}), manifest.dataset_sample, manifest.views)

    def differs(self, other: "Alignment") -> list[str]:
        """What ``other`` does not share with this one, named for a message (empty: aligned)."""
        out = []
        if self.length != other.length:
            out.append(f"dataset length ({self.length} vs {other.length})")
        if self.digest is not None and other.digest is not None:
            if self.digest != other.digest:
                out.append(f"dataset content (sampled digest {self.digest[:12]} vs {other.digest[:12]})")
        elif self.dataset_id is not None and other.dataset_id is not None:
            if self.dataset_id != other.dataset_id:
                out.append(f"dataset_id ({_short(self.dataset_id)} vs {_short(other.dataset_id)})")
        else:
            out.append("dataset identity (one is named only by a dataset_id, the other has no such id: "
                       "they cannot be compared)")
        return out + self._views_differ(other)

    def _views_differ(self, other: "Alignment") -> list[str]:
        if (self.views is None) != (other.views is None):
            return [f"views ({_count(self.views)} vs {_count(other.views)})"]
        if self.views is None:
            return []
        pairs = (("view count", self.views, other.views), ("view seed (augment_seed)", self.seed, other.seed),
                 ("view seed policy", self.policy, other.policy))
        out = [f"{what} ({a} vs {b})" for what, a, b in pairs if a != b]
        if self.augment != other.augment:
            out.append("augment (a different function: its source differs)")
        return out


def _count(views: int | None) -> str:
    return "none" if views is None else f"K={views}"


# -- a compute on another version's views --------------------------------------------------------
def adopt_views(base: StoredVersion, views: int | None, augment: Augment | None,
                augment_seed: int | None) -> tuple[int | None, int]:
    """The ``views`` and ``augment_seed`` of a compute with ``views_of=base``: the base's, and
    those given must agree (:class:`VersionsMisaligned` naming what differs). With views,
    ``augment`` must be given (a function cannot be read back from a store); whether it is the
    base's is checked by :func:`check_views_of` with the rest."""
    spec = base.manifest.views
    if spec is None:
        if views is not None or augment is not None:
            raise VersionsMisaligned(
                f"views_of={base.ref!r} has no views (its samples as they are, one view each): leave views= and "
                "augment= out to compute on the same samples, or name a version with views.", ("views",))
        if augment_seed not in (None, 0):
            raise InvalidInput("augment_seed= needs views; views_of names a version without views.")
        return None, 0
    differs = []
    if views is not None and views != spec.count:
        differs.append(f"view count ({views} given, {spec.count} in {base.ref})")
    if augment_seed is not None and augment_seed != spec.seed:
        differs.append(f"view seed (augment_seed={augment_seed} given, {spec.seed} in {base.ref})")
    if differs:
        raise VersionsMisaligned(f"views_of={base.ref!r}: {'; '.join(differs)}. Leave views= and augment_seed= out: "
                                 "they are taken from that version.", tuple(d.split(" (")[0] for d in differs))
    if augment is None:
        raise InvalidInput(f"views_of={base.ref!r} has {spec.count} augmented views: pass augment= (the function "
                           "it was computed with), so Model A runs on the same views.")
    return spec.count, spec.seed


def check_views_of(base: StoredVersion, new: Alignment) -> None:
    """Raise :class:`VersionsMisaligned` unless a compute whose rows are ``new`` runs on exactly
    ``base``'s samples and views."""
    differs = Alignment.of(base.manifest).differs(new)
    if differs:
        raise VersionsMisaligned(
            f"views_of={base.ref!r}: {'; '.join(differs)} (that version's vs this compute's) differ, so Model A "
            "would not see the same inputs. Pass the dataset and the augment that version was computed with "
            "(same items, same order), or compute without views_of.", tuple(d.split(" (")[0] for d in differs))


def link(base: StoredVersion) -> JSONObject:
    """The fingerprint parts' entry naming the version whose views a compute reused."""
    return {"name": base.name, "id": base.id}


def views_of(version: StoredVersion) -> str | None:
    """``"name@id"`` of the version whose views ``version`` was computed on (None: no link).

    >>> views_of(store.open("teacher-b/train"))
    'teacher-a/train@3f2a9c0e1b7d4a55'
    """
    got = version.manifest.fingerprint_parts.get(LINK)
    return None if not isinstance(got, Mapping) else f"{got['name']}@{got['id']}"


# -- several versions read on the same rows ------------------------------------------------------
def check_aligned(versions: Mapping[str, StoredVersion]) -> None:
    """Raise :class:`VersionsMisaligned` unless every version holds outputs for the same rows as
    the first, laid out in the same shards (the reader's one plan walks the shards of all of them).

    >>> check_aligned({"a": store.open("teacher-a/train"), "b": store.open("teacher-b/train")})
    """
    (label0, first), *others = versions.items()
    want = Alignment.of(first.manifest)
    for label, other in others:
        differs = want.differs(Alignment.of(other.manifest))
        a, b = first.manifest.layout.samples_per_shard, other.manifest.layout.samples_per_shard
        if a != b:
            differs.append(f"samples per shard ({a} vs {b})")
        if differs:
            raise VersionsMisaligned(
                f"teachers {label0!r} ({first.ref}) and {label!r} ({other.ref}) are not on the same rows: "
                f"{'; '.join(differs)} differ. Compute {label!r} with views_of={first.ref!r} (same dataset, "
                "same augment: it then runs on exactly those views, in the same shards).",
                tuple(d.split(" (")[0] for d in differs))
