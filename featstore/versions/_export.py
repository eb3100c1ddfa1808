"""A version as a self-contained standard Zarr v3 group: the route for plain readers.

A version computed with ``extends=`` reads its first shards from its parent's folder, and one
with ``spread_prefixes`` keeps its shard objects under top-level prefixes; their arrays declare
the chunk key encoding ``featstore.mapped``, which no Zarr reader knows, so zarr, xarray and
TensorStore refuse them loudly rather than read the shards they cannot find as zeros.
:func:`export_version` writes such a version (or any other) to a new folder as plain Zarr v3:
the group, each view's group, every array's metadata with the default chunk key encoding, and
every shard object copied byte for byte (its crc32c and compression unchanged) to its default
key, then consolidated metadata, so ``zarr.open_group``/``xarray.open_zarr``/TensorStore read it
as it is. The copy is then read back with plain zarr and each shard compared with the digest
recorded when the version was computed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import zarr

from featstore._json import JSONObject, load_json
from featstore.errors import CorruptChunk, IncompatibleFormat, InvalidInput, StoreConflict
from featstore.format import check_array_metadata, consolidate, consolidated_groups
from featstore.format import ChunkRef
from featstore.format import VIEWS_GROUP, chunk_key, mark_metadata, shard_digest, view_path
from featstore.codecs import TOKEN_LENGTH
from featstore.storage import Storage, backend_for
from featstore.storage import StorageOptions
from featstore.versions._committed import HasStoredVersion, StoredVersion, missing_data_error, stored
from featstore.versions._keys import IO_THREADS

GROUP_META = {"zarr_format": 3, "node_type": "group"}
N = TypeVar("N", zarr.Group, zarr.Array[Any])


@dataclass(frozen=True)
class Exported:
    """What :func:`export_version` wrote: where, how many objects and bytes, and the shards it
    checked against their compute-time digests."""

    url: str
    objects: int
    bytes: int
    shards_checked: int


def export_version(version: StoredVersion | HasStoredVersion, url: str,
                   storage_options: StorageOptions | None = None, *, verify: bool = True,
                   progress: Callable[[int, int], None] | None = None) -> Exported:
    """Write ``version`` to ``url`` (a new or empty folder, any fsspec URL) as a standard,
    self-contained Zarr v3 group.

    >>> out = export_version(store.open("cnn-a/train"), "/data/cnn-a-train.zarr")
    >>> zarr.open_group(out.url, mode="r")["features"][:10].shape
    (10, 512)

    ``progress(done, total)`` is called as shard objects are copied.
    """
    version = stored(version)
    dest = backend_for(url)(url, storage_options)
    if dest.find(""):
        raise StoreConflict(f"{dest.url} is not empty: export into a new folder.")
    attributes = {"featstore": {"exported_from": version.ref, "fingerprint": version.fingerprint,
                                "samples": len(version), "views": version.views}}
    dest.write_bytes("zarr.json", _json({**GROUP_META, "attributes": attributes}))
    if version.views is not None:
        dest.write_bytes(f"{VIEWS_GROUP}/zarr.json", _json({**GROUP_META, "attributes": {}}))
    copies: list[tuple[StoredVersion, str, int]] = []
    for view in [None] if version.views is None else range(version.views):
        source = version if view is None else version.view(view)
        prefix = "" if view is None else f"{view_path(view)}/"
        if view is not None:
            dest.write_bytes(f"{prefix}zarr.json", _json({**GROUP_META, "attributes": {"featstore": {"view": view}}}))
        for field in version.manifest.arrays:
            meta = _array_metadata(version, source, field)
            dest.write_bytes(f"{prefix}{field}/zarr.json", _json(meta))
            shard_rows = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])  # the sharding codec's
            copies += [(source, field, s) for s in range(-(-meta["shape"][0] // shard_rows))]
    written = _copy_objects(version, dest, copies, progress)
    consolidate(dest.zarr_store("", read_only=False), consolidated_groups(version.views))
    checked = verify_export(version, dest) if verify else 0
    return Exported(dest.url, len(copies), written, checked)


def _json(obj: object) -> bytes:
    return json.dumps(obj, indent=2, sort_keys=True).encode()


def _array_metadata(version: StoredVersion, source: StoredVersion, field: str) -> dict[str, Any]:
    """The array's ``zarr.json`` with the default chunk key encoding, as Zarr must see it (as
    parsed: Zarr's schema, which featstore wrote and checks when it opens the array)."""
    key = f"{source.data_key}/{field}/zarr.json"
    raw = version.storage.read_bytes(key, metadata=True)
    if raw is None:
        raise CorruptChunk(f"{field}/zarr.json of {version.ref} is missing; the version is damaged.",
                           version=version.ref, array=field, chunk=f"{field}/zarr.json")
    # checked as opening the array checks it: a damaged zarr.json is CorruptChunk naming it
    try:
        parsed: JSONObject | None = load_json(mark_metadata(raw, None), f"{field}/zarr.json")
    except IncompatibleFormat:
        parsed = None
    check_array_metadata(parsed, source.manifest.arrays[field], source.manifest.layout, version=version.ref,
                         array=field)
    assert parsed is not None  # check_array_metadata raised otherwise
    return parsed


def _copy_objects(version: StoredVersion, dest: Storage, copies: list[tuple[StoredVersion, str, int]],
                  progress: Callable[[int, int], None] | None) -> int:
    """Copy every shard object from wherever it lies (its folder, a parent's, a spread prefix)
    to its default key in ``dest`` (its key inside the version), concurrently; the bytes copied."""
    storage = version.storage.reopen()

    def copy(item: tuple[StoredVersion, str, int]) -> int:
        source, field, shard = item
        key = source.chunk_key(field, shard)
        data = storage.read_bytes(source.object_key(field, shard))
        if not data:
            raise missing_data_error(version, ChunkRef(version.ref, field, key), data)
        dest.write_bytes(key, data)
        return len(data)

    total = 0
    with ThreadPoolExecutor(IO_THREADS, thread_name_prefix="featstore-export") as pool:
        for i, n in enumerate(pool.map(copy, copies), 1):
            total += n
            if progress is not None:
                progress(i, len(copies))
    return total


def _node(group: zarr.Group, path: str, kind: type[N], version: StoredVersion, dest: Storage) -> N:
    """``group[path]``, which the export wrote as a ``kind`` (a :class:`CorruptChunk` if it is not)."""
    node = group[path]
    if not isinstance(node, kind):
        raise CorruptChunk(f"{path} in the export of {version.ref} at {dest.url} is not a Zarr "
                           f"{kind.__name__.lower()}: delete the export and run it again.",
                           version=version.ref, array=path, chunk=f"{path}/zarr.json")
    return node


def verify_export(version: StoredVersion, dest: Storage) -> int:
    """Read an export back with plain zarr and compare every shard of every array with the
    digest recorded at compute time; return the number of shards checked, or raise
    :class:`CorruptChunk` naming the first that differs."""
    root = zarr.open_group(dest.zarr_store("", read_only=True), mode="r")
    spec = version.manifest.arrays
    checked = 0
    for r in version.shard_receipts():
        group = root if r.view is None else _node(root, f"{VIEWS_GROUP}/{r.view}", zarr.Group, version, dest)
        span = None
        for field, digest in r.digests.items():
            arr = _node(group, field, zarr.Array, version, dest)
            if spec[field].ragged:
                if span is None:
                    lengths = np.asarray(_node(group, TOKEN_LENGTH, zarr.Array, version, dest)[r.start:r.stop])
                    first = r.index * spec[field].tokens[0]
                    span = (first, first + int(lengths.sum(dtype=np.int64)))
                values = arr[span[0]:span[1]]
            else:
                values = arr[r.start:r.stop]
            if shard_digest(np.asarray(values)) != digest:
                raise CorruptChunk(f"the export of {version.ref} at {dest.url} differs from the version in "
                                   f"{field}, shard {r.index}: delete the export and run it again.",
                                   version=version.ref, array=field,
                                   chunk=chunk_key(field, r.index, len(spec[field].shape)))
            checked += 1
    if checked == 0 and len(version):
        raise InvalidInput(f"{version.ref} has no shard digests to check the export against.")
    return checked
