"""The versions core: every store key, reading a committed version, and the version lifecycle.

Layout under the store root (``_``-prefixed folders can never collide with a name segment)::

    <name>/_versions/<id>/zarr.json, <array>/...   the Zarr v3 group, one array per stored field
    <name>/_versions/<id>/_pending.json             the claim: layout and arrays the first run fixed
    <name>/_versions/<id>/_receipts/<shard>.json    one per finished shard (resume markers)
    <name>/_versions/<id>/_receipts/run-<a>-<b>.json  shards a..b's receipts, compacted by a task
    <name>/_versions/<id>/_records/<k>-<sha>.bin    per-shard digests and stats (schema 2)
    <name>/_versions/<id>/_refs/<sha>.json          "an incremental child reads shards from here"
    <name>/_versions/<id>/manifest.json             written last, create-if-absent: the commit
    <name>/_versions/<id>/_views/<v>/...            with views: view v's arrays and _receipts,
                                                    laid out like a version without views
    <name>/_tags/<tag>.json                         {"version": <id>}: the only mutable pointers
    _spread/<hh>/<name>/_versions/<id>/<array>/c/<shard>/0...   with ``spread_prefixes=N``:
                                                    the shard objects, over N prefixes <hh>

A version id is the first 16 hex digits of its fingerprint, so the same inputs always land on
the same id and a second commit of it is recognised, not duplicated. The lifecycle of a version
is: :meth:`Catalog.claim` (create ``_pending.json`` or join the run that did, create the arrays,
find finished shards) -> shard tasks write data and :func:`write_receipt` -> :meth:`Catalog.commit`
(durable data, then the manifest create-if-absent, adopting an identical concurrent winner).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import shlex
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import zarr

from featstore.codecs._dense import codec_by_name
from featstore.errors import (ComputeFailed, CorruptChunk, FeatstoreError, IncompatibleFormat, InvalidInput,
                              StoreConflict, StoreUnavailable, VersionNotFound)
from featstore.format._zarr import (SPREAD_FOLDER, ChunkRef, MetadataStore, ShardFormat, SpreadStore,
                                    check_array_metadata, chunk_key, consolidate, consolidated_groups, create_arrays,
                                    create_views_group, decode_shard_rows, logical_key, open_array, shard_digest,
                                    shard_index, shard_index_bytes, spread_folder, spread_key, view_path)
from featstore.format._manifests import (RECORDS_PER_OBJECT, ArraySpec, Base, Layout, Manifest, Pending, ReceiptRun,
                                         ShardReceipt, ShardRecords, canonical_json, decode_records, encode_records,
                                         gc_mark_json, load_json, newer_manifest, ref_json, ref_target, tag_json,
                                         tag_target)
from featstore._allowed_names import check_name, check_tag, check_version_id, is_version_id
from featstore.codecs._parts import assemble, parts_codec
from featstore.codecs._ragged import OFFSETS, TOKEN_FIELDS, TOKEN_LENGTH, TOKEN_START, gather_rows, offsets
from featstore.storage._backends import Storage
from featstore.versions._views import view_seed

log = logging.getLogger("featstore")

MANIFEST = "manifest.json"
PENDING = "_pending.json"
#: Written by ``gc`` while it deletes an uncommitted version folder (see :meth:`Catalog.gc`).
GC_MARK = "_gc.json"
RECEIPTS = "_receipts"
RECORDS = "_records"
REFS = "_refs"
#: Concurrent requests for many small objects (receipts, records): S3 latency, not bandwidth,
#: bounds them, so 32 in flight turn 125,000 serial ~10 ms GETs into ~40 s, or runs into <1 s.
IO_THREADS = 32
#: A task compacts its per-shard receipts into one run object every this many shards.
RUN_EVERY = 256


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
    homes = spread_homes(key, spread)
    if len(homes) == 1:
        return set(storage.find(key))
    with ThreadPoolExecutor(min(IO_THREADS, len(homes)), thread_name_prefix="featstore-meta") as pool:
        return {logical_key(k) for found in pool.map(storage.find, homes) for k in found}


def spread_roots(storage: Storage, vkey: str) -> list[str]:
    """The folders under which version folder ``vkey``'s spread shard objects may lie, whatever
    its spread (one listing of the prefixes): what delete removes with the version."""
    return [f"{SPREAD_FOLDER}/{b}/{vkey}" for b in storage.list_dirs(SPREAD_FOLDER) if len(b) == 2]


def receipt_key(vkey: str, index: int) -> str:
    """The store key of shard ``index``'s receipt inside version folder ``vkey``."""
    return f"{vkey}/{RECEIPTS}/{index:06d}.json"


# -- receipts ----------------------------------------------------------------------------------
def write_receipt(storage: Storage, vkey: str, receipt: ShardReceipt) -> None:
    """Record a finished shard; written only once every array of the shard is stored."""
    storage.write_json(receipt_key(vkey, receipt.index), receipt.to_json())


def run_key(vkey: str, first: int, last: int) -> str:
    """The key of a run object holding the receipts of shards ``first..last`` (all of them)."""
    return f"{vkey}/{RECEIPTS}/run-{first:06d}-{last:06d}.json"


def contiguous_runs(indices: Iterable[int]) -> list[tuple[int, int]]:
    """``[(first, last), ...]`` of the maximal runs of consecutive shard indices.

    >>> contiguous_runs([5, 1, 2, 3, 7])
    [(1, 3), (5, 5), (7, 7)]
    """
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return [(a, b) for a, b in runs]


def compact_receipts(storage: Storage, vkey: str, receipts: Sequence[ShardReceipt]) -> None:
    """Replace the per-shard receipts of ``receipts`` by one run object per contiguous run.

    The run is written first and the per-shard objects deleted after (one request per 1,000
    on S3), so a crash in between leaves both forms, which read the same. A resume then lists
    a few run objects instead of one object per shard.
    """
    by_index = {r.index: r for r in receipts}
    for first, last in contiguous_runs(by_index):
        if last == first:
            continue
        run = ReceiptRun(tuple(by_index[i] for i in range(first, last + 1)))
        storage.write_json(run_key(vkey, first, last), run.to_json())
        storage.delete_many([receipt_key(vkey, i) for i in range(first, last + 1)])


class ReceiptRuns:
    """Folds per-shard receipts into run objects every :data:`RUN_EVERY` finished shards (the
    driver feeds it as shard tasks finish): a resume of a 125,000-shard version then lists
    ~500 objects, not 125,000."""

    def __init__(self, storage: Storage, vkey: str) -> None:
        self.storage, self.vkey = storage, vkey
        self.pending: list[ShardReceipt] = []

    def add(self, receipts: Iterable[ShardReceipt]) -> None:
        self.pending.extend(receipts)
        if len(self.pending) >= RUN_EVERY:
            compact_receipts(self.storage, self.vkey, self.pending)
            self.pending = []


def _receipt_objects(storage: Storage, vkey: str) -> dict[str, range]:
    """``{object key: the shards it holds}`` from one listing of the receipts folder (no GETs)."""
    out = {}
    for entry in storage.list_dirs(f"{vkey}/{RECEIPTS}"):
        stem = entry.removesuffix(".json")
        if stem == entry:
            continue
        if stem.isdigit():
            out[f"{vkey}/{RECEIPTS}/{entry}"] = range(int(stem), int(stem) + 1)
            continue
        head, _, rest = stem.partition("-")
        first, _, last = rest.partition("-")
        if head == "run" and first.isdigit() and last.isdigit() and int(first) <= int(last):
            out[f"{vkey}/{RECEIPTS}/{entry}"] = range(int(first), int(last) + 1)
    return out


def finished_shards(storage: Storage, vkey: str) -> set[int]:
    """Shards with a receipt, by name alone: one LIST page per 1,000 objects, no GETs."""
    return {i for shards in _receipt_objects(storage, vkey).values() for i in shards}


def forget_receipts(storage: Storage, vkey: str, indices: Iterable[int]) -> None:
    """Remove the receipts of ``indices`` (their shards must be computed again), from per-shard
    objects and from run objects alike (a run keeps its other shards' receipts, per shard)."""
    drop = set(indices)
    if not drop:
        return
    for key, shards in _receipt_objects(storage, vkey).items():
        if not drop.intersection(shards):
            continue
        obj = storage.read_json(key) if len(shards) > 1 else None
        if obj is not None:
            for r in ReceiptRun.from_json(obj, storage.child_url(key)).receipts:
                if r.index not in drop:
                    write_receipt(storage, vkey, r)
        storage.delete(key)


def read_many(storage: Storage, keys: Sequence[str], threads: int = IO_THREADS) -> dict[str, bytes | None]:
    """Read many small metadata objects concurrently (the latency of S3 GETs overlaps)."""
    def read(key: str) -> bytes | None:
        return storage.read_bytes(key, metadata=True)

    if len(keys) <= 1:
        return {k: read(k) for k in keys}
    with ThreadPoolExecutor(min(threads, len(keys)), thread_name_prefix="featstore-meta") as pool:
        return dict(zip(keys, pool.map(read, keys), strict=True))


def read_receipts(storage: Storage, vkey: str, indices: Iterable[int] | None = None) -> dict[int, ShardReceipt]:
    """The receipts of ``indices`` (None: every receipt there is) that exist, by shard index.

    One listing finds which objects hold them; only those are read, concurrently.
    """
    objects = _receipt_objects(storage, vkey)
    wanted = None if indices is None else set(indices)
    keys = [k for k, shards in objects.items()
            if wanted is None or any(i in wanted for i in shards)]
    out: dict[int, ShardReceipt] = {}
    for key, data in read_many(storage, keys).items():
        if data is None:
            continue  # compacted into a run between the listing and the read: the run has it
        where = storage.child_url(key)
        obj = load_json(data, where)
        got = ReceiptRun.from_json(obj, where).receipts if "receipts" in obj else (ShardReceipt.from_json(obj, where),)
        out.update((r.index, r) for r in got if wanted is None or r.index in wanted)
    missing = [] if wanted is None else sorted(wanted - set(out))
    if missing and any(i in shards for shards in objects.values() for i in missing):
        # A per-shard receipt was compacted after our listing: read again (rare, bounded).
        out.update(read_receipts(storage, vkey, missing))
    return out


# -- shard records (schema 2) ------------------------------------------------------------------
def records_key(vkey: str, k: int, digest: str) -> str:
    """The key of records object ``k`` (content-addressed by its sha256)."""
    return f"{vkey}/{RECORDS}/{k:06d}-{digest[:16]}.bin"


def write_records(storage: Storage, vkey: str, receipts: Sequence[ShardReceipt],
                  fields: Sequence[str]) -> ShardRecords:
    """Store every shard's digests and statistics as fixed-width records; return where."""
    blobs = encode_records(receipts, list(fields), RECORDS_PER_OBJECT)
    digests = [hashlib.sha256(b).hexdigest() for b in blobs]
    jobs = [(records_key(vkey, k, d), b) for k, (d, b) in enumerate(zip(digests, blobs, strict=True))]
    with ThreadPoolExecutor(max(1, min(IO_THREADS, len(jobs))), thread_name_prefix="featstore-meta") as pool:
        list(pool.map(lambda kb: storage.write_bytes(*kb), jobs))
    return ShardRecords(tuple(fields), RECORDS_PER_OBJECT, tuple(digests))


def read_records(storage: Storage, vkey: str, manifest: Manifest, ref: str) -> list[ShardReceipt]:
    """Every shard's receipt of a schema 2 version, from its records objects (checksummed)."""
    rec = manifest.records
    assert rec is not None
    keys = [records_key(vkey, k, d) for k, d in enumerate(rec.objects)]
    got = read_many(storage, keys)
    out: list[ShardReceipt] = []
    for k, key in enumerate(keys):
        data, where = got[key], storage.child_url(key)
        if data is None or hashlib.sha256(data).hexdigest() != rec.objects[k]:
            raise CorruptChunk.damaged(ref, RECORDS, key.rsplit("/", 2)[-2] + "/" + key.rsplit("/", 1)[-1],
                                       "is missing" if data is None else "fails its sha256")
        out += decode_records(data, rec, k * rec.per_object, manifest.layout, where,
                              None if manifest.views is None else manifest.views.count)
    return out


def deleted_while_reading(ref: str) -> VersionNotFound:
    """The error for data that vanished because its version was deleted mid-read."""
    return VersionNotFound(f"version {ref} was deleted (store.delete) while it was being read; its data "
                           "is gone. Open another version (store.versions(name)) and start the epoch again.")


# -- one committed version ---------------------------------------------------------------------
class Version:
    """One committed, immutable version of a feature set.

    >>> v = store.open("cnn-a/train")
    >>> len(v), v.id, sorted(v.manifest.arrays)
    (20000, '3f2a9c0e1b7d4a55', ['features', 'logits', 'target'])
    >>> v[10:20]["features"].shape
    torch.Size([10, 512])
    """

    def __init__(self, storage: Storage, manifest: Manifest) -> None:
        self.storage = storage
        self.manifest = manifest
        self._arrays: dict[Any, zarr.Array] = {}
        self._pid = -1
        self._view: int | None = None  # the view this object reads (see view())
        self._views: dict[int, Version] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"storage": self.storage, "manifest": self.manifest, "view": self._view}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["storage"], state["manifest"])  # type: ignore[misc]
        self._view = state.get("view")

    def __repr__(self) -> str:
        return f"<Version {self.name}@{self.id} samples={len(self)} arrays={sorted(self.manifest.arrays)}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Version) and (self.storage.url, self.name, self.id) == (
            other.storage.url, other.name, other.id)

    def __hash__(self) -> int:
        return hash((self.storage.url, self.name, self.id))

    @property
    def id(self) -> str:
        return self.manifest.id

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def ref(self) -> str:
        """``name@id``: how errors and logs name this version, and what ``store.open`` takes."""
        return f"{self.name}@{self.id}"

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    @property
    def key(self) -> str:
        return version_key(self.name, self.id)

    @property
    def url(self) -> str:
        """The Zarr group's URL: ``zarr.open_group(version.url)`` reads it with plain zarr,
        unless its shard objects are spread over prefixes (``ComputeOptions.spread_prefixes``):
        then use :meth:`zarr_store`."""
        return self.storage.child_url(self.key)

    @property
    def spread(self) -> int:
        """How many prefixes the version's shard objects are spread over (1: its own folder)."""
        return self.manifest.layout.spread

    def zarr_store(self) -> zarr.abc.store.Store:
        """A read-only Zarr store of this version's group (this view's, after :meth:`view`),
        which finds spread shard objects under their prefixes: plain Zarr reads a version
        through it. Not for an incremental version (``extends=``), whose inherited shards lie in
        its parents' folders: that raises :class:`InvalidInput` (read it with featstore, or
        ``load()`` it), rather than give a store in which they would read as zeros.

        >>> group = zarr.open_group(version.zarr_store(), mode="r")
        >>> group["features"][:10].shape
        (10, 512)
        """
        if self.manifest.bases:
            raise InvalidInput(f"{self.ref} extends {self.manifest.bases[0].name}@{self.manifest.bases[0].id}: "
                               "its first shards lie in that version's folder, so no single Zarr group holds it. "
                               "Read it with featstore (store.open(ref)[a:b], .load(), store.dataset(ref)).")
        return group_store(self.storage, self.data_key, self.spread, read_only=True)

    @property
    def data_key(self) -> str:
        """The key of the group whose arrays this object reads: the version's, or its view's."""
        return view_key(self.key, self._view)

    def __len__(self) -> int:
        return self.manifest.n_samples

    # -- augmented views ----------------------------------------------------------------
    @property
    def views(self) -> int | None:
        """How many augmented views per sample the version holds (None: computed without views)."""
        return None if self.manifest.views is None else self.manifest.views.count

    def view(self, view: int) -> "Version":
        """This version reading view ``view``: ``version.view(2)[10:20]``, ``.load()``, ...

        Views are laid out like a version without views, so everything that reads one works.
        """
        if self.views is None or isinstance(view, bool) or not isinstance(view, (int, np.integer)) \
                or not 0 <= int(view) < self.views:
            raise InvalidInput(f"view {view!r} does not exist: {self.ref} has "
                               f"{'no views' if self.views is None else f'views 0..{self.views - 1}'}.")
        if int(view) not in self._views:
            bound = copy.copy(self)
            bound._arrays, bound._pid, bound._view, bound._views = {}, -1, int(view), {}
            self._views[int(view)] = bound
        return self._views[int(view)]

    def view_seed(self, index: int, view: int) -> int:
        """The seed of view ``view`` of sample ``index``: Model A ran on exactly
        ``augment(dataset[index], torch.Generator().manual_seed(version.view_seed(index, view)))``.

        >>> v.view_seed(10, 3)
        5812337108410417153
        """
        if self.manifest.views is None:
            raise InvalidInput(f"{self.ref} was computed without views; it has no view seeds.")
        if not 0 <= view < self.manifest.views.count or not 0 <= index < len(self):
            raise IndexError(f"(index {index}, view {view}) is out of range for {len(self)} samples "
                             f"and {self.manifest.views.count} views")
        return view_seed(self.manifest.views.seed, index, view)

    # -- where shards live (an incremental version reads its bases' shards in place) ----
    def homes(self) -> list[tuple[int, int, str, int]]:
        """``[(first row, stop row, version key, that folder's n_samples), ...]`` in row order:
        the bases' shard ranges, then this version's own shards."""
        spp = self.manifest.layout.samples_per_shard
        out = [(b.first * spp, b.stop * spp, version_key(b.name, b.id), b.n_samples) for b in self.manifest.bases]
        return out + [(self.manifest.own_shards.start * spp, len(self), self.data_key, len(self))]

    def shard_home(self, shard: int) -> str:
        """The key of the version folder that stores shard ``shard`` (the version's own folder
        for a view's shards: :meth:`chunk_key` then starts with ``_views/<v>/``)."""
        for b in self.manifest.bases:
            if b.first <= shard < b.stop:
                return version_key(b.name, b.id)
        return self.key

    def object_key(self, field: str, shard: int) -> str:
        """The store key of the object holding shard ``shard`` of ``field`` (in a base's folder
        for an incremental version's inherited shards, which share its spread; under its
        prefix's folder when the version is spread)."""
        return object_key(self.shard_home(shard), self.chunk_key(field, shard), self.spread)

    def read_shard_rows(self, storage: Storage, field: str, fmt: ShardFormat, shard: int, lo: int, hi: int,
                        out: np.ndarray) -> None:
        """Rows ``[lo, hi)`` of one shard object, decoded into ``out`` (the reader's fast path).

        Most of the shard: one GET of the whole object. A few of its inner chunks (a piece at
        a consumer's edge, or a big object-store shard): the index by a suffix range, then one
        ranged GET of just the chunks that cover the rows, so memory does not grow with the
        shard size.
        """
        key = self.object_key(field, shard)
        ref = ChunkRef(self.ref, field, self.chunk_key(field, shard))
        c0, c1 = lo // fmt.chunk_rows, -(-hi // fmt.chunk_rows)
        if 2 * (c1 - c0) > fmt.chunks_per_shard:
            data = storage.read_bytes(key)
            if not data:
                raise self._missing(ref, data)
            decode_shard_rows(data, fmt, lo, hi, out, ref)
            return
        tail = storage.read_range(key, -shard_index_bytes(fmt))
        if not tail:
            raise self._missing(ref, tail)
        index = shard_index(tail, fmt, ref)
        spans = index[c0:c1]
        start, stop = int(spans[:, 0].min()), int((spans[:, 0] + spans[:, 1]).max())
        if start > stop or stop > 2**62:  # an empty-chunk marker: decode_shard_rows names it
            start, stop = 0, 0
        data = storage.read_range(key, start, stop) if stop > start else b""
        decode_shard_rows(data or b"", fmt, lo, hi, out, ref, index=index, base=start)

    def _missing(self, ref: ChunkRef, data: bytes | None) -> FeatstoreError:
        if data is None and self.was_deleted():
            return deleted_while_reading(self.ref)
        return CorruptChunk.damaged(ref.version, ref.array, ref.chunk, "is missing" if data is None else "is empty")

    def shard_receipts(self) -> list[ShardReceipt]:
        """Every shard's digests and statistics: inline in a schema 1 manifest, read from the
        records objects (a few concurrent GETs) in schema 2. Only verify and compute need them."""
        if self.manifest.shards is not None:
            return list(self.manifest.shards)
        return read_records(self.storage, self.key, self.manifest, self.ref)

    # -- reading ------------------------------------------------------------------------
    def array(self, field: str, home: str | None = None, n_samples: int | None = None) -> zarr.Array:
        """The Zarr array of one field, opened lazily once per process (fork/spawn safe).

        ``home``/``n_samples``: a base's folder and length, for an incremental version's
        inherited shards (default: this version's own folder).
        """
        if self._pid != os.getpid():
            self._arrays, self._pid = {}, os.getpid()
        home = home or self.data_key
        if (home, field) not in self._arrays:
            if field not in self.manifest.arrays:
                raise KeyError(f"version {self.id} has no array {field!r}; it has "
                               f"{sorted(self.manifest.arrays)}")
            if self.views is not None and self._view is None:
                raise InvalidInput(f"{self.ref} holds {self.views} views per sample: pick one with "
                                   "version.view(v) or version[v, rows].")
            layout = replace(self.manifest.layout, n_samples=n_samples or len(self))
            try:
                self._arrays[(home, field)] = open_array(
                    group_store(self.storage, home, self.spread, read_only=True), field, self.manifest.arrays[field],
                    layout, self.ref, lambda: self.storage.read_bytes(f"{home}/{field}/zarr.json", metadata=True))
            except CorruptChunk as exc:  # a missing zarr.json is a deleted version, not damaged data
                if self.was_deleted():
                    raise deleted_while_reading(self.ref) from exc
                raise
        return self._arrays[(home, field)]

    def read_rows(self, field: str, start: int, stop: int) -> np.ndarray:
        """Stored values of rows ``[start, stop)`` of ``field`` (numpy, stored dtype)."""
        return self._read(field, slice(start, stop), start)

    def _read(self, field: str, selection: Any, first_row: int) -> np.ndarray:
        """Read a slice or row list, split by the folder each row's shard lives in."""
        if not self.manifest.bases:
            return self._read_home(field, self.data_key, len(self), selection, first_row)
        if isinstance(selection, slice):
            parts = [self._read_home(field, home, n, slice(max(lo, selection.start), min(hi, selection.stop)),
                                     max(lo, selection.start))
                     for lo, hi, home, n in self.homes() if max(lo, selection.start) < min(hi, selection.stop)]
            if not parts:
                return self._read_home(field, self.data_key, len(self), selection, first_row)
            return parts[0] if len(parts) == 1 else np.concatenate(parts)
        rows = np.asarray(selection, dtype=np.int64).reshape(-1)
        spec = self.manifest.arrays[field]
        out = np.empty((len(rows), *spec.shape), dtype=spec.dtype)
        for lo, hi, home, n in self.homes():
            mask = (rows >= lo) & (rows < hi)
            if mask.any():
                out[mask] = self._read_home(field, home, n, rows[mask], int(rows[mask].min()))
        return out

    def _read_home(self, field: str, home: str, n_samples: int, selection: Any, first_row: int) -> np.ndarray:
        try:
            arr = self.array(field, home, n_samples)
            if isinstance(selection, slice):
                return arr[selection]
            return arr.oindex[selection]
        except CorruptChunk as exc:
            if self.was_deleted():
                raise deleted_while_reading(self.ref) from exc
            raise
        except FeatstoreError:
            raise
        except (ConnectionError, TimeoutError, PermissionError) as exc:
            raise StoreUnavailable(f"reading {self.ref}/{field} failed: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - zarr/numcodecs raise plain errors on bad bytes
            shard = self._bad_shard(field, selection, first_row)
            raise CorruptChunk.damaged(self.ref, field, self.chunk_key(field, shard),
                                       f"failed to decode ({type(exc).__name__}: {exc})") from exc

    def read_tokens(self, field: str, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Stored token rows of a per-token array for samples given by (``token_start``,
        ``token_length``), sample after sample: one read per shard touched."""
        spec = self.manifest.arrays[field]
        rows = gather_rows(starts, lengths)
        out = np.empty((len(rows), *spec.shape), dtype=spec.dtype)
        if not len(rows):
            return out
        shard = rows // spec.tokens[0]
        for s in np.unique(shard):
            sel = shard == s
            lo, hi = int(rows[sel].min()), int(rows[sel].max()) + 1
            out[sel] = self.token_rows(field, int(s), lo, hi)[rows[sel] - lo]
        return out

    def token_rows(self, field: str, shard: int, lo: int, hi: int) -> np.ndarray:
        """Stored rows ``[lo, hi)`` of a per-token array, all in shard ``shard`` (in a base's
        folder for an incremental version's inherited shard); damage is a :class:`CorruptChunk`
        naming that shard."""
        spp = self.manifest.layout.samples_per_shard
        home, n = next(((h, n) for a, b, h, n in self.homes() if a <= shard * spp < b), (self.data_key, len(self)))
        try:
            return self.array(field, home, n)[lo:hi]
        except FeatstoreError:
            raise
        except (ConnectionError, TimeoutError, PermissionError) as exc:
            raise StoreUnavailable(f"reading {self.ref}/{field} failed: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - zarr/numcodecs raise plain errors on bad bytes
            if self.was_deleted():
                raise deleted_while_reading(self.ref) from exc
            raise CorruptChunk.damaged(self.ref, field, self.chunk_key(field, shard),
                                       f"failed to decode ({type(exc).__name__}: {exc})") from exc

    def token_span(self, shard: int) -> tuple[int, int]:
        """The token rows ``[lo, hi)`` shard ``shard`` stores in each per-token array."""
        start, stop = self.manifest.layout.shard_range(shard)
        lengths = self.read_rows(TOKEN_LENGTH, start, stop)
        per_shard = next(a.tokens[0] for a in self.manifest.arrays.values() if a.ragged)
        return shard * per_shard, shard * per_shard + int(lengths.sum(dtype=np.int64))

    def was_deleted(self) -> bool:
        """Whether this version's manifest is gone (``store.delete`` removes it before the data).
        Asked on error paths only, through a storage of this process's own."""
        return not self.storage.reopen().exists(f"{self.key}/{MANIFEST}")

    def _bad_shard(self, field: str, selection: Any, first_row: int) -> int:
        """On a failed multi-shard read, find the shard that fails on its own (error path only)."""
        spp = self.manifest.layout.samples_per_shard
        if isinstance(selection, slice):
            shards = range(selection.start // spp, -(-selection.stop // spp))
        else:
            shards = sorted({int(r) // spp for r in np.asarray(selection).reshape(-1)})
        for shard in shards:
            home = next(key for lo, hi, key, n in self.homes() if lo <= shard * spp < hi)
            n = next(n for lo, hi, key, n in self.homes() if key == home)
            try:
                self.array(field, home, n)[shard * spp:min((shard + 1) * spp, len(self))]
            except Exception:  # noqa: BLE001 - the failing one is what we are looking for
                return shard
        return first_row // spp

    def chunk_key(self, field: str, shard: int) -> str:
        """The key of shard ``shard`` of ``field`` inside the version (one object per shard;
        under ``_views/<v>/`` when this object reads a view)."""
        key = chunk_key(field, shard, len(self.manifest.arrays[field].shape))
        return key if self._view is None else f"{view_path(self._view)}/{key}"

    def decode(self, field: str, stored: np.ndarray) -> torch.Tensor:
        """Stored values -> the tensor a reader gets (see :mod:`featstore.codecs`)."""
        spec = self.manifest.arrays[field]
        if spec.output:  # one part of an output stored in parts: ids as int64, -1 in unused slots
            return parts_codec(spec.codec).decode_part(spec.part, stored)
        return codec_by_name(spec.codec).decode(stored)

    def __getitem__(self, index: Any) -> dict[str, torch.Tensor]:
        """Random access: a dict of tensors (one per array) plus ``index``; ``version[v, rows]``
        reads view ``v`` of a version with views (and adds ``view``)."""
        if isinstance(index, tuple) and len(index) == 2 and self.views is not None:
            out = self.view(index[0])[index[1]]
            out["view"] = torch.full(out["index"].shape, int(index[0]), dtype=torch.int64)
            return out
        n = len(self)
        if isinstance(index, (int, np.integer)):
            i = int(index) + (n if index < 0 else 0)
            if not 0 <= i < n:
                raise IndexError(f"index {index} out of range for {n} samples")
            batch = self[i:i + 1]
            ragged = {f for f, a in self.manifest.arrays.items() if a.ragged}
            # a per-token array's rows are all this sample's tokens: returned whole
            return {k: v if k in ragged else v[0] for k, v in batch.items() if not k.endswith(f".{OFFSETS}")}
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                return self[np.arange(start, stop, step)]
            rows = np.arange(start, max(start, stop))
            stored = {f: self._read(f, slice(start, stop), start)
                      for f, a in self.manifest.arrays.items() if not a.ragged}
        else:
            rows = np.asarray(index, dtype=np.int64).reshape(-1)
            if rows.size and (rows.min() < -n or rows.max() >= n):
                raise IndexError(f"indices out of range for {n} samples")
            rows = np.where(rows < 0, rows + n, rows)
            first = int(rows.min()) if rows.size else 0
            stored = {f: self._read(f, rows, first) for f, a in self.manifest.arrays.items() if not a.ragged}
        out = {f: self.decode(f, v) for f, v in stored.items() if f not in TOKEN_FIELDS}
        out.update(self._ragged(stored))
        out["index"] = torch.from_numpy(rows.astype(np.int64))
        return assemble(self.manifest.arrays, out)

    def _ragged(self, stored: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """The per-token arrays of the samples whose ``token_start``/``token_length`` are in
        ``stored``: flat token rows, and ``<output>.offsets`` per per-token output."""
        ragged = {f: a for f, a in self.manifest.arrays.items() if a.ragged}
        if not ragged:
            return {}
        starts, lengths = stored[TOKEN_START], stored[TOKEN_LENGTH]
        out = {f: self.decode(f, self.read_tokens(f, starts, lengths)) for f in ragged}
        for name in {a.output or f for f, a in ragged.items()}:
            out[f"{name}.{OFFSETS}"] = torch.from_numpy(offsets(lengths))
        return out

    def load(self) -> dict[str, torch.Tensor]:
        """The whole version in RAM as tensors (the classic in-memory cache, from the store)."""
        return self[0:len(self)]

    def verify(self, progress: bool = False) -> list[str]:
        """Check every stored shard against its compute-time digest; see :func:`verify_version`."""
        return verify_version(self, progress)


def verify_version(version: Version, progress: bool = False) -> list[str]:
    """Read every shard of every array and compare it with the digest recorded at compute
    time; return one line per bad shard (empty when the version is intact).

    >>> verify_version(store.open("cnn-a/train"))
    []
    """
    problems = []
    try:
        receipts = version.shard_receipts()
    except CorruptChunk as exc:
        return [f"{RECORDS}: {exc}"]
    it: Iterable[ShardReceipt] = receipts
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(receipts, desc=f"verify {version.ref}", unit="shard")
    for r in it:
        source = version if r.view is None else version.view(r.view)
        for field, digest in r.digests.items():
            home = version.shard_home(r.index)
            where = f"{source.chunk_key(field, r.index)} (rows {r.start}-{r.stop})" + (
                "" if home == version.key else f" in {home}")
            try:
                if version.manifest.arrays[field].ragged:
                    got = shard_digest(source.token_rows(field, r.index, *source.token_span(r.index)))
                else:
                    got = shard_digest(source.read_rows(field, r.start, r.stop))
            except CorruptChunk as exc:
                problems.append(f"{where}: {exc}")
                continue
            if got != digest:
                problems.append(f"{where}: content differs from the digest recorded at compute time")
    return problems


# -- the catalog of a store: listing, resolving, tags, the lifecycle ---------------------------
@dataclass(frozen=True)
class Claim:
    """What a compute run works with once it has claimed (or joined) a version folder."""

    layout: Layout
    arrays: dict[str, ArraySpec]
    done: frozenset[int]
    done_views: frozenset[tuple[int, int]] = frozenset()  # finished (view, shard) units, with views


def _sans_compression(specs: Any) -> Any:
    return {n: {k: v for k, v in a.items() if k != "compression"} for n, a in (specs or {}).items()}


class Catalog:
    """The versions and tags of one store: list, resolve, tag, delete, gc, claim and commit.

    ``version_class`` is what :meth:`open` and :meth:`versions` return (the public face
    subclasses :class:`Version` to add conveniences).
    """

    version_class: type[Version] = Version

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.storage.url!r})"

    @property
    def url(self) -> str:
        return self.storage.url

    def _version(self, manifest: Manifest) -> Version:
        return self.version_class(self.storage, manifest)

    # -- listing --------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Every feature set that has at least one committed version."""
        found = self.storage.find("")
        names = {k.split("/_versions/")[0] for k in found if k.endswith("/" + MANIFEST) and "/_versions/" in k}
        return sorted(names)

    def versions(self, name: str) -> list[Version]:
        """Committed versions of ``name``, oldest first (uncommitted ones are invisible; one whose
        manifest cannot be read is left out and logged: see :meth:`damaged`)."""
        found, damaged = self.scan(name)
        for vid, exc in damaged.items():
            log.warning("skipping version %s@%s: %s", name, vid, exc)
        return found

    def scan(self, name: str) -> tuple[list[Version], dict[str, IncompatibleFormat]]:
        """``(committed versions oldest first, {version id: why its manifest cannot be read})``:
        a damaged manifest (or one of a newer featstore) affects only its own version."""
        base = f"{check_name(name)}/_versions"
        out, damaged = [], {}
        for vid in self.storage.list_dirs(base):
            if not is_version_id(vid):
                continue
            try:
                m = self.read_manifest(name, vid)
            except IncompatibleFormat as exc:
                damaged[vid] = exc
                continue
            if m is not None:
                out.append(self._version(m))
        return sorted(out, key=lambda v: (v.manifest.created_at, v.id)), damaged

    def damaged(self, name: str | None = None) -> dict[str, str]:
        """``{"name@id": what is wrong and what to do}`` for every version (of ``name``, or of every
        feature set) whose manifest exists but cannot be read; remove one with :meth:`delete`
        (``featstore delete URL name@id``) or all with ``gc(damaged=True)``.

        >>> store.damaged()
        {'cnn-a/train@0123456789abcdef': '.../manifest.json is not valid JSON (...) ...'}
        """
        out = {}
        for n in [name] if name is not None else self.names():
            out.update({f"{n}@{vid}": str(exc) for vid, exc in self.scan(n)[1].items()})
        return out

    def committed(self, name: str, vid: str) -> Version | None:
        """``name@vid`` if it is committed, else None (no tag or "newest" resolution)."""
        m = self.read_manifest(name, vid)
        return None if m is None else self._version(m)

    def read_manifest(self, name: str, vid: str) -> Manifest | None:
        """The validated manifest of ``name@vid``, or None while it is not committed; one that
        cannot be read is :class:`IncompatibleFormat` saying how to remove that version."""
        try:
            return self._read_manifest(name, vid)
        except IncompatibleFormat as exc:
            ref = f"{name}@{vid}"
            raise IncompatibleFormat(
                f"{exc} Only version {ref} is affected: `featstore delete {shlex.quote(self.url)} {ref}` (or "
                f"store.delete({ref!r})) removes it; recompute it if you need it.") from exc

    def _read_manifest(self, name: str, vid: str) -> Manifest | None:
        key = f"{version_key(name, vid)}/{MANIFEST}"
        obj = self.storage.read_json(key)
        if obj is None:
            return None
        where = self.storage.child_url(key)
        m = Manifest.from_json(obj, where)
        if (m.name, m.id) != (name, vid):  # a manifest copied or planted under another path
            raise IncompatibleFormat(f"{where} describes {m.name}@{m.id}, not {name}@{vid}; the store "
                                     "is damaged.")
        return m

    def _tag(self, name: str, tag: str) -> str | None:
        """The version id a tag points at (validated), or None if there is no such tag."""
        key = tag_key(name, tag)
        obj = self.storage.read_json(key)
        return None if obj is None else tag_target(obj, self.storage.child_url(key), tag)

    def tags(self, name: str) -> dict[str, str]:
        """``{tag: version id}`` for one feature set."""
        out = {}
        for entry in self.storage.list_dirs(f"{check_name(name)}/_tags"):
            if entry.endswith(".json"):
                try:
                    check_tag(entry[:-5])
                except FeatstoreError:
                    continue  # not a tag featstore wrote: never addressed
                try:
                    vid = self._tag(name, entry[:-5])
                except IncompatibleFormat as exc:  # a damaged tag hides only itself
                    log.warning("skipping tag %s@%s: %s", name, entry[:-5], exc)
                    continue
                if vid is not None:
                    out[entry[:-5]] = vid
        return out

    # -- resolving ------------------------------------------------------------------------
    def open(self, ref: str | Version) -> Version:
        """Resolve ``"name"`` (newest version), ``"name@tag"`` or ``"name@<version id>"``.

        >>> store.open("cnn-a/train@best").id
        '3f2a9c0e1b7d4a55'
        """
        if isinstance(ref, Version):
            return ref
        if not isinstance(ref, str):
            raise InvalidInput(f"expected 'name', 'name@tag' or 'name@id', got {ref!r}")
        name, at, sel = ref.partition("@")
        check_name(name)
        if at and not is_version_id(sel):
            check_tag(sel)
        if not sel:
            versions, damaged = self.scan(name)
            if damaged:
                vid, exc = next(iter(damaged.items()))
                raise IncompatibleFormat(
                    f"the newest version of {name!r} cannot be told: the manifests of {sorted(damaged)} cannot be "
                    f"read ({vid}: {exc}). Open a version by id or tag ({name}@<id>), or remove the damaged ones "
                    f"first (featstore delete URL {name}@<id>).") from exc
            if not versions:
                raise VersionNotFound(
                    f"feature set {name!r} has no committed version in {self.url}; "
                    f"existing sets: {self.names() or 'none'}. Run store.compute({name!r}, ...) first."
                )
            return versions[-1]
        vid = sel if is_version_id(sel) else self._tag(name, sel)
        m = self.read_manifest(name, vid) if vid is not None else None
        if m is not None:
            return self._version(m)
        if vid is not None and not is_version_id(sel):  # a tag left behind by a deleted version
            raise VersionNotFound(f"tag {sel!r} points at version {vid}, which was deleted; move it "
                                  f"(store.tag) or remove it (store.untag({name!r}, {sel!r})).")
        raise VersionNotFound(
            f"{name!r} has no committed version or tag {sel!r}; versions: "
            f"{[v.id for v in self.versions(name)]}, tags: {sorted(self.tags(name))}."
        )

    # -- tags, delete, gc -----------------------------------------------------------------
    def tag(self, version: Version | str, tag: str) -> None:
        """Point ``tag`` at a committed version (moving it if it pointed elsewhere).

        A tag never outlives its version: the tag is written, then the manifest is checked
        again; :meth:`delete` removes the manifest, then sweeps the tags again. Whichever runs
        second sees the other's step, so a tag written during a delete is removed by one of them
        (this call then raises :class:`VersionNotFound` saying the version was deleted).
        """
        v = self.open(version)
        key = tag_key(v.name, tag)
        self.storage.write_json(key, tag_json(v.id))
        if self.read_manifest(v.name, v.id) is None:
            if self._tag(v.name, tag) == v.id:
                self.storage.delete(key)
            raise VersionNotFound(f"version {v.ref} was deleted while it was being tagged {tag!r}; "
                                  "tag another version.")

    def untag(self, name: str, tag: str) -> None:
        """Remove a tag (the version stays)."""
        if not self.storage.exists(tag_key(name, tag)):
            raise VersionNotFound(f"{name!r} has no tag {tag!r}; tags: {sorted(self.tags(name))}")
        self.storage.delete(tag_key(name, tag))

    def delete(self, version: Version | str) -> str:
        """Delete a committed version: its tags first, then its manifest (it becomes invisible
        at once), its tags again (one a concurrent :meth:`tag` wrote meanwhile), then its data,
        unless an incremental child still reads shards from it. A reader still streaming it gets
        :class:`VersionNotFound` saying it was deleted.

        Shared shards stay until no version references them: a parent's data is kept while a
        child (committed or being computed) has a reference marker in it, and deleting the
        last such child removes the parent's data too.

        A version whose manifest is damaged (:meth:`damaged`) is deleted the same way when named by
        id or tag (``"name@id"``). Returns the ``name@id`` deleted.
        """
        try:
            v = self.open(version)
        except IncompatibleFormat:
            target = self._damaged_target(version)
            if target is None:
                raise
            self._delete_folder(*target)
            return "@".join(target)
        self._delete_folder(v.name, v.id)
        for b in reversed(v.manifest.bases):  # a child's folder first: it may hold refs to the parent
            bkey = version_key(b.name, b.id)
            self.storage.delete(ref_key(bkey, v.name, v.id))
            if not self.storage.exists(f"{bkey}/{MANIFEST}"):
                self._drop_if_unreferenced(bkey)
        return v.ref

    def _delete_folder(self, name: str, vid: str) -> bool:
        """Tags, manifest, tags again, then the data unless a child still reads it (see
        :meth:`delete`); whether the data went."""
        vkey = version_key(name, vid)
        self._untag_all(name, vid)
        self.storage.delete(f"{vkey}/{MANIFEST}")
        self._untag_all(name, vid)
        return self._drop_if_unreferenced(vkey)

    def _damaged_target(self, ref: Any) -> tuple[str, str] | None:
        """``(name, id)`` when ``ref`` names one version by id or tag whose manifest exists but
        cannot be read (so :meth:`delete` can still remove it), else None."""
        if not isinstance(ref, str) or "@" not in ref:
            return None
        name, _, sel = ref.partition("@")
        vid = sel if is_version_id(sel) else self._tag(name, sel)
        if vid is None:
            return None
        try:
            self.read_manifest(name, vid)
        except IncompatibleFormat:
            return name, vid
        return None

    def _untag_all(self, name: str, vid: str) -> None:
        for tag, target in self.tags(name).items():
            if target == vid:
                self.storage.delete(tag_key(name, tag))

    def live_refs(self, vkey: str) -> list[str]:
        """``name@id`` of every version that reads shards from folder ``vkey`` and still exists
        (committed, or claimed by a compute that may still commit)."""
        out = []
        keys = [f"{vkey}/{REFS}/{e}" for e in self.storage.list_dirs(f"{vkey}/{REFS}") if e.endswith(".json")]
        for key, data in read_many(self.storage, keys).items():
            if data is None:
                continue
            name, vid = ref_target(load_json(data, self.storage.child_url(key)), self.storage.child_url(key))
            if self.storage.exists(f"{version_key(name, vid)}/{PENDING}") or self.committed(name, vid):
                out.append(f"{name}@{vid}")
        return out

    def _drop_if_unreferenced(self, vkey: str) -> bool:
        refs = self.live_refs(vkey)
        if refs:
            log.info("keeping the data of %s: versions %s read shards from it", vkey, refs)
            return False
        # Spread shard objects first: interrupted here, the folder (with its _pending.json) is
        # still there, and gc finds what is left by its logical keys either way.
        for root in spread_roots(self.storage, vkey):
            self.storage.delete(root, recursive=True)
        self.storage.delete(vkey, recursive=True)
        return True

    def gc(self, older_than: float = 3600.0, dry_run: bool = False, damaged: bool = False) -> list[str]:
        """Delete what no committed version needs, and return the keys deleted.

        ``damaged=True`` also deletes every version whose manifest exists but is damaged (see
        :meth:`damaged`; one written by a newer featstore is kept: upgrade to read it), as
        :meth:`delete` would.

        That is: folders of versions that were never committed (an interrupted ``compute``),
        or were deleted while a child read shards from them and no longer are, whose newest
        object is older than ``older_than`` seconds (younger ones may belong to a compute
        still running, or waiting to be resumed), and temporary ``*.partial`` objects left by a
        killed writer. Committed versions, tags, and folders a live child reads are never touched.

        A compute still running in a folder gc deletes (``older_than=0``, or a run that paused
        longer than ``older_than``) never commits missing data: gc marks the folder
        (``_gc.json``) and checks it is still uncommitted before deleting; the commit checks
        every object after writing its manifest, and withdraws it if a mark or a hole is there
        (the compute then raises :class:`ComputeFailed`; rerunning it recomputes what was
        deleted). See :meth:`commit`.

        >>> store.gc(older_than=24 * 3600)
        ['cnn-a/train/_versions/0123456789abcdef/logits/c/0/0', ...]
        """
        listing = self.storage.find_modified("")
        now = time.time()  # after the listing: an object written while it ran is not "in the future"
        deleted: list[str] = []
        by_version: dict[str, dict[str, float]] = {}
        for key, mtime in listing.items():
            if "/_versions/" in key:  # a spread shard object counts with its version's folder
                vkey, _ = split_version_key(logical_key(key))
                by_version.setdefault(vkey, {})[key] = mtime
            elif key.endswith(".partial") and now - mtime > older_than:
                deleted.append(key)
        if not dry_run:
            self.storage.delete_many(deleted)
        for vkey, members in by_version.items():
            if f"{vkey}/{MANIFEST}" in members:
                target = self._damaged_folder(vkey) if damaged else None
                if target is not None:
                    gone = dry_run or self._delete_folder(*target)
                    deleted.extend(sorted(members) if gone else [f"{vkey}/{MANIFEST}"])
                    continue
                old = sorted(k for k, t in members.items() if ".partial" in k and now - t > older_than)
            elif now - max(members.values()) > older_than and not (
                    any(f"/{REFS}/" in k for k in members) and self.live_refs(vkey)):
                old = sorted(members)
            else:
                continue
            if dry_run or self._gc_folder(vkey, old):
                deleted.extend(old)
        return deleted

    def _damaged_folder(self, vkey: str) -> tuple[str, str] | None:
        """``(name, id)`` of the version in folder ``vkey`` if its manifest is damaged (not merely
        newer than this featstore), else None."""
        name, _, vid = vkey.partition("/_versions/")
        try:
            self.read_manifest(name, vid)
            return None
        except IncompatibleFormat:
            pass
        except FeatstoreError:  # not a folder featstore named (a name it refuses): never touched
            return None
        try:
            newer = newer_manifest(self.storage.read_json(f"{vkey}/{MANIFEST}"))
        except IncompatibleFormat:  # not even JSON
            newer = False
        if newer:
            log.warning("gc keeps %s@%s: its manifest is from a newer featstore (upgrade to read it)", name, vid)
            return None
        return name, vid

    def _gc_folder(self, vkey: str, keys: list[str]) -> bool:
        """Delete ``keys`` of one version folder unless it got committed meanwhile.

        The mark comes first, the look at the manifest second (the commit does the reverse):
        a commit that raced with this either saw the mark or is seen here.
        """
        if all(".partial" in k for k in keys):  # leftovers beside a committed version: no race
            for key in keys:
                self.storage.delete(key)
            return True
        self.storage.write_json(f"{vkey}/{GC_MARK}", gc_mark_json())
        if self.storage.exists(f"{vkey}/{MANIFEST}"):
            self.storage.delete(f"{vkey}/{GC_MARK}")
            return False
        for key in keys:
            self.storage.delete(key)
        self.storage.delete(f"{vkey}/{GC_MARK}")
        return True

    # -- the lifecycle of a version being computed ----------------------------------------
    def claim(self, name: str, vid: str, layout: Layout, arrays: Mapping[str, ArraySpec],
              bases: Sequence[Base] = (), views: int | None = None) -> Claim:
        """Claim the version folder (or join the run that claimed it): the layout and arrays to
        use, and the shards already finished.

        Never deletes data: a concurrent compute of the same fingerprint may be writing here or
        may just have committed (only a receipt whose shard objects are gone is removed). The
        first run creates ``_pending.json`` (create-if-absent) and so fixes the layout; every
        later run (a resume, or a concurrent run) adopts it: same fingerprint, same content, the
        layout only cuts it into shards. Shards with a receipt are skipped (found by listing
        names: no per-shard GET); the rest may be written by several runs at once, with the same
        bytes. An incremental version leaves a reference marker in each base's folder first, so
        deleting a base keeps the shards this version reads; the bases' shards count as done.
        With ``views`` the arrays are created in every view's group and the unit of work (and
        of receipts and resume) is the (view, shard); views and bases never come together.
        """
        key = version_key(name, vid)
        where = self.storage.child_url(f"{key}/{PENDING}")
        mine = Pending.of(layout, dict(arrays))
        claimed = self._pending(key, mine, where)
        if _sans_compression(claimed.arrays) != _sans_compression(mine.arrays):
            raise StoreConflict(
                f"{self.storage.child_url(key)} is being (or was) computed with other arrays "
                f"({sorted(claimed.arrays)}) for the same fingerprint; wait for that run, or delete "
                "the uncommitted version folder if no run is alive, then rerun.")
        # "auto" compression is decided on the probe batch; a resume adopts the founder's choice
        # (a GPU's nondeterminism could tip a borderline array the other way).
        adopted = {n: replace(a, compression=str(claimed.arrays[n].get("compression", "zstd")))
                   for n, a in arrays.items()}
        if claimed.layout != layout:
            log.warning(
                "%s: another run fixed the layout (%d samples per shard, %d prefixes); using it instead of "
                "(%d, %d)", key, claimed.layout.samples_per_shard, claimed.layout.spread,
                layout.samples_per_shard, layout.spread)
        if views is not None:
            create_views_group(group_store(self.storage, key, claimed.layout.spread, read_only=False))
            units = {(v, i) for v in range(views) for i in self._prepare(view_key(key, v), claimed.layout, adopted)}
            return Claim(claimed.layout, adopted, frozenset(), frozenset(units))
        self._reference(name, vid, bases)
        inherited = set(range(bases[-1].stop if bases else 0))
        done = self._prepare(key, claimed.layout, adopted, inherits=bool(bases))
        return Claim(claimed.layout, adopted, frozenset(done | inherited))

    def _prepare(self, key: str, layout: Layout, arrays: Mapping[str, ArraySpec], inherits: bool = False) -> set[int]:
        """Create (or check) the arrays of the group at ``key``; return its finished shards.

        A receipt whose shard objects are gone (a gc ran during an earlier run) is not done;
        it is removed, so no task or commit of this run trusts it.
        """
        create_arrays(group_store(self.storage, key, layout.spread, read_only=False, inherits=inherits),
                      layout, arrays, self.storage.child_url(key))
        done = {i for i in finished_shards(self.storage, key) if i < layout.n_shards}
        holes = _shards_with_holes(key, arrays, done, stored_objects(self.storage, key, layout.spread))
        forget_receipts(self.storage, key, holes)
        return done - holes

    def _reference(self, name: str, vid: str, bases: Sequence[Base]) -> None:
        """Mark each base folder as read by ``name@vid``; refuse a base whose data is gone."""
        for b in bases:
            bkey = version_key(b.name, b.id)
            self.storage.write_json(ref_key(bkey, name, vid), ref_json(name, vid))
            if not self.storage.exists(f"{bkey}/{PENDING}"):
                self.storage.delete(ref_key(bkey, name, vid))
                raise VersionNotFound(f"{b.name}@{b.id}, which {name}@{vid} extends, was deleted; "
                                      "compute the dataset without extends, or from another parent.")

    def _pending(self, key: str, mine: Pending, where: str) -> Pending:
        """Create the claim, or read the one another run created first."""
        if self.storage.create(f"{key}/{PENDING}", canonical_json(mine.to_json())):
            return mine
        obj = self.storage.read_json(f"{key}/{PENDING}")
        # None: removed by a run that committed in between; that commit will be adopted.
        return mine if obj is None else Pending.from_json(obj, where)

    def collect_receipts(self, name: str, vid: str, layout: Layout, fresh: Sequence[ShardReceipt],
                         inherited: Sequence[ShardReceipt] = (), views: int | None = None) -> list[ShardReceipt]:
        """Every shard's receipt for the commit: inherited from the bases, this run's, and
        earlier runs' from the store (one listing, then concurrent reads of the few objects).
        With ``views``: every (view, shard) unit's, view-major (the records order)."""
        if views is None:
            return self._collect(version_key(name, vid), layout, fresh, inherited)
        return [r for v in range(views)
                for r in self._collect(view_key(version_key(name, vid), v), layout, [r for r in fresh if r.view == v])]

    def _collect(self, key: str, layout: Layout, fresh: Sequence[ShardReceipt],
                 inherited: Sequence[ShardReceipt] = ()) -> list[ShardReceipt]:
        """The receipts of every shard of the group at ``key``, in shard order."""
        by_index = {r.index: r for r in inherited}
        by_index.update((r.index, r) for r in fresh)
        missing = [i for i in range(layout.n_shards) if i not in by_index]
        if missing:
            by_index.update(read_receipts(self.storage, key, missing))
        for i in missing:
            if i not in by_index:
                raise ComputeFailed(f"shard {i} of {key} has no receipt after the run; rerun compute.")
        # A receipt for other rows than this layout's shard was written under another layout
        # (a second claim of the folder): its shard cannot be committed as this one's.
        foreign = [i for i in range(layout.n_shards) if (by_index[i].start, by_index[i].stop) != layout.shard_range(i)]
        if foreign:
            forget_receipts(self.storage, key, foreign)
            raise ComputeFailed(f"the receipts of shards {foreign[:10]} of {key} are for other rows than "
                                f"{layout.samples_per_shard} samples per shard: another run wrote them with "
                                "another layout; nothing was committed. Rerun compute: those shards are recomputed.")
        return [by_index[i] for i in range(layout.n_shards)]

    def write_records(self, name: str, vid: str, receipts: Sequence[ShardReceipt],
                      fields: Sequence[str]) -> ShardRecords:
        """Store the per-shard records of a version about to be committed (before its manifest)."""
        key = version_key(name, vid)
        bad = [(r.view, r.index) if r.view is not None else r.index for r in receipts if set(r.digests) != set(fields)]
        if bad:
            raise ComputeFailed(f"the receipts of shards {bad[:10]} of {key} name other arrays than "
                                f"{sorted(fields)}; delete {key}/{RECEIPTS} and rerun compute.")
        return write_records(self.storage, key, receipts, fields)

    def commit(self, manifest: Manifest) -> Version:
        """Make the version visible: its data durable first, then the manifest, created
        if absent. An identical concurrent run that committed first is adopted; a different
        manifest under the same id is a :class:`StoreConflict`.

        Never commits missing data: every object the manifest names is checked on storage
        before the manifest is written, and again after it, together with the mark a running
        ``gc`` leaves (it marks, then looks for a manifest; this writes the manifest, then looks
        for a mark: one of the two sees the other). A hole or a mark withdraws the manifest and
        raises :class:`ComputeFailed`; the receipts of damaged shards are removed, so a rerun
        recomputes exactly those.
        """
        key = version_key(manifest.name, manifest.id)
        if manifest.layout.spread == 1 and not manifest.bases:  # else plain Zarr must not open it
            consolidate(group_store(self.storage, key, 1, read_only=False),
                        consolidated_groups(None if manifest.views is None else manifest.views.count))
        for home in spread_homes(key, manifest.layout.spread):
            self.storage.sync(home)  # the data must be durable before the commit makes it visible
        for b in manifest.bases:  # deleted during the compute: the marker kept the data, but say so
            if not self.storage.exists(f"{version_key(b.name, b.id)}/{PENDING}"):
                raise VersionNotFound(f"{b.name}@{b.id}, which this version extends, is gone; "
                                      "compute without extends.")
        self._check_stored(manifest)
        try:
            self.storage.create_json(f"{key}/{MANIFEST}", manifest.to_json())
        except StoreConflict:
            winner = self.read_manifest(manifest.name, manifest.id)
            if winner is None or winner.fingerprint != manifest.fingerprint:
                raise
            return self._version(winner)  # an identical concurrent run committed first: adopt it
        if self.storage.exists(f"{key}/{GC_MARK}"):
            self.storage.delete(f"{key}/{MANIFEST}")
            raise ComputeFailed(f"store.gc was deleting {manifest.name}@{manifest.id} while it was computed; "
                                "nothing was committed. Rerun compute: what gc deleted is recomputed.")
        try:
            self._check_stored(manifest)
        except ComputeFailed:
            self.storage.delete(f"{key}/{MANIFEST}")
            raise
        # _pending.json stays: deleting it would let a late concurrent run re-claim a committed folder.
        return self._version(manifest)

    def _check_stored(self, manifest: Manifest) -> None:
        """Raise :class:`ComputeFailed` unless every object of ``manifest`` is on storage and
        every array's stored metadata is the manifest's layout (every view's, with views)."""
        vkey = version_key(manifest.name, manifest.id)
        have = stored_objects(self.storage, vkey, manifest.layout.spread)
        views: list[int | None] = [None] if manifest.views is None else list(range(manifest.views.count))
        for view in views:
            self._check_group(manifest, view_key(vkey, view), have)
            self._check_layout(manifest, view_key(vkey, view))

    def _check_layout(self, manifest: Manifest, key: str) -> None:
        """Raise :class:`ComputeFailed` unless each array's ``zarr.json`` in the group at ``key``
        describes the manifest's layout (shape, shard and chunk rows, dtype, codecs): a version
        whose metadata another writer changed would be committed unreadable (issue 20)."""
        found = read_many(self.storage, [f"{key}/{a}/zarr.json" for a in manifest.arrays])
        ref, bad = f"{manifest.name}@{manifest.id}", []
        for (name, spec), data in zip(manifest.arrays.items(), found.values(), strict=True):
            try:
                meta = None if data is None else load_json(data, self.storage.child_url(f"{key}/{name}/zarr.json"))
                check_array_metadata(meta, spec, manifest.layout, version=ref, array=name)
            except (CorruptChunk, IncompatibleFormat) as exc:
                bad.append(f"{name}: {exc}")
        if bad:
            raise ComputeFailed(
                f"the stored arrays of {ref} do not match the layout this run computed "
                f"({manifest.layout.samples_per_shard} samples per shard, {manifest.layout.chunk_rows} per chunk): "
                f"{bad[0]}{' (and more)' if len(bad) > 1 else ''}. Another writer changed them: nothing was "
                "committed. If no other compute of it is running, delete the uncommitted version folder "
                "and rerun compute.")

    def _check_group(self, manifest: Manifest, key: str, have: set[str]) -> None:
        """Raise :class:`ComputeFailed` unless every array object of the group at ``key`` is in ``have``."""
        meta = [f"{key}/zarr.json", *(f"{key}/{a}/zarr.json" for a in manifest.arrays)]
        shards = set(manifest.own_shards)  # a base's shards live in its folder, kept by a reference
        holes = _shards_with_holes(key, manifest.arrays, shards, have)
        missing = [k for k in meta if k not in have] + [
            f"{key}/{chunk_key(a, i, len(spec.shape))}" for i in sorted(holes) for a, spec in manifest.arrays.items()
            if f"{key}/{chunk_key(a, i, len(spec.shape))}" not in have]
        if not missing:
            return
        forget_receipts(self.storage, key, holes)  # those shards must be computed again
        shown = ", ".join(k[len(key) + 1:] for k in missing[:4]) + (", ..." if len(missing) > 4 else "")
        raise ComputeFailed(
            f"{len(missing)} objects of {manifest.name}@{manifest.id} were deleted while it was computed "
            f"({shown}), by store.gc or another process; nothing was committed. Rerun compute: the "
            "shards still stored are kept, the others are recomputed.")


def _shards_with_holes(vkey: str, arrays: Mapping[str, ArraySpec], shards: Iterable[int], have: set[str]) -> set[int]:
    """The shards among ``shards`` that lack an object of some array in the listing ``have``."""
    return {i for i in shards for a, spec in arrays.items()
            if f"{vkey}/{chunk_key(a, i, len(spec.shape))}" not in have}
