"""The manifest and what it is made of, as validated, canonical JSON: pure.

The manifest (what a committed version holds; writing it create-if-absent is the commit) and
its parts (layout, arrays, views, bases), shard receipts (resume markers) and the binary shard
records of schema 2. The small objects beside it (refs, tags, the pending claim, the gc mark,
receipt runs) live in :mod:`featstore.format._objects`. Nothing here is ever unpickled; unknown
or newer schemas are refused with :class:`IncompatibleFormat` saying what to do.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeAlias

from featstore.codecs import codec_by_name
from featstore.errors import FeatstoreError, IncompatibleFormat
from featstore._allowed_names import check_name, check_version_id
from featstore._json import JSON, JSONObject, json_list, json_object
from featstore.codecs import check_array_name, check_part, is_parts_codec, part_array
from featstore._lazy import np  # imported on first use: the quick commands never need it


SCHEMA = "featstore.manifest"
#: Newest manifest schema: 2 keeps per-shard digests out of the manifest (see ShardRecords);
#: schema 1 manifests (per-shard JSON inline) are still read.
SCHEMA_VERSION = 2
#: sha256 bytes of one array's digest in a binary shard record.
DIGEST_BYTES = 32
#: Per-shard statistics in a record, as little-endian float64 after the digest (NaN: absent).
STATS_FIELDS = ("count", "nan", "inf", "min", "max", "sum", "finite", "max_abs_error")
FIELD_BYTES = DIGEST_BYTES + 8 * len(STATS_FIELDS)
RECORDS_FORMAT = "sha256+stats-f64x8"
#: Shard records per records object: 65,536 shards x 3 arrays is a 6 MiB object.
RECORDS_PER_OBJECT = 65536
RECEIPT_SCHEMA = "featstore.receipt"
#: Version of the receipt, tag and pending objects (written by this featstore; read if not newer).
OBJECT_VERSION = 1
_HEX = frozenset("0123456789abcdef")

#: One array's statistics over a shard or a version, as :mod:`featstore.codecs._statistics`
#: computes and merges them: ``count``, ``nan``, ``inf``, ``min``, ``max``, ``sum``, ...,
#: and where they apply ``nonfinite_samples`` (a list) and ``codec_error`` (an object).
ArrayStats: TypeAlias = dict[str, Any]


def check_schema(obj: JSON, schema: str, newest: int, where: str, *, required: bool = True) -> JSONObject:
    """``obj``, refused unless it is a JSON object of ``schema`` at a version this code reads.

    ``required=False`` accepts an object without schema fields (receipts embedded in a
    manifest, which carries the schema for all of them).
    """
    if not isinstance(obj, dict):
        raise IncompatibleFormat(f"{where} is not a JSON object; the store is damaged or not a "
                                 "featstore store. Delete the object (or the version) and recompute.")
    if not required and "schema" not in obj and "schema_version" not in obj:
        return obj
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
    return obj


def newer_manifest(obj: JSON) -> bool:
    """Whether ``obj`` is a manifest of a newer schema than this featstore reads: not damaged,
    only unreadable here (upgrade featstore), so never deleted as damaged.

    >>> newer_manifest({"schema": SCHEMA, "schema_version": SCHEMA_VERSION + 1})
    True
    """
    version = obj.get("schema_version") if isinstance(obj, dict) else None
    return (obj.get("schema") == SCHEMA and isinstance(version, int) and not isinstance(version, bool)
            and version > SCHEMA_VERSION) if isinstance(obj, dict) else False


def _digest(value: JSON) -> str:
    if not isinstance(value, str) or len(value) != 64 or not set(value) <= _HEX:
        raise ValueError(f"digest {value!r} is not 64 hex digits")
    return value


#: Where a stored array's values come from (:attr:`ArraySpec.source`).
SOURCES = ("output", "keep", "seed", "tokens", "digest")
#: The sources a reader serves in batches unless asked for by name (the others are featstore's own).
SERVED_SOURCES = ("output", "keep")


@dataclass(frozen=True)
class ArraySpec:
    """One stored array: its codec, stored dtype, per-sample shape, where it came from and its
    chunk compression (``"zstd"`` or ``"none"``; manifests before it existed are all zstd)."""

    codec: str
    dtype: str
    shape: tuple[int, ...]  # per sample; the stored array is (n_samples, *shape)
    #: "output" (Model A), "keep" (a dataset field), "seed" (a view's replay seeds), "tokens"
    #: (per-sample token rows) or "digest" (each sample's input digest: featstore.versions)
    source: str
    compression: str = "zstd"
    #: For one part of an output stored as several arrays (:mod:`featstore.codecs`: sparse
    #: soft labels, int8): the output's name, this array's part (``ids``, ``values``, ``counts``,
    #: ``scale``; ``""`` for int8's values) and how to read the parts back (representation,
    #: temperature, reconstruction rule, classes). Empty for a plain array; manifests before
    #: these existed hold only plain arrays.
    output: str = ""
    part: str = ""
    params: JSONObject = field(default_factory=dict)
    #: A per-token (ragged) array: ``(tokens per shard, tokens per chunk)``. Its axis 0 holds
    #: token rows, shard ``s`` of the version owning rows ``[s * tokens per shard, ...)`` of
    #: which only the first ``sum(token_length)`` of the shard's samples are stored (see
    #: :mod:`featstore.ragged`). Empty for a per-sample array (every array before it existed).
    tokens: tuple[int, ...] = ()

    @property
    def ragged(self) -> bool:
        """Whether axis 0 of the array is tokens (see :mod:`featstore.ragged`), not samples."""
        return bool(self.tokens)

    def to_json(self) -> JSONObject:
        """As stored (lists, not tuples); the part and token fields only where set, so a plain
        array's JSON is what featstore wrote before they existed."""
        d: JSONObject = json.loads(json.dumps(asdict(self)))
        if not self.output:
            for k in ("output", "part", "params"):
                d.pop(k)
        if not self.tokens:
            d.pop("tokens")
        return d

    @classmethod
    def from_json(cls, k: str, v: JSON) -> "ArraySpec":
        """Parse and check one manifest entry (raises ``ValueError``/:class:`IncompatibleFormat`)."""
        v = json_object(v, f"array {k!r}")
        spec = cls(str(v["codec"]), str(v["dtype"]), tuple(_int(s) for s in json_list(v["shape"], "shape")),
                   str(v["source"]), str(v.get("compression", "zstd")), str(v.get("output", "")),
                   str(v.get("part", "")), dict(json_object(v.get("params", {}), "params")),
                   tuple(_int(t) for t in json_list(v.get("tokens", []), "tokens")))
        if spec.tokens and (len(spec.tokens) != 2 or min(spec.tokens) < 1 or spec.tokens[0] % spec.tokens[1]):
            raise ValueError(f"array {k!r} has a malformed token layout {list(spec.tokens)}")
        if spec.output or is_parts_codec(spec.codec):
            check_part(spec.codec, spec.part, spec.dtype, f"array {k!r}")
            if part_array(spec.output, spec.part) != k or spec.source != "output":
                raise ValueError(f"array {k!r} is not part {spec.part!r} of output {spec.output!r}")
        elif codec_by_name(spec.codec).stored != spec.dtype or spec.source not in SOURCES:
            raise ValueError(f"array {k!r}: codec {spec.codec!r} does not store {spec.dtype!r}")
        if spec.compression not in ("zstd", "none"):
            raise ValueError(f"array {k!r}: unknown compression {spec.compression!r}")
        if any(d < 1 for d in spec.shape):
            raise ValueError(f"array {k!r} has shape {spec.shape}")
        return spec


@dataclass(frozen=True)
class ShardReceipt:
    """What a finished shard task reports: its rows and a digest of each array's stored bytes.

    ``view`` is the augmented view the shard belongs to (None in a version without views: the
    key is then left out of the JSON, so those receipts are unchanged)."""

    index: int
    start: int
    stop: int
    digests: dict[str, str]
    stats: dict[str, ArrayStats] = field(default_factory=dict)
    view: int | None = None

    def body(self) -> JSONObject:
        """The receipt's fields as JSON (``view`` only where set), without the schema fields."""
        d = asdict(self)
        if self.view is None:
            del d["view"]
        return d

    def to_json(self) -> JSONObject:
        return {**self.body(), "schema": RECEIPT_SCHEMA, "schema_version": OBJECT_VERSION}

    @classmethod
    def from_json(cls, obj: JSON, where: str = "a shard receipt") -> "ShardReceipt":
        obj = check_schema(obj, RECEIPT_SCHEMA, OBJECT_VERSION, where, required=False)
        try:
            r = cls(_int(obj["index"]), _int(obj["start"]), _int(obj["stop"]),
                    {check_array_name(k): _digest(v) for k, v in json_object(obj["digests"], "digests").items()},
                    {str(k): json_object(v, "stats") for k, v in json_object(obj.get("stats", {}), "stats").items()},
                    None if obj.get("view") is None else _int(obj["view"]))
        except (KeyError, TypeError, ValueError, AttributeError, FeatstoreError) as exc:
            raise IncompatibleFormat(f"{where} is malformed ({type(exc).__name__}: {exc}); delete "
                                     "it and rerun compute (the shard is recomputed).") from exc
        if not 0 <= r.start < r.stop or (r.view is not None and r.view < 0):
            raise IncompatibleFormat(f"{where} has an empty or negative row range [{r.start}, {r.stop}).")
        return r


def _int(value: JSON) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an integer")
    return value


def _number(value: JSON) -> float:
    if not isinstance(value, (int, float)):
        raise TypeError(f"{value!r} is not a number")
    return value


#: Most prefixes a version's shard objects may be spread over (their folders are 2 hex digits).
MAX_SPREAD = 256


def check_spread(spread: object) -> int:
    """``spread`` as a prefix count (None: 1, every shard object in the version's folder).

    >>> check_spread(None), check_spread(16)
    (1, 16)
    """
    if spread is None:
        return 1
    if isinstance(spread, bool) or not isinstance(spread, int) or not 1 <= spread <= MAX_SPREAD:
        raise ValueError(f"spread_prefixes must be an int from 1 to {MAX_SPREAD} (or None), got {spread!r}")
    return spread


@dataclass(frozen=True)
class Layout:
    """How axis 0 is cut: ``samples_per_shard`` rows per Zarr shard, ``chunk_rows`` per chunk,
    and over how many top-level prefixes the shard objects are ``spread`` (1: all of them in the
    version's folder, the layout of every version written before spreading existed)."""

    n_samples: int
    samples_per_shard: int
    chunk_rows: int
    spread: int = 1

    def to_json(self) -> JSONObject:
        """The stored form; ``spread`` only when above 1, so unspread manifests and claims keep
        their bytes.

        >>> Layout(100, 10, 10).to_json(), Layout(100, 10, 10, 4).to_json()["spread"]
        ({'n_samples': 100, 'samples_per_shard': 10, 'chunk_rows': 10}, 4)
        """
        out = asdict(self)
        if self.spread == 1:
            del out["spread"]
        return out

    @classmethod
    def from_json(cls, obj: JSON) -> "Layout":
        """Parse a stored layout (raises ``TypeError``/``KeyError``/``ValueError``); no
        ``spread`` (written before it existed) is 1."""
        obj = json_object(obj, "layout")
        return cls(_int(obj["n_samples"]), _int(obj["samples_per_shard"]), _int(obj["chunk_rows"]),
                   check_spread(_int(obj.get("spread", 1))))

    @property
    def n_shards(self) -> int:
        return -(-self.n_samples // self.samples_per_shard)

    def shard_range(self, i: int) -> tuple[int, int]:
        start = i * self.samples_per_shard
        return start, min(start + self.samples_per_shard, self.n_samples)

    def shard_sizes(self) -> list[int]:
        n = self.n_shards
        return [self.samples_per_shard] * (n - 1) + [self.n_samples - (n - 1) * self.samples_per_shard]

    def of(self, spec: "ArraySpec") -> "Layout":
        """The layout of one array's axis 0: this one, or a per-token array's (``tokens per
        shard`` rows per shard, one shard per sample shard).

        >>> Layout(10, 4, 2).of(ArraySpec("float16", "float16", (8,), "output", tokens=(64, 16)))
        Layout(n_samples=192, samples_per_shard=64, chunk_rows=16, spread=1)
        """
        if not spec.tokens:
            return self
        per_shard, chunk = spec.tokens
        return replace(self, n_samples=self.n_shards * per_shard, samples_per_shard=per_shard, chunk_rows=chunk)


@dataclass(frozen=True)
class ViewsSpec:
    """The augmented views of a version: ``count`` views per sample, view ``v`` of sample ``i``
    being ``augment(dataset[i], Generator().manual_seed(seed(i, v)))`` under the named seed
    ``policy`` (see :mod:`featstore.versions`) with the version's ``seed``; ``augment`` is the
    augment's identity (a digest of its source), which the reader's join checks."""

    count: int
    seed: int
    policy: str
    augment: JSON

    @classmethod
    def from_json(cls, obj: JSON) -> "ViewsSpec":
        """Parse and check the manifest's ``views`` entry (raises ``ValueError``)."""
        obj = json_object(obj, "views")
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
    fingerprint_parts: JSONObject
    layout: Layout
    arrays: dict[str, ArraySpec]
    stats: dict[str, ArrayStats]
    created_at: str
    timings: dict[str, float]
    libraries: dict[str, str]
    #: Schema 1 only: every shard's receipt inline (~400 bytes of JSON per shard). None in
    #: schema 2, where :class:`ShardRecords` points at them (``StoredVersion.shard_receipts()``).
    shards: tuple[ShardReceipt, ...] | None = None
    records: ShardRecords | None = None
    #: Shards stored in other versions' folders (an incremental version's parents).
    bases: tuple[Base, ...] = ()
    #: Sampled content digest of the whole dataset (what ``extends`` checks a child against).
    dataset_sample: str | None = None
    #: K augmented views per sample (schema 2 only; None: one un-augmented view, the key is then
    #: left out). Records and receipts are then per (view, shard) unit, view-major.
    views: ViewsSpec | None = None
    #: The digest of every sample's input (:func:`featstore.versions.content_digest`; None in a
    #: version without per-sample input digests, and the key is then left out).
    content: str | None = None
    #: The content fingerprint the dataset keeps of itself, where it has one (a Hugging Face
    #: ``datasets.Dataset``'s, ``"datasets:<hex>"``; None otherwise, and the key is left out).
    source_fingerprint: str | None = None

    @property
    def n_samples(self) -> int:
        return self.layout.n_samples

    @property
    def n_units(self) -> int:
        """Records of the version: one per shard, or per (view, shard) with views."""
        return self.layout.n_shards * (1 if self.views is None else self.views.count)

    def unit_order(self) -> list[tuple[int | None, int]]:
        """Every (view, shard) unit of the version, in records order (view None: no views)."""
        views: list[int | None] = [None] if self.views is None else list(range(self.views.count))
        return [(v, i) for v in views for i in range(self.layout.n_shards)]

    @property
    def committed(self) -> bool:
        """Whether this is a committed version's manifest (it names its shard records), not the
        plan of one still being computed (what the teacher in the loop reads from)."""
        return self.records is not None or self.shards is not None

    @property
    def schema_version(self) -> int:
        return 1 if self.shards is not None else 2

    def based(self) -> set[int]:
        """The shards stored in other versions' folders (its bases')."""
        return {i for b in self.bases for i in range(b.first, b.stop)}

    @property
    def own_shards(self) -> list[int]:
        """The shards stored in this version's own folder (those no base holds)."""
        based = self.based()
        return [i for i in range(self.layout.n_shards) if i not in based]

    def to_json(self) -> JSONObject:
        per_shard = ("shards", "records", "bases", "dataset_sample", "views", "content", "source_fingerprint")
        d: JSONObject = {k: v for k, v in asdict(self).items() if k not in per_shard}
        d["layout"] = self.layout.to_json()
        d["arrays"] = {n: a.to_json() for n, a in self.arrays.items()}
        d["schema"], d["schema_version"] = SCHEMA, self.schema_version
        if self.shards is not None:
            d["shards"] = [r.body() for r in self.shards]
            return d
        d["records"] = None if self.records is None else self.records.to_json()
        d["bases"] = [b.to_json() for b in self.bases]
        d["dataset_sample"] = self.dataset_sample
        if self.views is not None:
            d["views"] = asdict(self.views)
        for key in ("content", "source_fingerprint"):  # only where set: older manifests are unchanged
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d

    @classmethod
    def from_json(cls, obj: JSON, where: str = "manifest") -> "Manifest":
        """Parse and validate a manifest; anything unexpected is :class:`IncompatibleFormat`.

        Names and array names are checked like user input (they become store paths), codecs
        and dtypes must be ones this featstore knows, and the shards must tile the layout.
        """
        obj = check_schema(obj, SCHEMA, SCHEMA_VERSION, where)
        try:
            layout = Layout.from_json(obj["layout"])
            arrays = {check_array_name(k): ArraySpec.from_json(k, v)
                      for k, v in json_object(obj["arrays"], "arrays").items()}
            shards, records, bases, sample, views = _per_shard_parts(obj, where)
            m = cls(
                id=check_version_id(obj["id"]), name=check_name(obj["name"]),
                fingerprint=_digest(obj["fingerprint"]),
                fingerprint_parts=dict(json_object(obj["fingerprint_parts"], "fingerprint_parts")),
                layout=layout, arrays=arrays,
                stats={str(k): json_object(v, "stats") for k, v in json_object(obj["stats"], "stats").items()},
                created_at=str(obj["created_at"]),
                timings={str(k): _number(v) for k, v in json_object(obj["timings"], "timings").items()},
                libraries={str(k): str(v) for k, v in json_object(obj["libraries"], "libraries").items()},
                shards=shards, records=records, bases=bases, dataset_sample=sample, views=views,
                content=None if obj.get("content") is None else _digest(obj["content"]),
                source_fingerprint=None if obj.get("source_fingerprint") is None else str(obj["source_fingerprint"]),
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
        if m.shards is not None:
            _check_tiles(m.shards, layout, arrays, where)
        else:
            _check_v2(m, where)
        return m


def _per_shard_parts(obj: JSONObject, where: str) -> tuple[tuple[ShardReceipt, ...] | None, ShardRecords | None,
                                                            tuple[Base, ...], str | None, ViewsSpec | None]:
    """The per-shard part of a manifest, ``(shards, records, bases, dataset_sample, views)``:
    inline receipts (schema 1) or where they are (2)."""
    if obj["schema_version"] == 1:
        return tuple(ShardReceipt.from_json(s, f"{where}, shard {i}")
                     for i, s in enumerate(json_list(obj["shards"], "shards"))), None, (), None, None
    if "shards" in obj:
        raise ValueError("a schema 2 manifest holds no inline shards")
    sample = obj.get("dataset_sample")
    return (None, ShardRecords.from_json(obj["records"]),
            tuple(Base.from_json(b) for b in json_list(obj.get("bases", []), "bases")),
            None if sample is None else _digest(sample),
            None if obj.get("views") is None else ViewsSpec.from_json(obj["views"]))


def _check_tiles(shards: tuple[ShardReceipt, ...], layout: Layout, arrays: dict[str, ArraySpec], where: str) -> None:
    tiles = [(r.index, r.start, r.stop) for r in shards]
    if tiles != [(i, *layout.shard_range(i)) for i in range(layout.n_shards)] or any(
            set(r.digests) != set(arrays) for r in shards):
        raise IncompatibleFormat(f"{where}: its shards do not tile the layout or miss arrays; "
                                 "the manifest is damaged. Delete the version and recompute.")


def _check_v2(m: Manifest, where: str) -> None:
    """Schema 2: records cover every shard of every array; bases hold disjoint runs of shards, in
    order, each over the same rows in its folder as in this version."""
    rec = m.records
    n = m.layout.n_shards
    problems = []
    if rec is None or set(rec.fields) != set(m.arrays) or len(rec.fields) != len(m.arrays):
        problems.append("its shard records do not name exactly its arrays")
    elif len(rec.objects) != -(-m.n_units // rec.per_object):
        problems.append(f"{len(rec.objects)} records objects for {m.n_units} shards of {rec.per_object}")
    if m.views is not None and m.bases:
        problems.append("a version with views has no bases")
    pos, spp = 0, m.layout.samples_per_shard
    for b in m.bases:
        if b.first < pos or b.stop <= b.first or b.stop > n or \
                min(b.stop * spp, b.n_samples) != min(b.stop * spp, m.layout.n_samples):
            problems.append(f"base {b.name}@{b.id} shards [{b.first}, {b.stop}) overlap, are out of order or "
                            "hold other rows")
        pos = b.stop
    if problems:
        raise IncompatibleFormat(f"{where}: {'; '.join(problems)}; the manifest is damaged. Delete the "
                                 "version and recompute.")


@dataclass(frozen=True)
class ShardRecords:
    """Where a schema 2 version keeps its per-shard digests and statistics: fixed-width records.

    Record ``i`` holds, per array in ``fields`` order, the raw sha256 (32 bytes) of shard
    ``i``'s stored values and its statistics (:data:`STATS_FIELDS` as little-endian float64,
    NaN where absent): 96 bytes per array and shard. ``per_object`` records make one object,
    and ``objects`` lists each object's sha256, which also names it (content-addressed: a
    concurrent commit never overwrites another's). Only verify, resume and an incremental
    child read them; opening a version never does.
    """

    fields: tuple[str, ...]
    per_object: int
    objects: tuple[str, ...]

    @property
    def record_bytes(self) -> int:
        return FIELD_BYTES * len(self.fields)

    def to_json(self) -> JSONObject:
        return {"format": RECORDS_FORMAT, "fields": list(self.fields), "per_object": self.per_object,
                "objects": list(self.objects)}

    @classmethod
    def from_json(cls, obj: JSON) -> "ShardRecords":
        obj = json_object(obj, "records")
        if obj.get("format") != RECORDS_FORMAT:
            raise ValueError(f"unknown shard records format {obj.get('format')!r}")
        per = _int(obj["per_object"])
        if per < 1:
            raise ValueError(f"per_object {per}")
        return cls(tuple(check_array_name(f) for f in json_list(obj["fields"], "fields")), per,
                   tuple(_digest(d) for d in json_list(obj["objects"], "objects")))


def _record_dtype(fields: Sequence[str]) -> np.dtype:
    """The numpy view of one record: per array, its 32 digest bytes, then 8 little-endian float64."""
    return np.dtype([(part, kind) for j in range(len(fields))
                     for part, kind in ((f"d{j}", f"V{DIGEST_BYTES}"), (f"s{j}", ("<f8", len(STATS_FIELDS))))])


def _stats_row(stats: ArrayStats | None) -> list[float]:
    stats = stats or {}
    return [np.nan if stats.get(k) is None else float(stats[k]) for k in STATS_FIELDS]


def _stats_dict(vals: list[float]) -> ArrayStats:
    if vals[0] != vals[0]:  # NaN count: no statistics were recorded for this shard
        return {}
    out: ArrayStats = {}
    for k, v in zip(STATS_FIELDS, vals, strict=True):
        if k in ("count", "nan", "inf", "finite"):
            out[k] = int(v)
        elif k != "max_abs_error" or v == v:
            out[k] = None if v != v else v
    return out


def encode_records(receipts: Sequence[ShardReceipt], fields: Sequence[str],
                   per_object: int = RECORDS_PER_OBJECT) -> list[bytes]:
    """The records objects of ``receipts`` (shards 0..n-1, or every view's shards view-major,
    in order), ``per_object`` each."""
    table = np.zeros(len(receipts), dtype=_record_dtype(fields))
    for j, f in enumerate(fields):
        digests = bytes.fromhex("".join(r.digests[f] for r in receipts))
        table[f"d{j}"] = np.frombuffer(digests, dtype=f"V{DIGEST_BYTES}")
        table[f"s{j}"] = np.array([_stats_row(r.stats.get(f)) for r in receipts], dtype="<f8").reshape(
            len(receipts), len(STATS_FIELDS))
    return [table[lo:lo + per_object].tobytes() for lo in range(0, len(receipts), per_object)]


def decode_records(data: bytes, records: ShardRecords, first: int, layout: Layout, where: str,
                   views: int | None = None) -> list[ShardReceipt]:
    """The receipts held by one records object whose first record is unit ``first`` (the
    shard, or with ``views`` the view-major (view, shard) unit)."""
    width = records.record_bytes
    n = layout.n_shards
    count = min(records.per_object, n * (views or 1) - first)
    if len(data) != width * count:
        raise IncompatibleFormat(f"{where} holds {len(data)} bytes, not {count} records of {width}; it is "
                                 "damaged. Delete the version and recompute.")
    table = np.frombuffer(data, dtype=_record_dtype(records.fields))
    hexes, stats = [], []
    for j in range(len(records.fields)):
        h = table[f"d{j}"].tobytes().hex()
        hexes.append([h[k * 2 * DIGEST_BYTES:(k + 1) * 2 * DIGEST_BYTES] for k in range(count)])
        stats.append(table[f"s{j}"].tolist())
    out = []
    for k in range(count):
        digests = {f: hexes[j][k] for j, f in enumerate(records.fields)}
        st = {f: _stats_dict(stats[j][k]) for j, f in enumerate(records.fields)}
        view, index = divmod(first + k, n) if views is not None else (None, first + k)
        out.append(ShardReceipt(index, *layout.shard_range(index), digests, {f: v for f, v in st.items() if v}, view))
    return out


@dataclass(frozen=True)
class Base:
    """Shards ``[first, stop)`` of an incremental version, stored in version ``name@id``'s
    folder (which held ``n_samples`` rows): referenced, never copied."""

    name: str
    id: str
    first: int
    stop: int
    n_samples: int

    def to_json(self) -> JSONObject:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: JSON) -> "Base":
        obj = json_object(obj, "base")
        return cls(check_name(obj["name"]), check_version_id(obj["id"]), _int(obj["first"]),
                   _int(obj["stop"]), _int(obj["n_samples"]))
