"""Validation of a version's Zarr array metadata before any chunk is decoded.

A ``zarr.json`` decides which codecs run on stored bytes, so one planted in a store could make
a reader run any codec zarr or numcodecs knows (object and pickle codecs included). A reader
therefore accepts only the metadata featstore itself writes: Zarr format 3, a regular grid of
whole shards, the sharding codec with bytes + zstd + crc32c inside, and the dtype and shape the
manifest records. Anything else is refused before the first chunk is read.
"""

from __future__ import annotations

from typing import Any

from .errors import CorruptChunk, IncompatibleFormat
from .manifest import ArraySpec, Layout

ZARR_FORMAT = 3
ALLOWED_CODECS = frozenset({"sharding_indexed", "bytes", "zstd", "crc32c"})


def _plain(obj: Any) -> Any:
    """Parsed metadata as plain JSON types (zarr's ``to_dict`` gives tuples and objects)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def _codec_names(codecs: Any) -> list[str]:
    names: list[str] = []
    for c in codecs if isinstance(codecs, list) else [codecs]:
        name = c.get("name") if isinstance(c, dict) else c
        names.append(str(name))
        conf = c.get("configuration") if isinstance(c, dict) else None
        if isinstance(conf, dict):
            for inner in ("codecs", "index_codecs"):
                if inner in conf:
                    names += _codec_names(conf[inner])
    return names


def check_array_metadata(meta: Any, spec: ArraySpec, layout: Layout, *, version: str, array: str) -> None:
    """Raise unless ``meta`` (a parsed ``zarr.json``) is what featstore wrote for ``spec``.

    A newer ``zarr_format`` is :class:`IncompatibleFormat` (upgrade featstore and zarr); any
    other mismatch is :class:`CorruptChunk` naming the version and the array.
    """
    where = f"{array}/zarr.json of version {version}"
    meta = _plain(meta)
    if not isinstance(meta, dict):
        raise CorruptChunk(f"{where} is not a JSON object; delete and recompute the version.",
                           version=version, array=array, chunk=f"{array}/zarr.json")
    fmt = meta.get("zarr_format")
    if isinstance(fmt, int) and fmt > ZARR_FORMAT:
        raise IncompatibleFormat(f"{where} is Zarr format {fmt}, newer than this featstore reads "
                                 f"({ZARR_FORMAT}); upgrade featstore and zarr (pip install -U featstore zarr).")
    want_shape = [layout.n_samples, *spec.shape]
    want_grid = [layout.samples_per_shard, *spec.shape]
    grid = meta.get("chunk_grid") if isinstance(meta.get("chunk_grid"), dict) else {}
    problems = []
    if fmt != ZARR_FORMAT or meta.get("node_type") != "array":
        problems.append(f"zarr_format={fmt!r}, node_type={meta.get('node_type')!r}")
    if meta.get("data_type") != spec.dtype:
        problems.append(f"data_type {meta.get('data_type')!r} but the manifest says {spec.dtype!r}")
    if meta.get("shape") != want_shape:
        problems.append(f"shape {meta.get('shape')!r} but the manifest says {want_shape}")
    if grid.get("name") != "regular" or (grid.get("configuration") or {}).get("chunk_shape") != want_grid:
        problems.append(f"chunk grid {grid!r} is not shards of {want_grid}")
    top = meta.get("codecs")
    if not (isinstance(top, list) and len(top) == 1 and isinstance(top[0], dict)
            and top[0].get("name") == "sharding_indexed"):
        problems.append("the codec chain is not one sharding codec (featstore writes whole shards)")
    names = _codec_names(meta.get("codecs", []))
    if not names or not set(names) <= ALLOWED_CODECS:
        problems.append(f"codecs {names} (featstore writes only {sorted(ALLOWED_CODECS)})")
    if meta.get("storage_transformers") not in (None, []):
        problems.append("storage transformers are set")
    if problems:
        raise CorruptChunk(f"{where} is not what featstore wrote: {'; '.join(problems)}. Refusing to "
                           "decode its chunks; delete and recompute the version.",
                           version=version, array=array, chunk=f"{array}/zarr.json")
