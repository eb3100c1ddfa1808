"""The Zarr arrays featstore writes, and what it accepts back.

- **Arrays.** One Zarr v3 array per stored field, all sharing axis 0 (the sample). Axis 0 is
  cut into shards of ``Layout.samples_per_shard`` rows (one object each, which one task writes
  whole) and inner chunks of ``Layout.chunk_rows`` rows; every chunk carries a crc32c, after
  zstd where zstd pays (:func:`choose_compression`). Missing chunks are never read as the fill
  value (:class:`StrictStore`), and an all-fill shard is still stored (``write_empty_chunks``).
- **Spread versions** are shown to Zarr at their usual keys (:class:`SpreadStore`), marked array
  metadata unmarked (:class:`MetadataStore`).
- **Validation.** :func:`check_array_metadata` refuses any ``zarr.json`` featstore would not
  write, before a single chunk is decoded (a planted one could name any codec).
"""

from __future__ import annotations

import warnings
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import zarr
import zarr.errors
import zarr.storage
from zarr.abc.store import Store
from zarr.codecs import Crc32cCodec, ZstdCodec

from featstore.errors import CorruptChunk, FeatstoreError, IncompatibleFormat, InvalidInput, StoreConflict
from featstore._json import JSON, JSONObject, load_json
from featstore.format._manifests import ArraySpec, Layout

from featstore.format._keys import (ALLOWED_CODECS, VIEWS_GROUP, ZARR_FORMAT, compact_metadata, logical_key,
                                    mark_metadata, spread_folder, spread_key, view_path)

if TYPE_CHECKING:
    from zarr.abc.codec import BytesBytesCodec
    from zarr.abc.store import ByteRequest
    from zarr.core.buffer import Buffer, BufferPrototype

ZSTD_LEVEL = 3
COMPRESSIONS = ("auto", "zstd", "none")
#: "auto" stores an array with zstd only where zstd saves at least this share of its bytes on the
#: probe batch: near-incompressible float32 (logits) decodes ~10x slower through zstd than as a
#: plain copy, and the reader's decode competes with Model B for the same cores.
AUTO_MIN_SAVING = 0.10
#: The same rule for a local store, where bytes are cheap and CPU is what the reader spends:
#: there an uncompressed array is gathered in place from the page cache (no decode at all),
#: while zstd costs ~4x the reader's CPU per epoch on fp16 features that it shrinks by ~40%
#: (docs/benchmarks.md, "compression on a local store"). So zstd only where it halves the bytes.
LOCAL_AUTO_MIN_SAVING = 0.50


# -- compression policy ------------------------------------------------------------------------
def zarr_codecs(compression: str = "zstd") -> list[BytesBytesCodec]:
    """The bytes-to-bytes chain for every chunk: zstd (unless ``"none"``), then a crc32c checksum."""
    if compression not in ("zstd", "none"):
        raise InvalidInput(f"compression must be 'zstd' or 'none' here, got {compression!r}.")
    return [ZstdCodec(level=ZSTD_LEVEL), Crc32cCodec()] if compression == "zstd" else [Crc32cCodec()]


def check_compression(compression: str) -> str:
    """Validate a user's compression choice (``"auto"``, ``"zstd"`` or ``"none"``)."""
    if compression not in COMPRESSIONS:
        raise InvalidInput(f"compression must be one of {COMPRESSIONS}, got {compression!r}.")
    return compression


def zstd_saving(stored: np.ndarray) -> float:
    """The share of bytes zstd (featstore's level) saves on ``stored`` (0 for empty input)."""
    import numcodecs

    raw = np.ascontiguousarray(stored).tobytes()
    if not raw:
        return 0.0
    return 1.0 - len(numcodecs.Zstd(ZSTD_LEVEL).encode(raw)) / len(raw)


def choose_compression(policy: str, saving: float, local: bool = False) -> str:
    """``policy`` resolved for one array whose probe batch zstd shrinks by ``saving``, on a
    local store (``local``: CPU matters more than bytes) or a remote one (bytes matter).

    >>> choose_compression("auto", 0.42), choose_compression("auto", 0.07)
    ('zstd', 'none')
    >>> choose_compression("auto", 0.42, local=True), choose_compression("auto", 0.85, local=True)
    ('none', 'zstd')
    """
    if check_compression(policy) != "auto":
        return policy
    return "zstd" if saving >= (LOCAL_AUTO_MIN_SAVING if local else AUTO_MIN_SAVING) else "none"


def chunk_label(compression: str) -> str:
    """How the chunk chain is named in the fingerprint (it changes the stored bytes)."""
    return f"{compression}(zstd level {ZSTD_LEVEL})+crc32c"


# -- writing -----------------------------------------------------------------------------------
def create_arrays(store: Store, layout: Layout, arrays: Mapping[str, ArraySpec],
                  where: str) -> None:
    """Create the version's group and arrays, or check that an earlier or concurrent run of
    the same claim created them identically (a :class:`StoreConflict` otherwise)."""
    try:
        group = zarr.open_group(store, mode="a")
    except zarr.errors.ContainsGroupError:  # a concurrent run created it between look and create
        group = zarr.open_group(store, mode="r+")
    for name, a in arrays.items():
        axis = layout.of(a)  # samples, or a per-token array's token rows
        shape = (axis.n_samples, *a.shape)
        try:
            existing = group[name]
        except KeyError:
            existing = None
        if existing is not None:
            if isinstance(existing, zarr.Array) and existing.shape == shape \
                    and existing.shards == (axis.samples_per_shard, *a.shape):
                continue  # created by the founder or an earlier run: identical metadata
            raise StoreConflict(f"array {name!r} under {where} has another layout than its claim; if "
                                "no compute of it is running, delete that uncommitted version folder and rerun.")
        try:
            group.create_array(
                name, shape=shape, dtype=a.dtype,
                chunks=(axis.chunk_rows, *a.shape), shards=(axis.samples_per_shard, *a.shape),
                compressors=zarr_codecs(a.compression), fill_value=0,
                config={"write_empty_chunks": True},
                dimension_names=_dimension_names(name, a),
                attributes={"featstore": {"codec": a.codec, "source": a.source,
                                          **({"output": a.output, "part": a.part, **a.params} if a.output else {})}},
            )
        except zarr.errors.ContainsArrayError:
            pass  # a concurrent run created it a moment ago, from the same claim


def _dimension_names(name: str, a: ArraySpec) -> tuple[str, ...]:
    """``sample`` then ``<name>_1, ...``; the parts of a sparse output share their last axis
    (``logits_k``), so xarray lines ``logits.ids`` and ``logits.values`` up."""
    first = "token" if a.ragged else "sample"
    dims = [first, *(f"{name}_{i}" for i in range(1, 1 + len(a.shape)))]
    if a.output and a.part in ("ids", "values", "counts"):
        dims = [first, *(f"{a.output}_{i}" for i in range(1, len(a.shape))), f"{a.output}_k"]
    return tuple(dims)


def create_views_group(store: Store) -> None:
    """Create the version's group and its views group (each view's group comes with its arrays,
    from :func:`create_arrays`), tolerating a concurrent run that created them first."""
    for mode in ("a", "r+"):
        try:
            zarr.open_group(store, mode=mode).require_group(VIEWS_GROUP)
            return
        except zarr.errors.ContainsGroupError:
            continue  # a concurrent run created the root between look and create


def consolidate(store: Store, groups: Iterable[str]) -> None:
    """Write each group's consolidated metadata into its ``zarr.json`` (``groups``: paths inside
    ``store``, deepest first, ``""`` the root last), so plain zarr and xarray open a version
    without listing its folder, where featstore's own objects (manifest, receipts, records) are
    not Zarr nodes and would each raise a warning. A committed version never changes, so this
    metadata cannot go stale. Zarr's own warnings while consolidating (that listing, and that
    consolidated metadata is not in the v3 core spec) are featstore's business, not the user's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zarr.errors.ZarrUserWarning)
        for path in groups:
            zarr.consolidate_metadata(store, path=path or None)


def consolidated_groups(views: int | None) -> list[str]:
    """The groups of a version to consolidate, deepest first: each view's, the views group, the root.

    >>> consolidated_groups(2)
    ['_views/0', '_views/1', '_views', '']
    """
    if views is None:
        return [""]
    return [*(view_path(v) for v in range(views)), VIEWS_GROUP, ""]


def open_for_write(store: Store, fields: Iterable[str]) -> dict[str, zarr.Array[Any]]:
    """The version's arrays, ready for whole-shard writes."""
    # write_empty_chunks is a runtime setting, lost on reopen: without it an all-fill-value shard
    # is never stored, and a committed version must hold every shard object.
    return {n: zarr.open_array(store, path=n, mode="r+").with_config({"write_empty_chunks": True})
            for n in fields}


# -- reading through zarr ----------------------------------------------------------------------
class StrictStore(zarr.storage.WrapperStore[Store]):
    """Refuses to read a missing or empty chunk object as the fill value (zarr#486)."""

    def __init__(self, store: Store, where: str) -> None:
        super().__init__(store)
        self._where = where

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        buf = await self._store.get(key, prototype, byte_range)
        if "/c/" in key and (buf is None or len(buf) == 0):
            raise CorruptChunk.damaged(self._where, key.split("/c/")[0], key,
                                       "is missing" if buf is None else "is empty")
        return buf

    def _with_store(self, store: Store) -> Self:
        return type(self)(store, self._where)


class MetadataStore(zarr.storage.WrapperStore[Store]):
    """A version folder's Zarr store as featstore reads and writes it: array metadata marked
    (:func:`mark_metadata`) is shown to Zarr unmarked, every ``zarr.json`` written is compact
    (:func:`compact_metadata`) and, with ``mark``, every array metadata written is marked (a
    version whose shards lie elsewhere)."""

    def __init__(self, store: Store, mark: str | None = None) -> None:
        super().__init__(store)
        self._mark = mark

    def _with_store(self, store: Store) -> Self:
        return type(self)(store, self._mark)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataStore) and self._store == other._store and self._mark == other._mark

    def _stored(self, key: str, value: Buffer) -> Buffer:
        if not key.endswith("zarr.json"):
            return value
        raw = value.to_bytes() if self._mark is None else mark_metadata(value.to_bytes(), self._mark)
        return type(value).from_bytes(compact_metadata(raw))

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        buf = await self._store.get(key, prototype, byte_range)
        if buf is not None and byte_range is None and key.endswith("zarr.json"):
            return type(buf).from_bytes(mark_metadata(buf.to_bytes(), None))
        return buf

    async def set(self, key: str, value: Buffer) -> None:
        await self._store.set(key, self._stored(key, value))

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        await self._store.set_if_not_exists(key, self._stored(key, value))

    async def _set_many(self, values: Iterable[tuple[str, Buffer]]) -> None:
        await self._store._set_many([(k, self._stored(k, v)) for k, v in values])


class SpreadStore(zarr.storage.WrapperStore[Store]):
    """The Zarr group at ``group`` (``""`` or ``_views/<v>``) of version folder ``vkey``, whose
    shard objects are spread over ``spread`` prefixes, seen at its usual keys: ``store`` is
    rooted at the store root and every key goes through :func:`spread_key`. Listings merge the
    version's folder and every prefix's folder.

    Plain Zarr reads a spread version through it (``Version.zarr_store()`` builds one):

    >>> group = zarr.open_group(version.zarr_store(), mode="r")
    >>> group["features"][:10]
    """

    def __init__(self, store: Store, vkey: str, spread: int, group: str = "") -> None:
        super().__init__(store)
        self._vkey, self._spread, self._group = vkey, spread, group

    def _with_store(self, store: Store) -> Self:
        return type(self)(store, self._vkey, self._spread, self._group)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, SpreadStore) and self._store == other._store
                and (self._vkey, self._spread, self._group) == (other._vkey, other._spread, other._group))

    def __repr__(self) -> str:
        return f"SpreadStore({self._vkey!r}, spread={self._spread}, group={self._group!r})"

    __str__ = __repr__

    def _rel(self, key: str) -> str:
        return "/".join(p for p in (self._group, key) if p)

    def _key(self, key: str) -> str:
        return spread_key(self._vkey, self._rel(key), self._spread)

    def _homes(self, prefix: str) -> list[str]:
        """Where objects under ``prefix`` may lie: the version's folder, then each prefix's."""
        here = "/".join(p for p in (self._vkey, self._rel(prefix)) if p)
        return [here, *(f"{spread_folder(b)}/{here}" for b in range(self._spread))]

    def _back(self, key: str) -> str:
        """A listed store key -> this group's key for it."""
        inside = logical_key(key)[len(self._vkey) + 1:]
        return inside[len(self._group) + 1:] if self._group else inside

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        return await self._store.get(self._key(key), prototype, byte_range)

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]) -> list[Buffer | None]:
        return await self._store.get_partial_values(prototype, [(self._key(k), r) for k, r in key_ranges])

    async def _get_many(self, requests: Iterable[tuple[str, BufferPrototype, ByteRequest | None]]
                        ) -> AsyncGenerator[tuple[str, Buffer | None], None]:
        back = {}
        mapped = []
        for key, prototype, byte_range in requests:
            back[self._key(key)] = key
            mapped.append((self._key(key), prototype, byte_range))
        async for key, buf in self._store._get_many(mapped):
            yield back[key], buf

    async def exists(self, key: str) -> bool:
        return await self._store.exists(self._key(key))

    async def getsize(self, key: str) -> int:
        return await self._store.getsize(self._key(key))

    async def set(self, key: str, value: Buffer) -> None:
        await self._store.set(self._key(key), value)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        await self._store.set_if_not_exists(self._key(key), value)

    async def _set_many(self, values: Iterable[tuple[str, Buffer]]) -> None:
        await self._store._set_many([(self._key(k), v) for k, v in values])

    async def delete(self, key: str) -> None:
        await self._store.delete(self._key(key))

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for home in self._homes(prefix):
            async for key in self._store.list_prefix(home):
                yield self._back(key)

    async def list(self) -> AsyncIterator[str]:
        async for key in self.list_prefix(""):
            yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        seen: set[str] = set()
        for home in self._homes(prefix):
            try:
                async for name in self._store.list_dir(home):
                    if name not in seen:
                        seen.add(name)
                        yield name
            except FileNotFoundError:
                continue

    async def delete_dir(self, prefix: str) -> None:
        for home in self._homes(prefix):
            await self._store.delete_dir(home)

    async def is_empty(self, prefix: str) -> bool:
        for home in self._homes(prefix):
            if not await self._store.is_empty(home):
                return False
        return True

    async def clear(self) -> None:
        # The wrapped store is the whole store root: clear only this group.
        await self.delete_dir("")


def open_array(store: Store, field: str, spec: ArraySpec, layout: Layout, where: str,
               raw_metadata: Callable[[], bytes | None]) -> zarr.Array[Any]:
    """Open one stored array for reading, its metadata checked before any chunk is decoded.

    ``raw_metadata()`` returns the raw ``zarr.json`` bytes (or None): read only when zarr
    itself cannot parse them, to say "newer format" rather than "damaged" where that is true.
    """
    strict = StrictStore(store, where)
    meta_key = f"{field}/zarr.json"
    try:
        arr = zarr.open_array(strict, path=field, mode="r")
    except FeatstoreError:
        raise
    except FileNotFoundError as exc:
        raise CorruptChunk(f"array {field!r} of version {where} is missing its zarr.json; delete and "
                           "recompute the version.", version=where, array=field, chunk=meta_key) from exc
    except Exception as exc:  # noqa: BLE001 - zarr raises many types on bad metadata
        raw = raw_metadata()
        try:
            meta = None if raw is None else load_json(raw, meta_key)
        except IncompatibleFormat:
            meta = None
        check_array_metadata(meta, spec, layout, version=where, array=field)
        raise CorruptChunk(f"{meta_key} of version {where} cannot be opened ({type(exc).__name__}: "
                           f"{exc}); delete and recompute the version.",
                           version=where, array=field, chunk=meta_key) from exc
    # Validate what zarr parsed (the very metadata it will use) before any chunk is decoded.
    check_array_metadata(arr.metadata.to_dict(), spec, layout, version=where, array=field)
    return arr


# -- metadata validation -----------------------------------------------------------------------
def _plain(obj: object) -> JSON:
    """Parsed metadata as plain JSON types (zarr's ``to_dict`` gives tuples and objects)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def _object(value: JSON) -> JSONObject:
    """``value`` if it is a JSON object, else an empty one (a metadata entry that is not an
    object is then reported as missing its fields)."""
    return value if isinstance(value, dict) else {}


def _codec_names(codecs: JSON) -> list[str]:
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


def check_array_metadata(meta: object, spec: ArraySpec, layout: Layout, *, version: str, array: str) -> None:
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
    axis = layout.of(spec)
    want_shape = [axis.n_samples, *spec.shape]
    want_grid = [axis.samples_per_shard, *spec.shape]
    grid = _object(meta.get("chunk_grid"))
    problems = []
    if fmt != ZARR_FORMAT or meta.get("node_type") != "array":
        problems.append(f"zarr_format={fmt!r}, node_type={meta.get('node_type')!r}")
    if meta.get("data_type") != spec.dtype:
        problems.append(f"data_type {meta.get('data_type')!r} but the manifest says {spec.dtype!r}")
    if meta.get("shape") != want_shape:
        problems.append(f"shape {meta.get('shape')!r} but the manifest says {want_shape}")
    if grid.get("name") != "regular" or _object(grid.get("configuration")).get("chunk_shape") != want_grid:
        problems.append(f"chunk grid {grid!r} is not shards of {want_grid}")
    top = meta.get("codecs")
    sharding = top[0] if isinstance(top, list) and len(top) == 1 else None
    if not (isinstance(sharding, dict) and sharding.get("name") == "sharding_indexed"):
        problems.append("the codec chain is not one sharding codec (featstore writes whole shards)")
    elif (inner := _object(sharding.get("configuration")).get("chunk_shape")) != [axis.chunk_rows, *spec.shape]:
        problems.append(f"inner chunks {inner!r} but the manifest says {[axis.chunk_rows, *spec.shape]}")
    names = _codec_names(meta.get("codecs", []))
    if not names or not set(names) <= ALLOWED_CODECS:
        problems.append(f"codecs {names} (featstore writes only {sorted(ALLOWED_CODECS)})")
    if meta.get("storage_transformers") not in (None, []):
        problems.append("storage transformers are set")
    if problems:
        raise CorruptChunk(f"{where} is not what featstore wrote: {'; '.join(problems)}. Refusing to "
                           "decode its chunks; delete and recompute the version.",
                           version=version, array=array, chunk=f"{array}/zarr.json")
