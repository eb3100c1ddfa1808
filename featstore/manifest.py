"""The manifest: what a committed version holds, as validated, canonical JSON.

Writing a version's manifest (create-if-absent) is its commit: a version without one is
invisible to readers. Nothing here is ever unpickled; unknown or newer schemas are refused.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import IncompatibleFormat

SCHEMA = "featstore.manifest"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class ArraySpec:
    """One stored array: its codec, stored dtype, per-sample shape and where it came from."""

    codec: str
    dtype: str
    shape: tuple[int, ...]  # per sample; the stored array is (n_samples, *shape)
    source: str  # "output" (Model A) or "keep" (a dataset field)


@dataclass(frozen=True)
class ShardReceipt:
    """What a finished shard task reports: its rows and a digest of each array's stored bytes."""

    index: int
    start: int
    stop: int
    digests: dict[str, str]
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "ShardReceipt":
        try:
            return cls(int(obj["index"]), int(obj["start"]), int(obj["stop"]),
                       {str(k): str(v) for k, v in obj["digests"].items()},
                       dict(obj.get("stats", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise IncompatibleFormat(f"malformed shard receipt: {exc}") from exc


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
        if obj.get("schema") != SCHEMA:
            raise IncompatibleFormat(f"{where} is not a featstore manifest (schema={obj.get('schema')!r}).")
        version = obj.get("schema_version")
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise IncompatibleFormat(
                f"{where} has schema_version {version!r}, newer than this featstore understands "
                f"({SCHEMA_VERSION}); upgrade featstore (pip install -U featstore)."
            )
        try:
            return cls(
                id=str(obj["id"]), name=str(obj["name"]), fingerprint=str(obj["fingerprint"]),
                fingerprint_parts=dict(obj["fingerprint_parts"]),
                layout=Layout(**{k: int(v) for k, v in obj["layout"].items()}),
                arrays={str(k): ArraySpec(str(v["codec"]), str(v["dtype"]),
                                          tuple(int(s) for s in v["shape"]), str(v["source"]))
                        for k, v in obj["arrays"].items()},
                stats={str(k): dict(v) for k, v in obj["stats"].items()},
                shards=tuple(ShardReceipt.from_json(s) for s in obj["shards"]),
                created_at=str(obj["created_at"]), timings=dict(obj["timings"]),
                libraries={str(k): str(v) for k, v in obj["libraries"].items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise IncompatibleFormat(f"{where} is malformed ({type(exc).__name__}: {exc}).") from exc
