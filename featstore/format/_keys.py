"""Where things lie inside a version's Zarr group, and their digests.

- **Keys.** Shard ``s`` of field ``f`` is the object ``f/c/<s>/0/...`` (:func:`chunk_key`).
  With ``Layout.spread`` = N > 1 the shard objects (only they: metadata, receipts and the
  manifest stay in the version's folder) lie under N top-level prefixes of the store,
  ``_spread/<2 hex digits>/<version folder>/f/c/<s>/0``, so S3 can serve each prefix's request
  budget separately. :func:`spread_key` is the one mapping (:class:`SpreadStore` in
  :mod:`._arrays` shows Zarr the version at its usual keys).
- **The mapped mark.** ``featstore.mapped`` in a ``zarr.json`` marks versions whose shards lie
  elsewhere (:func:`mark_metadata`; :class:`._arrays.MetadataStore` shows Zarr the default).
- **Views.** A version with K augmented views holds view ``v`` in the group ``_views/<v>``
  (:func:`view_path`), laid out exactly like a version without views.
- **Digests.** A shard's digest is the sha256 of its stored values (:func:`shard_digest`).
"""

from __future__ import annotations

import hashlib
import json
import re

from featstore.errors import InvalidInput
from featstore.format._manifests import MAX_SPREAD
from featstore._lazy import np  # imported on first use: the quick commands never need it


#: Batch keys the reader adds itself; no stored array may take them.
RESERVED_FIELDS = ("index",)
#: The group of a version's augmented views ("_" never starts a field name, so it cannot clash).
VIEWS_GROUP = "_views"
ZARR_FORMAT = 3
ALLOWED_CODECS = frozenset({"sharding_indexed", "bytes", "zstd", "crc32c"})


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
#: reads through :class:`._arrays.MetadataStore`, which shows Zarr the default encoding.
MAPPED_ENCODING = "featstore.mapped"


def compact_metadata(raw: bytes) -> bytes:
    """A ``zarr.json`` as featstore stores it: without the indentation Zarr writes, a third of
    its bytes (an array of a soft-label output has ~2 KB of metadata, 2 B a token in a version
    of 1,000 tokens); anything that is not JSON passes unchanged.

    >>> compact_metadata(b'{\n  "node_type": "array"\n}')
    b'{"node_type":"array"}'
    """
    try:
        meta = json.loads(raw)
    except ValueError:
        return raw  # not JSON: Zarr reports the damage itself
    return json.dumps(meta, separators=(",", ":"), allow_nan=True).encode()


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
