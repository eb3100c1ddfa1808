"""Synthetic versions: real metadata (manifest, shard records, zarr.json), no payload.

What the scale benchmark and the scale tests open: a version of any number of shards is
committed in seconds, because only its metadata is written. Reading its rows fails (there are
no chunks); opening it, planning a reader over it, and reading its records do not.
"""

from __future__ import annotations

import hashlib
import struct

from featstore.format import create_arrays
from featstore.format import RECORDS_PER_OBJECT, ArraySpec, Layout, Manifest, ShardReceipt, ShardRecords
from featstore.store import FeatureStore
from featstore.versions import version_key

ARRAYS = {"features": ArraySpec("float16", "float16", (512,), "output"),
          "logits": ArraySpec("float32", "float32", (1000,), "output"),
          "target": ArraySpec("keep-int64", "int64", (), "keep")}
_STATS = {"count": 1, "nan": 0, "inf": 0, "min": -1.0, "max": 1.0, "sum": 0.0, "finite": 1}


def synthetic_receipts(layout: Layout, fields: list[str]) -> list[ShardReceipt]:
    """One receipt per shard with distinct made-up digests and plausible statistics."""
    out = []
    for i in range(layout.n_shards):
        seed = hashlib.sha256(struct.pack("<Q", i)).digest()
        digests = {f: hashlib.sha256(seed + f.encode()).hexdigest() for f in fields}
        out.append(ShardReceipt(i, *layout.shard_range(i), digests, {f: dict(_STATS) for f in fields}))
    return out


def synthetic_version(store: FeatureStore, name: str, n_shards: int, samples_per_shard: int = 16384,
                      arrays: dict[str, ArraySpec] | None = None, chunk_rows: int = 1024,
                      with_records: bool = True) -> Manifest:
    """Commit a metadata-only version of ``n_shards`` shards; return its manifest.

    ``with_records=False`` skips writing the shard records (the manifest names as many
    records objects, with made-up digests): for what never reads them, such as opening.
    """
    arrays = dict(arrays or ARRAYS)
    layout = Layout(n_shards * samples_per_shard, samples_per_shard, min(chunk_rows, samples_per_shard))
    fp = hashlib.sha256(f"{name}/{n_shards}/{samples_per_shard}".encode()).hexdigest()
    vid = fp[:16]
    key = version_key(name, vid)
    create_arrays(store.storage.zarr_store(key, read_only=False), layout, arrays, key)
    store.storage.write_bytes(f"{key}/_pending.json", b"{}")
    if with_records:
        records = store.catalog.commits.write_records(name, vid, synthetic_receipts(layout, list(arrays)), list(arrays))
    else:
        n_objects = -(-layout.n_shards // RECORDS_PER_OBJECT)
        records = ShardRecords(tuple(arrays), RECORDS_PER_OBJECT,
                               tuple(hashlib.sha256(b"%d" % k).hexdigest() for k in range(n_objects)))
    manifest = Manifest(
        id=vid, name=name, fingerprint=fp, fingerprint_parts={"dataset": {"length": layout.n_samples}},
        layout=layout, arrays=arrays,
        stats={f: {"count": layout.n_samples, "nan": 0, "inf": 0, "min": -1.0, "max": 1.0, "mean": 0.0}
               for f in arrays},
        created_at="2026-01-01T00:00:00+00:00", timings={}, libraries={}, records=records)
    # Written directly, not through Commits.commit, which checks that every shard object exists.
    store.storage.create_json(f"{key}/manifest.json", manifest.to_json())
    return manifest
