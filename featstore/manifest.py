"""Every object featstore stores besides array data, as validated, canonical JSON: pure.

The manifest (what a committed version holds; writing it create-if-absent is the commit),
shard receipts (resume markers), tags (the only mutable pointers) and the pending claim of a
version being computed. Nothing here is ever unpickled; unknown or newer schemas are refused
with :class:`IncompatibleFormat` saying what to do.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .codecs import codec_by_name
from .errors import FeatstoreError, IncompatibleFormat
from .names import check_field, check_name, check_version_id, is_version_id

SCHEMA = "featstore.manifest"
SCHEMA_VERSION = 1
RECEIPT_SCHEMA = "featstore.receipt"
TAG_SCHEMA = "featstore.tag"
PENDING_SCHEMA = "featstore.pending"
#: Version of the receipt, tag and pending objects (written by this featstore; read if not newer).
OBJECT_VERSION = 1
_HEX = frozenset("0123456789abcdef")


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes (sorted keys, no NaN): what fingerprints and stored objects use."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def load_json(data: bytes | str, where: str) -> dict[str, Any]:
    """Parse one stored JSON object (never a pickle); anything else is :class:`IncompatibleFormat`.

    >>> load_json(b'{"a": 1}', "x.json")
    {'a': 1}
    """
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:  # bad UTF-8/JSON, huge ints, deep nesting
        raise IncompatibleFormat(f"{where} is not valid JSON ({exc}); the object is damaged. "
                                 "Delete the version and recompute it.") from exc
    if not isinstance(obj, dict):
        raise IncompatibleFormat(f"{where} does not hold a JSON object; the object is damaged or not "
                                 "featstore's. Delete it (or its version) and recompute.")
    return obj


def check_schema(obj: Any, schema: str, newest: int, where: str, *, required: bool = True) -> None:
    """Refuse an object that is not a JSON object of ``schema`` at a version this code reads.

    ``required=False`` accepts an object without schema fields (receipts embedded in a
    manifest, which carries the schema for all of them).
    """
    if not isinstance(obj, dict):
        raise IncompatibleFormat(f"{where} is not a JSON object; the store is damaged or not a "
                                 "featstore store. Delete the object (or the version) and recompute.")
    if not required and "schema" not in obj and "schema_version" not in obj:
        return
    if obj.get("schema") != schema:
        raise IncompatibleFormat(f"{where} is not a {schema} object (schema={obj.get('schema')!r}); "
                                 "delete it, or point featstore at the right store.")
    version = obj.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise IncompatibleFormat(f"{where} has a malformed schema_version {version!r}; delete it and recompute.")
    if version > newest:
        raise IncompatibleFormat(
            f"{where} has schema_version {version}, newer than this featstore understands "
            f"({newest}); upgrade featstore (pip install -U featstore)."
        )


def _digest(value: Any) -> str:
    if not isinstance(value, str) or len(value) != 64 or not set(value) <= _HEX:
        raise ValueError(f"digest {value!r} is not 64 hex digits")
    return value


@dataclass(frozen=True)
class ArraySpec:
    """One stored array: its codec, stored dtype, per-sample shape, where it came from and its
    chunk compression (``"zstd"`` or ``"none"``; manifests before it existed are all zstd)."""

    codec: str
    dtype: str
    shape: tuple[int, ...]  # per sample; the stored array is (n_samples, *shape)
    source: str  # "output" (Model A), "keep" (a dataset field) or "seed" (a view's replay seeds)
    compression: str = "zstd"


@dataclass(frozen=True)
class ShardReceipt:
    """What a finished shard task reports: its rows and a digest of each array's stored bytes.

    ``view`` is the augmented view the shard belongs to (None in a version without views: the
    key is then left out of the JSON, so those receipts are unchanged)."""

    index: int
    start: int
    stop: int
    digests: dict[str, str]
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    view: int | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if self.view is None:
            del d["view"]
        return {**d, "schema": RECEIPT_SCHEMA, "schema_version": OBJECT_VERSION}

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "a shard receipt") -> "ShardReceipt":
        check_schema(obj, RECEIPT_SCHEMA, OBJECT_VERSION, where, required=False)
        try:
            r = cls(_int(obj["index"]), _int(obj["start"]), _int(obj["stop"]),
                    {_field(k): _digest(v) for k, v in obj["digests"].items()},
                    dict(obj.get("stats", {})), None if obj.get("view") is None else _int(obj["view"]))
        except (KeyError, TypeError, ValueError, AttributeError, FeatstoreError) as exc:
            raise IncompatibleFormat(f"{where} is malformed ({type(exc).__name__}: {exc}); delete "
                                     "it and rerun compute (the shard is recomputed).") from exc
        if not 0 <= r.start < r.stop or (r.view is not None and r.view < 0):
            raise IncompatibleFormat(f"{where} has an empty or negative row range [{r.start}, {r.stop}).")
        return r


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an integer")
    return value


def _field(name: Any) -> str:
    return check_field(name)


@dataclass(frozen=True)
class Layout:
    """How axis 0 is cut: ``samples_per_shard`` rows per Zarr shard, ``chunk_rows`` per chunk."""

    n_samples: int
    samples_per_shard: int
    chunk_rows: int

    @property
    def n_shards(self) -> int:
        return -(-self.n_samples // self.samples_per_shard)

    def shard_range(self, i: int) -> tuple[int, int]:
        start = i * self.samples_per_shard
        return start, min(start + self.samples_per_shard, self.n_samples)

    def shard_sizes(self) -> list[int]:
        return [b - a for a, b in map(self.shard_range, range(self.n_shards))]


@dataclass(frozen=True)
class ViewsSpec:
    """The augmented views of a version: ``count`` views per sample, view ``v`` of sample ``i``
    being ``augment(dataset[i], Generator().manual_seed(seed(i, v)))`` under the named seed
    ``policy`` (see :mod:`featstore.views`) with the version's ``seed``; ``augment`` is the
    augment's identity (a digest of its source), which the reader's join checks."""

    count: int
    seed: int
    policy: str
    augment: Any

    @classmethod
    def from_json(cls, obj: Any) -> "ViewsSpec":
        spec = cls(_int(obj["count"]), _int(obj["seed"]), str(obj["policy"]), obj["augment"])
        if spec.count < 1:
            raise ValueError(f"views count {spec.count} is not positive")
        return spec


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs to know about one committed version."""

    id: str
    name: str
    fingerprint: str
    fingerprint_parts: dict[str, Any]
    layout: Layout
    arrays: dict[str, ArraySpec]
    stats: dict[str, dict[str, Any]]
    shards: tuple[ShardReceipt, ...]
    created_at: str
    timings: dict[str, float]
    libraries: dict[str, str]
    views: ViewsSpec | None = None  # None: one un-augmented view (the key is then left out)

    @property
    def n_samples(self) -> int:
        return self.layout.n_samples

    def unit_order(self) -> list[tuple[int | None, int]]:
        """Every (view, shard) unit of the version, in manifest order (view None: no views)."""
        views: list[int | None] = [None] if self.views is None else list(range(self.views.count))
        return [(v, i) for v in views for i in range(self.layout.n_shards)]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if self.views is None:
            del d["views"]
        for r in d["shards"]:
            if r.get("view") is None:
                r.pop("view", None)
        d["schema"], d["schema_version"] = SCHEMA, SCHEMA_VERSION
        return d

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "manifest") -> "Manifest":
        """Parse and validate a manifest; anything unexpected is :class:`IncompatibleFormat`.

        Names and array names are checked like user input (they become store paths), codecs
        and dtypes must be ones this featstore knows, and the shards must tile the layout.
        """
        check_schema(obj, SCHEMA, SCHEMA_VERSION, where)
        try:
            layout = Layout(**{k: _int(obj["layout"][k]) for k in ("n_samples", "samples_per_shard", "chunk_rows")})
            arrays = {}
            for k, v in obj["arrays"].items():
                spec = ArraySpec(str(v["codec"]), str(v["dtype"]), tuple(_int(s) for s in v["shape"]),
                                 str(v["source"]), str(v.get("compression", "zstd")))
                if codec_by_name(spec.codec).stored != spec.dtype or spec.source not in ("output", "keep", "seed"):
                    raise ValueError(f"array {k!r}: codec {spec.codec!r} does not store {spec.dtype!r}")
                if spec.compression not in ("zstd", "none"):
                    raise ValueError(f"array {k!r}: unknown compression {spec.compression!r}")
                if any(d < 1 for d in spec.shape):
                    raise ValueError(f"array {k!r} has shape {spec.shape}")
                arrays[_field(k)] = spec
            m = cls(
                id=check_version_id(obj["id"]), name=check_name(obj["name"]),
                fingerprint=_digest(obj["fingerprint"]),
                fingerprint_parts=dict(obj["fingerprint_parts"]),
                layout=layout, arrays=arrays,
                stats={str(k): dict(v) for k, v in obj["stats"].items()},
                shards=tuple(ShardReceipt.from_json(s, f"{where}, shard {i}") for i, s in enumerate(obj["shards"])),
                created_at=str(obj["created_at"]), timings=dict(obj["timings"]),
                libraries={str(k): str(v) for k, v in obj["libraries"].items()},
                views=None if obj.get("views") is None else ViewsSpec.from_json(obj["views"]),
            )
        except IncompatibleFormat:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, FeatstoreError) as exc:
            raise IncompatibleFormat(f"{where} is malformed ({type(exc).__name__}: {exc}); the "
                                     "version cannot be read. Delete it and recompute.") from exc
        if min(layout.n_samples, layout.samples_per_shard, layout.chunk_rows) < 1 or not arrays:
            raise IncompatibleFormat(f"{where} has an empty layout or no arrays; delete it and recompute.")
        if not m.fingerprint.startswith(m.id):
            raise IncompatibleFormat(f"{where}: id {m.id} is not its fingerprint's prefix; delete it.")
        tiles = [(r.view, r.index, r.start, r.stop) for r in m.shards]
        if tiles != [(v, i, *layout.shard_range(i)) for v, i in m.unit_order()] or any(
                set(r.digests) != set(arrays) for r in m.shards):
            raise IncompatibleFormat(f"{where}: its shards do not tile the layout or miss arrays; "
                                     "the manifest is damaged. Delete the version and recompute.")
        return m


def tag_json(vid: str) -> dict[str, Any]:
    """The stored object of a tag pointing at version ``vid``."""
    return {"schema": TAG_SCHEMA, "schema_version": OBJECT_VERSION, "version": check_version_id(vid)}


def tag_target(obj: Any, where: str, tag: str) -> str:
    """The version id a stored tag object points at, validated."""
    check_schema(obj, TAG_SCHEMA, OBJECT_VERSION, where)
    vid = obj.get("version")
    if not isinstance(vid, str) or not is_version_id(vid):
        raise IncompatibleFormat(f"{where} does not point at a version id ({vid!r}); the tag is "
                                 f"damaged: move it with store.tag(version, {tag!r}) or remove it.")
    return vid


@dataclass(frozen=True)
class Pending:
    """The claim of a version folder being computed: the layout and arrays its first run fixed.

    Later runs of the same fingerprint (a resume, or a concurrent run) adopt them. Claims
    written before the schema existed (no ``schema`` field) are read as version 1.
    """

    layout: Layout
    arrays: dict[str, dict[str, Any]]  # ArraySpec fields as JSON (lists, not tuples)

    @classmethod
    def of(cls, layout: Layout, arrays: dict[str, ArraySpec]) -> "Pending":
        """The claim a run makes for ``layout`` and ``arrays``."""
        return cls(layout, json.loads(json.dumps({n: asdict(a) for n, a in arrays.items()})))

    def to_json(self) -> dict[str, Any]:
        return {"schema": PENDING_SCHEMA, "schema_version": OBJECT_VERSION,
                "layout": asdict(self.layout), "arrays": self.arrays}

    @classmethod
    def from_json(cls, obj: Any, where: str) -> "Pending":
        check_schema(obj, PENDING_SCHEMA, OBJECT_VERSION, where, required=False)
        try:
            layout = Layout(**{k: int(obj["layout"][k]) for k in ("n_samples", "samples_per_shard", "chunk_rows")})
            arrays = {str(k): dict(v) for k, v in obj["arrays"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise IncompatibleFormat(f"{where} is malformed ({type(exc).__name__}: {exc}); delete the "
                                     "uncommitted version folder and rerun.") from exc
        return cls(layout, arrays)
