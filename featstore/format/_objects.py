"""The small objects stored beside the manifest, as validated, canonical JSON: a view of another
version's shards (ref), tags (the only mutable pointers), the pending claim of a version being
computed, the mark ``gc`` leaves while deleting, and runs of shard receipts. Pure, like
:mod:`featstore.format._manifests`; nothing here is ever unpickled.
"""

from __future__ import annotations

from dataclasses import dataclass

from featstore.errors import FeatstoreError, IncompatibleFormat
from featstore._allowed_names import check_name, check_version_id, is_version_id
from featstore._json import JSON, JSONObject, json_list, json_object
from featstore.format._manifests import OBJECT_VERSION, ArraySpec, Layout, ShardReceipt, check_schema

RECEIPT_RUN_SCHEMA = "featstore.receipt-run"
REF_SCHEMA = "featstore.ref"
TAG_SCHEMA = "featstore.tag"
PENDING_SCHEMA = "featstore.pending"
GC_MARK_SCHEMA = "featstore.gc-mark"


def gc_mark_json() -> JSONObject:
    """The mark ``gc`` leaves in a version folder while deleting it (only its presence counts)."""
    return {"schema": GC_MARK_SCHEMA, "schema_version": OBJECT_VERSION}


@dataclass(frozen=True)
class ReceiptRun:
    """Receipts of many shards in one object: a task compacts its per-shard receipts into runs,
    so a resume lists a few objects instead of one per shard. Named by its first and last shard."""

    receipts: tuple[ShardReceipt, ...]

    def to_json(self) -> JSONObject:
        return {"schema": RECEIPT_RUN_SCHEMA, "schema_version": OBJECT_VERSION,
                "receipts": [r.body() for r in self.receipts]}

    @classmethod
    def from_json(cls, obj: JSON, where: str) -> "ReceiptRun":
        obj = check_schema(obj, RECEIPT_RUN_SCHEMA, OBJECT_VERSION, where)
        try:
            items = json_list(obj["receipts"], "receipts")
        except (KeyError, TypeError) as exc:
            raise IncompatibleFormat(f"{where} is malformed ({exc}); delete it and rerun compute.") from exc
        return cls(tuple(ShardReceipt.from_json(r, f"{where}, item {i}") for i, r in enumerate(items)))


def ref_json(name: str, vid: str) -> JSONObject:
    """The marker a child version leaves in a base's folder: "I read shards from here"."""
    return {"schema": REF_SCHEMA, "schema_version": OBJECT_VERSION, "name": check_name(name),
            "version": check_version_id(vid)}


def ref_target(obj: JSON, where: str) -> tuple[str, str]:
    """``(name, id)`` of the child a stored reference marker names."""
    obj = check_schema(obj, REF_SCHEMA, OBJECT_VERSION, where)
    try:
        return check_name(obj["name"]), check_version_id(obj["version"])
    except (KeyError, TypeError, FeatstoreError) as exc:
        raise IncompatibleFormat(f"{where} is malformed ({exc}); delete it.") from exc


def tag_json(vid: str) -> JSONObject:
    """The stored object of a tag pointing at version ``vid``."""
    return {"schema": TAG_SCHEMA, "schema_version": OBJECT_VERSION, "version": check_version_id(vid)}


def tag_target(obj: JSON, where: str, tag: str) -> str:
    """The version id a stored tag object points at, validated."""
    vid = check_schema(obj, TAG_SCHEMA, OBJECT_VERSION, where).get("version")
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
    arrays: dict[str, JSONObject]  # ArraySpec fields as JSON (lists, not tuples)

    @classmethod
    def of(cls, layout: Layout, arrays: dict[str, ArraySpec]) -> "Pending":
        """The claim a run makes for ``layout`` and ``arrays``."""
        return cls(layout, {n: a.to_json() for n, a in arrays.items()})

    def to_json(self) -> JSONObject:
        return {"schema": PENDING_SCHEMA, "schema_version": OBJECT_VERSION,
                "layout": self.layout.to_json(), "arrays": dict(self.arrays)}

    @classmethod
    def from_json(cls, obj: JSON, where: str) -> "Pending":
        obj = check_schema(obj, PENDING_SCHEMA, OBJECT_VERSION, where, required=False)
        try:
            layout = Layout.from_json(obj["layout"])
            arrays = {str(k): json_object(v, f"array {k!r}") for k, v in json_object(obj["arrays"], "arrays").items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise IncompatibleFormat(f"{where} is malformed ({type(exc).__name__}: {exc}); delete the "
                                     "uncommitted version folder and rerun.") from exc
        return cls(layout, arrays)
