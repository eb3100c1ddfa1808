"""Every store key: where a version, its tags, receipts, records, refs, views and spread objects
lie under the store root (the layout is in :mod:`featstore.versions`' docstring).
"""


from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from featstore.format import SPREAD_FOLDER, logical_key, spread_folder, spread_key, view_path
from featstore._allowed_names import check_name, check_tag, check_version_id
from featstore.storage import Storage

if TYPE_CHECKING:
    import zarr.abc.store


MANIFEST = "manifest.json"
PENDING = "_pending.json"
#: Written by ``gc`` while it deletes an uncommitted version folder (see :meth:`Commits.delete_uncommitted`).
GC_MARK = "_gc.json"
RECEIPTS = "_receipts"
RECORDS = "_records"
REFS = "_refs"
#: Concurrent requests for many small objects (receipts, records): S3 latency, not bandwidth,
#: bounds them, so 32 in flight turn 125,000 serial ~10 ms GETs into ~40 s, or runs into <1 s.
IO_THREADS = 32
#: A task compacts its per-shard receipts into one run object every this many shards.
RUN_EVERY = 256

T = TypeVar("T")
R = TypeVar("R")


def concurrently(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(x) for x in items]`` with up to :data:`IO_THREADS` requests in flight (one runs here)."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(IO_THREADS, len(items)), thread_name_prefix="featstore-meta") as pool:
        return list(pool.map(fn, items))


# -- keys --------------------------------------------------------------------------------------
def version_key(name: str, vid: str) -> str:
    """The store key of a version's folder.

    >>> version_key("cnn-a/train", "0123456789abcdef")
    'cnn-a/train/_versions/0123456789abcdef'
    """
    return f"{check_name(name)}/_versions/{check_version_id(vid)}"


def tag_key(name: str, tag: str) -> str:
    """The store key of a tag object."""
    return f"{check_name(name)}/_tags/{check_tag(tag)}.json"


def ref_key(vkey: str, name: str, vid: str) -> str:
    """The key of the marker that version ``name@vid`` reads shards from folder ``vkey``."""
    return f"{vkey}/{REFS}/{hashlib.sha256(f'{name}@{vid}'.encode()).hexdigest()[:24]}.json"


def view_key(vkey: str, view: int | None) -> str:
    """The key of the group holding view ``view``'s arrays and receipts (``vkey`` itself for None).

    >>> view_key("cnn-a/train/_versions/0123456789abcdef", 2)
    'cnn-a/train/_versions/0123456789abcdef/_views/2'
    """
    return vkey if view is None else f"{vkey}/{view_path(view)}"


def split_version_key(key: str) -> tuple[str, str]:
    """``(version folder, the rest)`` of a key inside a version folder.

    >>> split_version_key("cnn-a/train/_versions/0123456789abcdef/_views/2")
    ('cnn-a/train/_versions/0123456789abcdef', '_views/2')
    """
    name, _, rest = key.partition("/_versions/")
    vid, _, inner = rest.partition("/")
    return f"{name}/_versions/{vid}", inner


def object_key(key: str, rel: str, spread: int) -> str:
    """The store key of object ``rel`` of the group at ``key`` (a version folder or its view's
    group), whose version spreads its shard objects over ``spread`` prefixes.

    >>> object_key("a/_versions/0123456789abcdef/_views/1", "features/c/0/0", 1)
    'a/_versions/0123456789abcdef/_views/1/features/c/0/0'
    """
    vkey, group = split_version_key(key)
    return spread_key(vkey, "/".join(p for p in (group, rel) if p), spread)


def group_store(storage: Storage, key: str, spread: int, *, read_only: bool,
                inherits: bool = False) -> zarr.abc.store.Store:
    """The Zarr store of the group at ``key`` (a version folder or its view's group): the folder
    itself when ``spread`` is 1, else a :class:`SpreadStore` over the store root that finds the
    shard objects under their prefixes; seen through a :class:`MetadataStore`, which marks the
    array metadata it writes where some shards lie elsewhere (spread, or ``inherits`` from a
    parent), so plain Zarr on the folder fails loudly instead of reading those as zeros."""
    from featstore.format import MetadataStore, SpreadStore  # zarr: not for the quick commands

    if spread <= 1:
        inner = storage.zarr_store(key, read_only=read_only)
    else:
        vkey, group = split_version_key(key)
        inner = SpreadStore(storage.zarr_store("", read_only=read_only), vkey, spread, group)
    why = ("shards spread over prefixes" if spread > 1 else None) or (
        "inherits shards from a parent version (extends=)" if inherits else None)
    return MetadataStore(inner, why)


def spread_homes(key: str, spread: int) -> list[str]:
    """The folders holding objects of the group at ``key``: its own, then one per prefix."""
    return [key, *(f"{spread_folder(b)}/{key}" for b in range(spread if spread > 1 else 0))]


def stored_objects(storage: Storage, key: str, spread: int) -> set[str]:
    """Every object under ``key``, spread ones included, by :func:`logical_key` (one listing
    per folder, run concurrently)."""
    return {logical_key(k) for found in concurrently(storage.find, spread_homes(key, spread)) for k in found}


def spread_roots(storage: Storage, vkey: str) -> list[str]:
    """The folders under which version folder ``vkey``'s spread shard objects may lie, whatever
    its spread (one listing of the prefixes): what delete removes with the version."""
    return [f"{SPREAD_FOLDER}/{b}/{vkey}" for b in storage.list_dirs(SPREAD_FOLDER) if len(b) == 2]


def receipt_key(vkey: str, index: int) -> str:
    """The store key of shard ``index``'s receipt inside version folder ``vkey``."""
    return f"{vkey}/{RECEIPTS}/{index:06d}.json"
