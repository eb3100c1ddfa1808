"""Everything featstore writes into Zarr, and everything it accepts back: one module.

- **Arrays.** One Zarr v3 array per stored field, all sharing axis 0 (the sample). Axis 0 is
  cut into shards of ``Layout.samples_per_shard`` rows (one object each, which one task writes
  whole) and inner chunks of ``Layout.chunk_rows`` rows; every chunk carries a crc32c, after
  zstd where zstd pays (:func:`choose_compression`). Missing chunks are never read as the fill
  value (:class:`StrictStore`), and an all-fill shard is still stored (``write_empty_chunks``).
- **Keys.** Shard ``s`` of field ``f`` is the object ``f/c/<s>/0/...`` (:func:`chunk_key`).
  With ``Layout.spread`` = N > 1 the shard objects (only they: metadata, receipts and the
  manifest stay in the version's folder) lie under N top-level prefixes of the store,
  ``_spread/<2 hex digits>/<version folder>/f/c/<s>/0``, so S3 can serve each prefix's request
  budget separately. :func:`spread_key` is the one mapping; :class:`SpreadStore` shows Zarr the
  version at its usual keys.
- **Views.** A version with K augmented views holds view ``v`` in the group ``_views/<v>``
  (:func:`view_path`), laid out exactly like a version without views (same arrays, shards and
  keys under that prefix), so an epoch that reads one view reads a single-view version's bytes.
- **Digests.** A shard's digest is the sha256 of its stored values (:func:`shard_digest`).
- **The fast decoder.** :func:`decode_shard_rows` reads rows straight out of one shard object's
  bytes, without zarr's event loop (the reader's hot path); :func:`shard_format` says whether an
  array has exactly the layout it understands.
- **Validation.** :func:`check_array_metadata` refuses any ``zarr.json`` featstore would not
  write, before a single chunk is decoded (a planted one could name any codec).
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr
import zarr.errors
import zarr.storage
from zarr.codecs import Crc32cCodec, ZstdCodec

from featstore.errors import CorruptChunk, FeatstoreError, IncompatibleFormat, InvalidInput, StoreConflict
from featstore._json import load_json
from featstore.format._manifests import MAX_SPREAD, ArraySpec, Layout

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
#: Batch keys the reader adds itself; no stored array may take them.
RESERVED_FIELDS = ("index",)
#: The group of a version's augmented views ("_" never starts a field name, so it cannot clash).
VIEWS_GROUP = "_views"
ZARR_FORMAT = 3
ALLOWED_CODECS = frozenset({"sharding_indexed", "bytes", "zstd", "crc32c"})


# -- compression policy ------------------------------------------------------------------------
def zarr_codecs(compression: str = "zstd") -> list:
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


# -- keys and digests --------------------------------------------------------------------------
def chunk_key(field: str, shard: int, ndim: int) -> str:
    """The key, inside a version, of shard ``shard`` of ``field`` (``ndim`` per-sample dims).

    >>> chunk_key("features", 3, 1)
    'features/c/3/0'
    """
    return "/".join([field, "c", str(shard), *["0"] * ndim])


#: The store-root folder holding spread shard objects ("_" never starts a feature-set name).
SPREAD_FOLDER = "_spread"
#: A shard object's key inside a version folder: ``[_views/<v>/]<field>/c/<shard>/0...``.
_SHARD_OBJECT = re.compile(r"(?:_views/(?P<view>[0-9]+)/)?[A-Za-z][A-Za-z0-9_]*/c/(?P<shard>[0-9]+)(?:/[0-9]+)*")


def spread_folder(prefix: int) -> str:
    """The folder of spread prefix ``prefix`` (0 <= prefix < 256).

    >>> spread_folder(11)
    '_spread/0b'
    """
    if not 0 <= prefix < MAX_SPREAD:
        raise ValueError(f"spread prefix {prefix} is out of range")
    return f"{SPREAD_FOLDER}/{prefix:02x}"


def spread_prefix(vid: str, view: int | None, shard: int, spread: int) -> int:
    """Which of ``spread`` prefixes holds shard ``shard`` (of view ``view``) of version ``vid``.

    Round robin from an offset hashed from (version id, view): every prefix gets the same number
    of a version's shards (within one) and any run of consecutive shards touches as many
    prefixes as it can, while different versions start at different prefixes. A hash per shard
    would leave a 100-shard version on 16 prefixes with some holding twice the mean.

    >>> [spread_prefix("0123456789abcdef", None, s, 4) for s in range(6)]
    [3, 0, 1, 2, 3, 0]
    """
    offset = int.from_bytes(hashlib.sha256(f"{vid}/{view}".encode()).digest()[:8], "big")
    return (offset + shard) % spread


def spread_key(vkey: str, rel: str, spread: int) -> str:
    """The store key of object ``rel`` (e.g. ``features/c/3/0``, ``_views/2/logits/zarr.json``)
    of the version folder ``vkey``: the only place where spreading maps a key.

    With ``spread`` <= 1, or for anything but a shard object, that is ``<vkey>/<rel>``; a shard
    object of a spread version goes under its prefix's folder (:func:`spread_prefix`).

    >>> spread_key("a/_versions/0123456789abcdef", "features/c/3/0", 1)
    'a/_versions/0123456789abcdef/features/c/3/0'
    >>> spread_key("a/_versions/0123456789abcdef", "features/c/3/0", 4)
    '_spread/02/a/_versions/0123456789abcdef/features/c/3/0'
    >>> spread_key("a/_versions/0123456789abcdef", "features/zarr.json", 4)
    'a/_versions/0123456789abcdef/features/zarr.json'
    """
    key = f"{vkey}/{rel}" if rel else vkey
    match = _SHARD_OBJECT.fullmatch(rel) if spread > 1 else None
    if match is None:
        return key
    view = None if match["view"] is None else int(match["view"])
    vid = vkey.rsplit("/", 1)[-1]
    return f"{spread_folder(spread_prefix(vid, view, int(match['shard']), spread))}/{key}"


#: The chunk key encoding declared on disk by the arrays of a version whose shards do not all
#: lie in its own folder (spread over prefixes, or inherited from a parent with ``extends``): no
#: Zarr reader knows it, so plain Zarr opening the folder fails loudly ("Unknown chunk key
#: encoding") instead of reading the shards it cannot find as fill values (zeros). featstore
#: reads through :class:`MetadataStore`, which shows Zarr the default encoding.
MAPPED_ENCODING = "featstore.mapped"


def mark_metadata(raw: bytes, why: str | None) -> bytes:
    """An array's ``zarr.json`` as stored for a version whose shards lie elsewhere (``why``
    says where), or, with ``why=None``, as Zarr must see it; anything else passes unchanged.

    >>> import json
    >>> meta = b'{"node_type": "array", "chunk_key_encoding": {"name": "default"}}'
    >>> json.loads(mark_metadata(meta, "spread"))["chunk_key_encoding"]["name"]
    'featstore.mapped'
    >>> mark_metadata(mark_metadata(meta, "spread"), None) == meta
    True
    """
    try:
        meta = json.loads(raw)
    except ValueError:
        return raw  # not JSON: Zarr reports the damage itself
    enc = meta.get("chunk_key_encoding") if isinstance(meta, dict) and meta.get("node_type") == "array" else None
    if not isinstance(enc, dict):
        return raw
    if why is not None and enc.get("name") == "default":
        meta["chunk_key_encoding"] = {"name": MAPPED_ENCODING, "configuration": {
            "encoding": enc, "why": why,
            "read_with": "featstore: featstore.open_store(url).open(ref) (or its .zarr_store() for plain Zarr)"}}
    elif why is None and enc.get("name") == MAPPED_ENCODING:
        meta["chunk_key_encoding"] = (enc.get("configuration") or {}).get("encoding", {"name": "default"})
    else:
        return raw
    return json.dumps(meta).encode()


class MetadataStore(zarr.storage.WrapperStore):
    """A version folder's Zarr store as featstore reads and writes it: array metadata marked
    (:func:`mark_metadata`) is shown to Zarr unmarked, and, with ``mark``, every array metadata
    written is marked (a version whose shards lie elsewhere)."""

    def __init__(self, store: Any, mark: str | None = None) -> None:
        super().__init__(store)
        self._mark = mark

    def _with_store(self, store: Any) -> "MetadataStore":
        return type(self)(store, self._mark)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataStore) and self._store == other._store and self._mark == other._mark

    def _stored(self, key: str, value: Any) -> Any:
        if self._mark is None or not key.endswith("zarr.json"):
            return value
        return type(value).from_bytes(mark_metadata(value.to_bytes(), self._mark))

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        buf = await self._store.get(key, prototype, byte_range)
        if buf is not None and byte_range is None and key.endswith("zarr.json"):
            return type(buf).from_bytes(mark_metadata(buf.to_bytes(), None))
        return buf

    async def set(self, key: str, value: Any) -> None:
        await self._store.set(key, self._stored(key, value))

    async def set_if_not_exists(self, key: str, value: Any) -> None:
        await self._store.set_if_not_exists(key, self._stored(key, value))

    async def _set_many(self, values: Iterable[tuple[str, Any]]) -> None:
        await self._store._set_many([(k, self._stored(k, v)) for k, v in values])


def logical_key(key: str) -> str:
    """The key an object has inside its version folder's tree, spread or not (the inverse of
    :func:`spread_key`: listings group and compare objects by it).

    >>> logical_key("_spread/0b/a/_versions/0123456789abcdef/features/c/3/0")
    'a/_versions/0123456789abcdef/features/c/3/0'
    >>> logical_key("a/_versions/0123456789abcdef/manifest.json")
    'a/_versions/0123456789abcdef/manifest.json'
    """
    head, folder, rest = (key.split("/", 2) + ["", ""])[:3]
    return rest if head == SPREAD_FOLDER and len(folder) == 2 and rest else key


def view_path(view: int) -> str:
    """The group, inside a version, holding augmented view ``view`` (view-major: every sample's
    view ``v`` together, in arrays of the same layout as a version without views).

    >>> view_path(3)
    '_views/3'
    """
    if isinstance(view, bool) or not isinstance(view, int) or view < 0:
        raise InvalidInput(f"a view is a non-negative int, got {view!r}")
    return f"{VIEWS_GROUP}/{view}"


def shard_digest(values: np.ndarray) -> str:
    """sha256 of a shard's stored values (what receipts record and ``verify`` recomputes)."""
    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()


# -- writing -----------------------------------------------------------------------------------
def create_arrays(store: zarr.abc.store.Store, layout: Layout, arrays: Mapping[str, ArraySpec],
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
            if existing.shape == shape and existing.shards == (axis.samples_per_shard, *a.shape):
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


def create_views_group(store: zarr.abc.store.Store) -> None:
    """Create the version's group and its views group (each view's group comes with its arrays,
    from :func:`create_arrays`), tolerating a concurrent run that created them first."""
    for mode in ("a", "r+"):
        try:
            zarr.open_group(store, mode=mode).require_group(VIEWS_GROUP)
            return
        except zarr.errors.ContainsGroupError:
            continue  # a concurrent run created the root between look and create


def consolidate(store: zarr.abc.store.Store, groups: Iterable[str]) -> None:
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


def open_for_write(store: zarr.abc.store.Store, fields: Any) -> dict[str, zarr.Array]:
    """The version's arrays, ready for whole-shard writes."""
    # write_empty_chunks is a runtime setting, lost on reopen: without it an all-fill-value shard
    # is never stored, and a committed version must hold every shard object.
    return {n: zarr.open_array(store, path=n, mode="r+").with_config({"write_empty_chunks": True})
            for n in fields}


# -- reading through zarr ----------------------------------------------------------------------
class StrictStore(zarr.storage.WrapperStore):
    """Refuses to read a missing or empty chunk object as the fill value (zarr#486)."""

    def __init__(self, store: Any, where: str) -> None:
        super().__init__(store)
        self._where = where

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        buf = await self._store.get(key, prototype, byte_range)
        if "/c/" in key and (buf is None or len(buf) == 0):
            raise CorruptChunk.damaged(self._where, key.split("/c/")[0], key,
                                       "is missing" if buf is None else "is empty")
        return buf

    def _with_store(self, store: Any) -> "StrictStore":
        return type(self)(store, self._where)


class SpreadStore(zarr.storage.WrapperStore):
    """The Zarr group at ``group`` (``""`` or ``_views/<v>``) of version folder ``vkey``, whose
    shard objects are spread over ``spread`` prefixes, seen at its usual keys: ``store`` is
    rooted at the store root and every key goes through :func:`spread_key`. Listings merge the
    version's folder and every prefix's folder.

    Plain Zarr reads a spread version through it (``Version.zarr_store()`` builds one):

    >>> group = zarr.open_group(version.zarr_store(), mode="r")
    >>> group["features"][:10]
    """

    def __init__(self, store: Any, vkey: str, spread: int, group: str = "") -> None:
        super().__init__(store)
        self._vkey, self._spread, self._group = vkey, spread, group

    def _with_store(self, store: Any) -> "SpreadStore":
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

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        return await self._store.get(self._key(key), prototype, byte_range)

    async def get_partial_values(self, prototype: Any, key_ranges: Any) -> Any:
        return await self._store.get_partial_values(prototype, [(self._key(k), r) for k, r in key_ranges])

    async def _get_many(self, requests: Any) -> Any:
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

    async def set(self, key: str, value: Any) -> None:
        await self._store.set(self._key(key), value)

    async def set_if_not_exists(self, key: str, value: Any) -> None:
        await self._store.set_if_not_exists(self._key(key), value)

    async def _set_many(self, values: Iterable[tuple[str, Any]]) -> None:
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


def open_array(store: zarr.abc.store.Store, field: str, spec: ArraySpec, layout: Layout, where: str,
               raw_metadata: Any) -> zarr.Array:
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
    axis = layout.of(spec)
    want_shape = [axis.n_samples, *spec.shape]
    want_grid = [axis.samples_per_shard, *spec.shape]
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
    elif (top[0].get("configuration") or {}).get("chunk_shape") != [axis.chunk_rows, *spec.shape]:
        problems.append(f"inner chunks {(top[0].get('configuration') or {}).get('chunk_shape')!r} but the "
                        f"manifest says {[axis.chunk_rows, *spec.shape]}")
    names = _codec_names(meta.get("codecs", []))
    if not names or not set(names) <= ALLOWED_CODECS:
        problems.append(f"codecs {names} (featstore writes only {sorted(ALLOWED_CODECS)})")
    if meta.get("storage_transformers") not in (None, []):
        problems.append("storage transformers are set")
    if problems:
        raise CorruptChunk(f"{where} is not what featstore wrote: {'; '.join(problems)}. Refusing to "
                           "decode its chunks; delete and recompute the version.",
                           version=version, array=array, chunk=f"{array}/zarr.json")


# -- the reader's fast path: whole shard objects decoded without zarr -------------------------
_EMPTY = np.uint64(2**64 - 1)


@dataclass(frozen=True)
class ShardFormat:
    """What the reader needs to decode one shard object of an array written by featstore.

    Only the exact codec chain :func:`zarr_codecs` writes inside a ``sharding_indexed`` codec
    (little-endian bytes, zstd or nothing, crc32c; index little-endian + crc32c at the end) qualifies; any
    other array is read through zarr.
    """

    chunk_rows: int
    row_shape: tuple[int, ...]
    dtype: str
    chunks_per_shard: int
    compressed: bool = True  # zstd before the crc32c; False: the chunk bytes are the values

    @property
    def row_bytes(self) -> int:
        """Bytes of one row's values."""
        return int(np.prod(self.row_shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def stored_stride(self) -> int:
        """Bytes from one uncompressed chunk to the next in a stored shard: its values, then its
        crc32c."""
        return self.chunk_rows * self.row_bytes + 4


def shard_format(array: zarr.Array) -> ShardFormat | None:
    """The :class:`ShardFormat` of ``array``, or None when it is not featstore's exact layout."""
    try:
        from zarr.codecs import BytesCodec, ShardingCodec
        from zarr.codecs.sharding import ShardingCodecIndexLocation

        codecs = array.metadata.codecs
        if len(codecs) != 1 or not isinstance(codecs[0], ShardingCodec):
            return None
        sc = codecs[0]
        inner, index = sc.codecs, sc.index_codecs
        little = "little"
        compressed = len(inner) == 3
        ok = (len(inner) in (2, 3) and isinstance(inner[0], BytesCodec)
              and str(getattr(inner[0].endian, "value", "")) == little
              and (not compressed or isinstance(inner[1], ZstdCodec)) and isinstance(inner[-1], Crc32cCodec)
              and len(index) == 2 and isinstance(index[0], BytesCodec)
              and str(getattr(index[0].endian, "value", "")) == little and isinstance(index[1], Crc32cCodec)
              and sc.index_location == ShardingCodecIndexLocation.end
              and tuple(sc.chunk_shape[1:]) == tuple(array.shape[1:]))
        if not ok:
            return None
        dtype = np.dtype(array.dtype)
        if dtype.byteorder == ">":
            return None
        shard_rows = int(array.metadata.chunk_grid.chunk_shape[0])
        if shard_rows % int(sc.chunk_shape[0]):
            return None
        return ShardFormat(int(sc.chunk_shape[0]), tuple(int(s) for s in array.shape[1:]), dtype.str,
                           shard_rows // int(sc.chunk_shape[0]), compressed)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class ChunkRef:
    """Where a shard object lives, for the error that names it: ``name@id``, field, object key."""

    version: str = "?"
    array: str = "?"
    chunk: str = "?"


def _damaged(ref: ChunkRef, what: str) -> CorruptChunk:
    return CorruptChunk.damaged(ref.version, ref.array, ref.chunk, f"failed to decode: {what}")


def _check_crc(data: memoryview, what: str, ref: ChunkRef) -> memoryview:
    import crc32c

    if len(data) < 4:
        raise _damaged(ref, f"{what} is truncated ({len(data)} bytes)")
    body, tail = data[:-4], data[-4:]
    if crc32c.crc32c(body) != int.from_bytes(tail, "little"):
        raise _damaged(ref, f"{what} fails its crc32c checksum")
    return body


def shard_index_bytes(fmt: ShardFormat) -> int:
    """Bytes of a shard object's index (at its end): 16 per inner chunk plus a crc32c."""
    return 16 * fmt.chunks_per_shard + 4


def shard_index(tail: bytes | memoryview, fmt: ShardFormat, ref: ChunkRef = ChunkRef()) -> np.ndarray:
    """The (offset, size) of each inner chunk, from the last bytes of a shard object (checked)."""
    view = memoryview(tail)
    index_bytes = shard_index_bytes(fmt)
    if len(view) < index_bytes:
        raise _damaged(ref, f"shard object is truncated ({len(view)} bytes, index needs {index_bytes})")
    return np.frombuffer(_check_crc(view[-index_bytes:], "shard index", ref), dtype="<u8").reshape(
        fmt.chunks_per_shard, 2)


def shard_intact(data: bytes | memoryview, fmt: ShardFormat) -> bool:
    """Whether a whole shard object passes every check the decoder makes short of decoding:
    its index's crc32c, and each stored chunk inside the object with its crc32c (what a disk
    cache checks before it keeps an object). Chunks the index marks absent (the last shard's,
    past the array's end) are the decoder's to judge: it refuses any that holds rows."""
    import crc32c

    view = memoryview(data)
    try:
        index = shard_index(view, fmt)
    except CorruptChunk:
        return False
    end = len(view) - shard_index_bytes(fmt)
    for off, size in index.tolist():
        if off == int(_EMPTY):
            continue
        if size < 4 or off + size > end:
            return False
        chunk = view[off:off + size]
        if crc32c.crc32c(chunk[:-4]) != int.from_bytes(chunk[-4:], "little"):
            return False
    return True


def decode_shard_rows(data: bytes, fmt: ShardFormat, lo: int, hi: int,
                      out: np.ndarray | None = None, ref: ChunkRef = ChunkRef(),
                      index: np.ndarray | None = None, base: int = 0) -> np.ndarray:
    """Rows ``[lo, hi)`` (shard-local) of one shard object, written into ``out`` when given
    (``hi - lo`` rows of the stored dtype: saves the reader a copy) and returned.

    Decodes only the inner chunks that cover the rows, checks every crc32c, and raises
    :class:`CorruptChunk` naming ``ref`` on any damage (never returns fill values for a missing
    chunk). ``data`` is the whole object, or, with ``index`` (from :func:`shard_index`), only its
    bytes from offset ``base`` on that cover the rows (a ranged read of a big shard).
    """
    import numcodecs

    view = memoryview(data)
    if index is None:
        index = shard_index(view, fmt, ref)
        end = len(view) - shard_index_bytes(fmt)
    else:
        end = base + len(view)
    dtype = np.dtype(fmt.dtype)
    row_items = int(np.prod(fmt.row_shape, dtype=np.int64)) if fmt.row_shape else 1
    zstd = numcodecs.Zstd()
    c0, c1 = lo // fmt.chunk_rows, -(-hi // fmt.chunk_rows)
    if out is None:
        out = np.empty((hi - lo, *fmt.row_shape), dtype=dtype.newbyteorder("="))
    elif out.shape != (hi - lo, *fmt.row_shape):
        raise ValueError(f"out has shape {out.shape}, expected {(hi - lo, *fmt.row_shape)}")
    for c in range(c0, c1):
        off, size = index[c]
        if off == _EMPTY or int(off) < base or int(off) + int(size) > end:
            raise _damaged(ref, f"chunk {c} of the shard is missing or out of bounds")
        body = _check_crc(view[int(off) - base:int(off) - base + int(size)], f"chunk {c}", ref)
        r0 = max(lo - c * fmt.chunk_rows, 0)
        r1 = min(hi - c * fmt.chunk_rows, fmt.chunk_rows)
        o0 = c * fmt.chunk_rows + r0 - lo
        if fmt.compressed and r1 - r0 == fmt.chunk_rows and out[o0:o0 + r1 - r0].flags.c_contiguous:
            _decode_into(zstd, body, out[o0:o0 + r1 - r0], c, ref)  # no temporary: the rows it fills
            continue
        if fmt.compressed:
            try:
                raw = zstd.decode(body)
            except Exception as exc:  # noqa: BLE001 - numcodecs raises plain errors on bad frames
                raise _damaged(ref, f"chunk {c} does not decompress: {exc}") from exc
        else:
            raw = body  # the values themselves: copied once, straight into ``out``
        if len(raw) % dtype.itemsize:
            raise _damaged(ref, f"chunk {c} holds {len(raw)} bytes, not a whole number of values")
        arr = np.frombuffer(raw, dtype=dtype)
        if arr.size != fmt.chunk_rows * row_items:
            raise _damaged(ref, f"chunk {c} holds {arr.size} values, expected {fmt.chunk_rows * row_items}")
        out[o0:o0 + r1 - r0] = arr.reshape(fmt.chunk_rows, *fmt.row_shape)[r0:r1]
    return out


def _decode_into(zstd: Any, body: memoryview, dest: np.ndarray, c: int, ref: ChunkRef) -> None:
    """Decompress one whole chunk straight into ``dest`` (exactly its size, or it is damaged)."""
    if _zstd_content_size(body) != dest.nbytes:
        raise _damaged(ref, f"chunk {c} does not hold {dest.nbytes} bytes of values")
    try:
        zstd.decode(body, out=dest.reshape(-1).view(np.uint8))
    except Exception as exc:  # noqa: BLE001 - numcodecs raises plain errors on bad frames
        raise _damaged(ref, f"chunk {c} does not decompress: {exc}") from exc


def _zstd_content_size(frame: memoryview) -> int | None:
    """The decompressed size a zstd frame header declares (None when it declares none)."""
    if len(frame) < 6 or bytes(frame[:4]) != b"\x28\xb5\x2f\xfd":
        return None
    desc = frame[4]
    fcs_flag, single, dict_flag = desc >> 6, (desc >> 5) & 1, desc & 3
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if size == 0 or len(frame) < pos + size:
        return None
    value = int.from_bytes(frame[pos:pos + size], "little")
    return value + 256 if size == 2 else value


def mapped_chunks(data: Any, fmt: ShardFormat, n_chunks: int, verify: Iterable[int],
                  ref: ChunkRef = ChunkRef()) -> np.ndarray | None:
    """The first ``n_chunks`` chunks of an uncompressed shard as one ``(chunks, chunk_rows,
    *row_shape)`` array *on* ``data`` (a memory-mapped shard object: no copy), after checking
    the crc32c of the index and of each chunk in ``verify``; None when the shard is compressed
    or its chunks are not laid out back to back (read it with :func:`decode_shard_rows` then).

    Raises :class:`CorruptChunk` naming ``ref`` on damage.
    """
    if fmt.compressed:
        return None
    view = memoryview(data)
    index = shard_index(view, fmt, ref)
    dtype = np.dtype(fmt.dtype)
    row_bytes, stride = fmt.row_bytes, fmt.stored_stride
    want = np.arange(n_chunks, dtype=np.uint64) * np.uint64(stride)
    if (n_chunks > len(index) or not np.array_equal(index[:n_chunks, 0], want)
            or not np.all(index[:n_chunks, 1] == stride) or n_chunks * stride > len(view) - len(index) * 16 - 4):
        return None
    for c in verify:
        _check_crc(view[c * stride:(c + 1) * stride], f"chunk {c}", ref)
    inner = [dtype.itemsize * int(np.prod(fmt.row_shape[i + 1:], dtype=np.int64)) for i in range(len(fmt.row_shape))]
    return np.ndarray((n_chunks, fmt.chunk_rows, *fmt.row_shape), dtype=dtype, buffer=view,
                      strides=(stride, row_bytes, *inner))
