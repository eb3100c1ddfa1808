"""A reader's streams: what it reads, typed and checked once when the reader is made.

A :class:`Stream` is one version, or several teachers' aligned versions read on the same rows
(``{label: version}``: their arrays come as ``"<label>/<array>"``), with at most one weight
(Mosaic's ``proportion``, ``repeat`` or ``choose``), the dataset to join to its rows
(:class:`Join`), and where its rows come from (:class:`RowsFrom`: the stored version, through
the node's caches as the reader's options say, or computed by Model A in the consuming process:
:mod:`featstore.online`). A reader is a tuple of them (:func:`resolve`): one for a version, several
for a mixture. Every stream of a reader has the same arrays (names, codecs, dtypes, per-sample
shapes and codec parameters, the tokenizer among them), so a batch mixes rows of any of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from featstore._allowed_names import check_field
from featstore._json import JSON
from featstore.codecs import expand_fields
from featstore.errors import InvalidInput
from featstore.format import SERVED_SOURCES, ArraySpec
from featstore.read._options import Join
from featstore.read.shards import ProcessReads, ShardSource
from featstore.read.state import Member as MemberIdentity
from featstore.read.state import StreamIdentity
from featstore.versions import HasStoredVersion, StoredVersion, check_aligned, stored

#: A version as a reader takes it: the user's :class:`featstore.Version`, or the stored one.
Versionish = StoredVersion | HasStoredVersion
#: A stream's versions: one, or several teachers' (by label; a list: labels ``t0``, ``t1``, ...).
Versions = Versionish | Mapping[str, Versionish] | Sequence[Versionish]
#: The arrays to read: names for every version, or per teacher label (a label left out reads all).
Fields = Sequence[str] | Mapping[str, Sequence[str]] | None


class RowsFrom(ABC):
    """Where a stream's rows come from in each process: sources made from that process's reads
    of the stored version (:class:`~featstore.read.shards.ProcessReads`). Picklable: DataLoader
    workers make their own."""

    @abstractmethod
    def sources(self, reads: ProcessReads) -> list[ShardSource]:
        """This process's sources of ``reads``' arrays."""

    @property
    def online(self) -> bool:
        """Whether Model A computes the rows (then a resumed epoch under another split computes
        but does not store them)."""
        return False

    def committed(self, storage_reads: ProcessReads) -> Versionish | None:
        """The version the rows were filled into, once committed (None: not a fill, or not yet)."""
        return None


class Stored(RowsFrom):
    """The stored version's rows (mapped in place, through the node's caches or decoded)."""

    def sources(self, reads: ProcessReads) -> list[ShardSource]:
        return reads.sources


STORED = Stored()


@dataclass(frozen=True)
class Stream:
    """One stream of a reader (see the module docstring): ``version`` (or ``{label: version}``
    for several teachers on the same rows), at most one weight: ``proportion`` (relative, all
    streams or none, with ``epoch_size``), ``repeat`` (times its size per epoch) or ``choose``
    (samples per epoch), none: its size; ``join``: the dataset to join to its rows; ``rows``:
    where they come from (the stored version unless :mod:`featstore.online` says otherwise).

    >>> ds = featstore.mix([featstore.Stream(web, repeat=2), featstore.Stream(code, choose=10_000)])
    """

    version: Versions
    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None
    join: Join | None = None
    rows: RowsFrom = STORED


@dataclass(frozen=True)
class Member:
    """One version of a resolved stream: its label (None for a stream of one version: arrays
    unprefixed), the version (stored, and as it was given) and the arrays read of it."""

    label: str | None
    version: StoredVersion
    given: Versionish
    fields: tuple[str, ...]

    def key(self, field: str) -> str:
        """The field's name in a batch."""
        return field if self.label is None else f"{self.label}/{field}"


@dataclass(frozen=True)
class ReadStream:
    """A stream as the reader reads it: its members, weight, join and rows, checked."""

    members: tuple[Member, ...]
    proportion: float | None
    repeat: float | None
    choose: int | None
    join: Join | None
    rows: RowsFrom

    @property
    def first(self) -> StoredVersion:
        """The version whose plan, views and rows' index the stream reads (all members align)."""
        return self.members[0].version

    def identity(self) -> StreamIdentity:
        """What a state names the stream by."""
        return StreamIdentity(tuple(MemberIdentity(m.label, m.version.id, m.version.name) for m in self.members),
                              self.proportion, self.repeat, self.choose)


def members(version: Versions) -> list[tuple[str | None, Versionish]]:
    """``[(label, version)]``: one unlabelled version, a mapping's (label checked: a letter, then
    letters, digits or ``_``) or a list's (``t0``, ``t1``, ...)."""
    if isinstance(version, StoredVersion) or hasattr(type(version), "__featstore_version__"):
        return [(None, version)]  # type: ignore[list-item]  # a Versionish, by its protocol
    if isinstance(version, Mapping):
        out: list[tuple[str | None, Versionish]] = [(check_field(label), v) for label, v in version.items()]
    elif isinstance(version, Sequence) and not isinstance(version, str):
        out = [(f"t{i}", v) for i, v in enumerate(version)]
    else:
        raise InvalidInput(f"a stream reads a featstore Version (store.open(ref)), or several teachers' as a dict "
                           f"{{label: version}} or a list; got {type(version).__name__}.")
    if not out:
        raise InvalidInput("give at least one teacher: store.dataset({'a': ref_a, 'b': ref_b}).")
    return out


def resolve(given: Sequence[Stream], fields: Fields) -> tuple[ReadStream, ...]:
    """The reader's streams, checked: each stream's teachers aligned, each version read once,
    and the arrays every stream reads the same (:class:`InvalidInput`, or
    :class:`~featstore.VersionsMisaligned` for teachers not on the same rows)."""
    if not given:
        raise InvalidInput("a reader needs at least one stream: featstore.mix([(version, weight), ...]).")
    out = []
    for s in given:
        labelled = [(label, v, stored(v)) for label, v in members(s.version)]
        if len(labelled) > 1 or labelled[0][0] is not None:
            check_aligned({str(label): v for label, _, v in labelled})
        out.append(ReadStream(tuple(Member(label, v, g, _fields(v, label, fields, len(given) > 1))
                                    for label, g, v in labelled), s.proportion, s.repeat, s.choose, s.join, s.rows))
    streams = tuple(out)
    if isinstance(fields, Mapping):
        labels = [m.label for s in streams for m in s.members]
        unknown = sorted(set(fields) - set(map(str, labels)))
        if unknown:
            raise InvalidInput(f"fields names teachers {unknown}; the teachers are {sorted(set(map(str, labels)))}.")
    _check_once(streams)
    if len(streams) > 1:
        _check_compatible(streams, fields is not None)
    return streams


def _fields(version: StoredVersion, label: str | None, fields: Fields, mixed: bool) -> tuple[str, ...]:
    """The arrays read of ``version``: the given ones (a per-label mapping's entry), or all it
    serves (A's outputs and the kept fields: not featstore's own, the input digests, the views'
    replay seeds and the per-token bookkeeping); an output stored in parts is read whole."""
    arrays = version.manifest.arrays
    wanted: Sequence[str] | None
    if isinstance(fields, Mapping):
        if label is None and fields:
            raise InvalidInput("fields per teacher ({label: [arrays]}) are for several teachers; name the "
                               "arrays as a list for one version.")
        wanted = fields.get(label or "")
    else:
        wanted = fields
    if isinstance(wanted, str):
        wanted = (wanted,)
    chosen = expand_fields(arrays, tuple(wanted) if wanted is not None else tuple(
        f for f, a in arrays.items() if a.source in SERVED_SOURCES))
    missing = sorted(set(chosen) - set(arrays))
    if missing:
        raise InvalidInput(f"version {version.ref} has no arrays {missing}; it has {sorted(arrays)}.")
    return chosen


def _check_once(streams: tuple[ReadStream, ...]) -> None:
    """A version may be one stream of a reader, not several: it is read without replacement
    until exhausted, which two streams over it would break (Mosaic refuses a reused stream too)."""
    seen: dict[StoredVersion, int] = {}
    for i, s in enumerate(streams):
        for m in s.members:
            if m.version in seen and seen[m.version] != i:
                raise InvalidInput(
                    f"{m.version.ref} is streams {seen[m.version]} and {i} of this mixture: each version is read "
                    "without replacement until exhausted, which two streams over it would break. Give it once, "
                    "with the weight the two add up to (repeat=2, or the proportions summed).")
            seen[m.version] = i


def _check_compatible(streams: tuple[ReadStream, ...], given: bool) -> None:
    """Every stream has the same teachers' labels, and each reads the same arrays of them with
    the same codec, dtype, per-sample shape and codec parameters (the tokenizer among them)."""
    first = streams[0]
    labels = [m.label for m in first.members]
    for s in streams[1:]:
        if [m.label for m in s.members] != labels:
            raise InvalidInput(f"the streams' teachers differ ({labels} and {[m.label for m in s.members]}): "
                               "every stream of a mixture reads the same teachers, by the same labels.")
    differ = []
    for s in streams[1:]:
        for a, b in zip(first.members, s.members, strict=True):
            specs_a, specs_b = a.version.manifest.arrays, b.version.manifest.arrays
            for f in sorted(set(a.fields) | set(b.fields)):
                if f not in a.fields or f not in b.fields:
                    missing = a.version.ref if f not in a.fields else b.version.ref
                    differ.append(f"{f!r} is missing from {missing}")
                    continue
                differ += [f"{a.key(f)!r} {what} {getattr(specs_a[f], what)!r} in {a.version.ref}, "
                           f"{getattr(specs_b[f], what)!r} in {b.version.ref}"
                           for what in _disagree(specs_a[f], specs_b[f])]
    differ += _tokenizers_differ(streams)
    if differ:
        versions = [s.members[0].version for s in streams]
        shared = sorted(f for f in first.members[0].fields if all(
            f in v.manifest.arrays and not _disagree(versions[0].manifest.arrays[f], v.manifest.arrays[f])
            for v in versions[1:]))
        hint = "" if given else f" Pass fields=[...] naming arrays they share that agree (these do: {shared})."
        raise InvalidInput(f"the streams' arrays differ: {'; '.join(differ)}.{hint}")


def _tokenizers_differ(streams: tuple[ReadStream, ...]) -> list[str]:
    """Per-token arrays mix only over one tokenizer (an id is another token under another): each
    teacher's recorded vocabulary (name, size, digest, special tokens) the same in every stream."""
    differ = []
    for i, first in enumerate(streams[0].members):
        if not any(first.version.manifest.arrays[f].ragged for f in first.fields):
            continue
        want = _vocabulary(first.version)
        for s in streams[1:]:
            other = s.members[i].version
            got = _vocabulary(other)
            if got != want:
                what = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
                differ.append(f"the tokenizers differ ({', '.join(what)}: {first.version.ref} has "
                              f"{[want.get(k) for k in what]}, {other.ref} {[got.get(k) for k in what]}); per-token "
                              "outputs mix only when computed with the same tokenizer")
    return differ


def _vocabulary(version: StoredVersion) -> dict[str, JSON]:
    """The tokenizer's identity a per-token version recorded (flattened: special tokens by role)."""
    tokens = version.manifest.fingerprint_parts.get("tokens")
    vocabulary = tokens.get("vocabulary") if isinstance(tokens, dict) else None
    if not isinstance(vocabulary, dict):
        return {}
    special = vocabulary.get("special")
    flat = {k: v for k, v in vocabulary.items() if k != "special"}
    return flat | ({str(k): v for k, v in special.items()} if isinstance(special, dict) else {})


def _disagree(a: ArraySpec, b: ArraySpec) -> list[str]:
    """What of two versions' specs of one array differs (the codec, dtype, shape, params)."""
    return [what for what in ("codec", "dtype", "shape", "params") if getattr(a, what) != getattr(b, what)]
