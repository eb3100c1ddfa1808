"""The manifest: what a committed version holds, as validated, canonical JSON.

Writing a version's manifest (create-if-absent) is its commit: a version without one is
invisible to readers. Nothing here is ever unpickled; unknown or newer schemas are refused.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import FeatstoreError, IncompatibleFormat

SCHEMA = "featstore.manifest"
SCHEMA_VERSION = 1
RECEIPT_SCHEMA = "featstore.receipt"
TAG_SCHEMA = "featstore.tag"
#: Version of the receipt and tag objects (written by this featstore; read if not newer).
OBJECT_VERSION = 1
_HEX = frozenset("0123456789abcdef")


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
    source: str  # "output" (Model A) or "keep" (a dataset field)
    compression: str = "zstd"


@dataclass(frozen=True)
class ShardReceipt:
    """What a finished shard task reports: its rows and a digest of each array's stored bytes."""

    index: int
    start: int
    stop: int
    digests: dict[str, str]
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "schema": RECEIPT_SCHEMA, "schema_version": OBJECT_VERSION}

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "a shard receipt") -> "ShardReceipt":
        check_schema(obj, RECEIPT_SCHEMA, OBJECT_VERSION, where, required=False)
        try:
            r = cls(_int(obj["index"]), _int(obj["start"]), _int(obj["stop"]),
                    {_field(k): _digest(v) for k, v in obj["digests"].items()},
                    dict(obj.get("stats", {})))
        except (KeyError, TypeError, ValueError, AttributeError, FeatstoreError) as exc:
            raise IncompatibleFormat(f"{where} is malformed ({type(exc).__name__}: {exc}); delete "
                                     "it and rerun compute (the shard is recomputed).") from exc
        if not 0 <= r.start < r.stop:
            raise IncompatibleFormat(f"{where} has an empty or negative row range [{r.start}, {r.stop}).")
        return r


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an integer")
    return value


def _field(name: Any) -> str:
    from .names import check_field  # names imports only errors: no cycle

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

    @property
    def n_samples(self) -> int:
        return self.layout.n_samples

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema"], d["schema_version"] = SCHEMA, SCHEMA_VERSION
        return d

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "manifest") -> "Manifest":
        """Parse and validate a manifest; anything unexpected is :class:`IncompatibleFormat`.

        Names and array names are checked like user input (they become store paths), codecs
        and dtypes must be ones this featstore knows, and the shards must tile the layout.
        """
        from .codecs import codec_by_name
        from .names import check_name, check_version_id

        check_schema(obj, SCHEMA, SCHEMA_VERSION, where)
        try:
            layout = Layout(**{k: _int(obj["layout"][k]) for k in ("n_samples", "samples_per_shard", "chunk_rows")})
            arrays = {}
            for k, v in obj["arrays"].items():
                spec = ArraySpec(str(v["codec"]), str(v["dtype"]), tuple(_int(s) for s in v["shape"]),
                                 str(v["source"]), str(v.get("compression", "zstd")))
                if codec_by_name(spec.codec).stored != spec.dtype or spec.source not in ("output", "keep"):
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
        tiles = [(r.index, r.start, r.stop) for r in m.shards]
        if tiles != [(i, *layout.shard_range(i)) for i in range(layout.n_shards)] or any(
                set(r.digests) != set(arrays) for r in m.shards):
            raise IncompatibleFormat(f"{where}: its shards do not tile the layout or miss arrays; "
                                     "the manifest is damaged. Delete the version and recompute.")
        return m
