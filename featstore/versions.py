"""The versions core: every store key, reading a committed version, and the version lifecycle.

Layout under the store root (``_``-prefixed folders can never collide with a name segment)::

    <name>/_versions/<id>/zarr.json, <array>/...   the Zarr v3 group, one array per stored field
    <name>/_versions/<id>/_pending.json             the claim: layout and arrays the first run fixed
    <name>/_versions/<id>/_receipts/<shard>.json    one per finished shard (resume markers)
    <name>/_versions/<id>/manifest.json             written last, create-if-absent: the commit
    <name>/_versions/<id>/_views/<v>/...            with views: view v's arrays and _receipts,
                                                    laid out like a version without views
    <name>/_tags/<tag>.json                         {"version": <id>}: the only mutable pointers

A version id is the first 16 hex digits of its fingerprint, so the same inputs always land on
the same id and a second commit of it is recognised, not duplicated. The lifecycle of a version
is: :meth:`Catalog.claim` (create ``_pending.json`` or join the run that did, create the arrays,
find finished shards) -> shard tasks write data and :func:`write_receipt` -> :meth:`Catalog.commit`
(durable data, then the manifest create-if-absent, adopting an identical concurrent winner).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import zarr

from .codecs import codec_by_name
from .errors import (ComputeFailed, CorruptChunk, FeatstoreError, IncompatibleFormat, InvalidInput, StoreConflict,
                     StoreUnavailable, VersionNotFound)
from .format import chunk_key, create_arrays, create_views_group, open_array, shard_digest, view_path
from .manifest import ArraySpec, Layout, Manifest, Pending, ShardReceipt, canonical_json, tag_json, tag_target
from .names import check_name, check_tag, check_version_id, is_version_id
from .storage import Storage
from .views import view_seed

log = logging.getLogger("featstore")

MANIFEST = "manifest.json"
PENDING = "_pending.json"
RECEIPTS = "_receipts"


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


def view_key(vkey: str, view: int | None) -> str:
    """The key of the group holding view ``view``'s arrays and receipts (``vkey`` itself for None).

    >>> view_key("cnn-a/train/_versions/0123456789abcdef", 2)
    'cnn-a/train/_versions/0123456789abcdef/_views/2'
    """
    return vkey if view is None else f"{vkey}/{view_path(view)}"


def receipt_key(vkey: str, index: int) -> str:
    """The store key of shard ``index``'s receipt inside version folder ``vkey``."""
    return f"{vkey}/{RECEIPTS}/{index:06d}.json"


# -- receipts ----------------------------------------------------------------------------------
def write_receipt(storage: Storage, vkey: str, receipt: ShardReceipt) -> None:
    """Record a finished shard; written only once every array of the shard is stored."""
    storage.write_json(receipt_key(vkey, receipt.index), receipt.to_json())


def read_receipts(storage: Storage, vkey: str, indices: Iterable[int] | None = None) -> dict[int, ShardReceipt]:
    """The receipts of ``indices`` (None: every receipt there is) that exist, by shard index."""
    if indices is None:
        names = [e for e in storage.list_dirs(f"{vkey}/{RECEIPTS}") if e.endswith(".json")]
        keys = [f"{vkey}/{RECEIPTS}/{e}" for e in names]
    else:
        keys = [receipt_key(vkey, i) for i in indices]
    out = {}
    for key in keys:
        obj = storage.read_json(key)
        if obj is not None:
            r = ShardReceipt.from_json(obj, storage.child_url(key))
            out[r.index] = r
    return out


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
        self._arrays: dict[str, zarr.Array] = {}
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
        """The Zarr group's URL: ``zarr.open_group(version.url)`` reads it with plain zarr."""
        return self.storage.child_url(self.key)

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

    # -- reading ------------------------------------------------------------------------
    def array(self, field: str) -> zarr.Array:
        """The Zarr array of one field, opened lazily once per process (fork/spawn safe)."""
        if self._pid != os.getpid():
            self._arrays, self._pid = {}, os.getpid()
        if field not in self._arrays:
            if field not in self.manifest.arrays:
                raise KeyError(f"version {self.id} has no array {field!r}; it has "
                               f"{sorted(self.manifest.arrays)}")
            if self.views is not None and self._view is None:
                raise InvalidInput(f"{self.ref} holds {self.views} views per sample: pick one with "
                                   "version.view(v) or version[v, rows].")
            key = self.data_key
            self._arrays[field] = open_array(
                self.storage.zarr_store(key, read_only=True), field, self.manifest.arrays[field],
                self.manifest.layout, self.ref, lambda: self.storage.read_bytes(f"{key}/{field}/zarr.json"))
        return self._arrays[field]

    def read_rows(self, field: str, start: int, stop: int) -> np.ndarray:
        """Stored values of rows ``[start, stop)`` of ``field`` (numpy, stored dtype)."""
        return self._read(field, slice(start, stop), start)

    def _read(self, field: str, selection: Any, first_row: int) -> np.ndarray:
        arr = self.array(field)
        try:
            if isinstance(selection, slice):
                return arr[selection]
            return arr.oindex[selection]
        except FeatstoreError:
            raise
        except (ConnectionError, TimeoutError, PermissionError) as exc:
            raise StoreUnavailable(f"reading {self.ref}/{field} failed: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - zarr/numcodecs raise plain errors on bad bytes
            shard = self._bad_shard(field, selection, first_row)
            raise CorruptChunk.damaged(self.ref, field, self.chunk_key(field, shard),
                                       f"failed to decode ({type(exc).__name__}: {exc})") from exc

    def _bad_shard(self, field: str, selection: Any, first_row: int) -> int:
        """On a failed multi-shard read, find the shard that fails on its own (error path only)."""
        spp = self.manifest.layout.samples_per_shard
        if isinstance(selection, slice):
            shards = range(selection.start // spp, -(-selection.stop // spp))
        else:
            shards = sorted({int(r) // spp for r in np.asarray(selection).reshape(-1)})
        for shard in shards:
            try:
                self.array(field)[shard * spp:min((shard + 1) * spp, len(self))]
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
        return codec_by_name(self.manifest.arrays[field].codec).decode(stored)

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
            return {k: v[0] for k, v in batch.items()}
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                return self[np.arange(start, stop, step)]
            rows = np.arange(start, max(start, stop))
            out = {f: self.decode(f, self._read(f, slice(start, stop), start))
                   for f in self.manifest.arrays}
        else:
            rows = np.asarray(index, dtype=np.int64).reshape(-1)
            if rows.size and (rows.min() < -n or rows.max() >= n):
                raise IndexError(f"indices out of range for {n} samples")
            rows = np.where(rows < 0, rows + n, rows)
            first = int(rows.min()) if rows.size else 0
            out = {f: self.decode(f, self._read(f, rows, first)) for f in self.manifest.arrays}
        out["index"] = torch.from_numpy(rows.astype(np.int64))
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
    receipts = version.manifest.shards
    it: Iterable[ShardReceipt] = receipts
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(receipts, desc=f"verify {version.ref}", unit="shard")
    for r in it:
        source = version if r.view is None else version.view(r.view)
        for field, digest in r.digests.items():
            where = f"{source.chunk_key(field, r.index)} (rows {r.start}-{r.stop})"
            try:
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
        """Committed versions of ``name``, oldest first (uncommitted ones are invisible)."""
        base = f"{check_name(name)}/_versions"
        out = []
        for vid in self.storage.list_dirs(base):
            if not is_version_id(vid):
                continue
            m = self.read_manifest(name, vid)
            if m is not None:
                out.append(self._version(m))
        return sorted(out, key=lambda v: (v.manifest.created_at, v.id))

    def committed(self, name: str, vid: str) -> Version | None:
        """``name@vid`` if it is committed, else None (no tag or "newest" resolution)."""
        m = self.read_manifest(name, vid)
        return None if m is None else self._version(m)

    def read_manifest(self, name: str, vid: str) -> Manifest | None:
        """The validated manifest of ``name@vid``, or None while it is not committed."""
        key = f"{version_key(name, vid)}/{MANIFEST}"
        obj = self.storage.read_json(key)
        if obj is None:
            return None
        where = self.storage.child_url(key)
        m = Manifest.from_json(obj, where)
        if (m.name, m.id) != (name, vid):  # a manifest copied or planted under another path
            raise IncompatibleFormat(f"{where} describes {m.name}@{m.id}, not {name}@{vid}; the store "
                                     "is damaged. Delete that version folder.")
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
                vid = self._tag(name, entry[:-5])
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
            versions = self.versions(name)
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
        raise VersionNotFound(
            f"{name!r} has no committed version or tag {sel!r}; versions: "
            f"{[v.id for v in self.versions(name)]}, tags: {sorted(self.tags(name))}."
        )

    # -- tags, delete, gc -----------------------------------------------------------------
    def tag(self, version: Version | str, tag: str) -> None:
        """Point ``tag`` at a committed version (moving it if it pointed elsewhere)."""
        v = self.open(version)
        self.storage.write_json(tag_key(v.name, tag), tag_json(v.id))

    def untag(self, name: str, tag: str) -> None:
        """Remove a tag (the version stays)."""
        if not self.storage.exists(tag_key(name, tag)):
            raise VersionNotFound(f"{name!r} has no tag {tag!r}; tags: {sorted(self.tags(name))}")
        self.storage.delete(tag_key(name, tag))

    def delete(self, version: Version | str) -> None:
        """Delete a committed version: its tags first, then its manifest (it becomes invisible
        at once), then its data."""
        v = self.open(version)
        for tag, vid in self.tags(v.name).items():
            if vid == v.id:
                self.storage.delete(tag_key(v.name, tag))
        self.storage.delete(f"{v.key}/{MANIFEST}")
        self.storage.delete(v.key, recursive=True)

    def gc(self, older_than: float = 3600.0, dry_run: bool = False) -> list[str]:
        """Delete what no committed version needs, and return the keys deleted.

        That is: folders of versions that were never committed (an interrupted ``compute``)
        whose newest object is older than ``older_than`` seconds (younger ones may belong to a
        compute still running, or waiting to be resumed), and temporary ``*.partial`` objects
        left by a killed writer. Committed versions and tags are never touched.

        >>> store.gc(older_than=24 * 3600)
        ['cnn-a/train/_versions/0123456789abcdef/logits/c/0/0', ...]
        """
        now = time.time()
        deleted: list[str] = []
        by_version: dict[str, dict[str, float]] = {}
        for key, mtime in self.storage.find_modified("").items():
            if "/_versions/" in key:
                name, rest = key.split("/_versions/", 1)
                by_version.setdefault(f"{name}/_versions/{rest.split('/', 1)[0]}", {})[key] = mtime
            elif key.endswith(".partial") and now - mtime > older_than:
                deleted.append(key)
        for vkey, members in by_version.items():
            if f"{vkey}/{MANIFEST}" not in members:
                if now - max(members.values()) > older_than:
                    deleted.extend(sorted(members))
            else:
                deleted.extend(k for k, t in members.items() if ".partial" in k and now - t > older_than)
        if not dry_run:
            for key in deleted:
                self.storage.delete(key)
        return deleted

    # -- the lifecycle of a version being computed ----------------------------------------
    def claim(self, name: str, vid: str, layout: Layout, arrays: Mapping[str, ArraySpec],
              views: int | None = None) -> Claim:
        """Claim the version folder (or join the run that claimed it): the layout and arrays to
        use, and the shards already finished.

        Never deletes anything: a concurrent compute of the same fingerprint may be writing
        here or may just have committed. The first run creates ``_pending.json``
        (create-if-absent) and so fixes the layout; every later run (a resume, or a concurrent
        run) adopts it: same fingerprint, same content, the layout only cuts it into shards.
        Shards with a receipt are skipped; the rest may be written by several runs at once,
        with the same bytes. With ``views`` the arrays are created in every view's group and
        the unit of work (and of receipts) is the (view, shard).
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
                "%s: another run fixed the layout (%d samples per shard); using it instead of %d",
                key, claimed.layout.samples_per_shard, layout.samples_per_shard)
        if views is None:
            return Claim(claimed.layout, adopted, frozenset(self._prepare(key, claimed.layout, adopted)))
        create_views_group(self.storage.zarr_store(key, read_only=False))
        units = {(v, i) for v in range(views)
                 for i in self._prepare(view_key(key, v), claimed.layout, adopted)}
        return Claim(claimed.layout, adopted, frozenset(), frozenset(units))

    def _prepare(self, key: str, layout: Layout, arrays: Mapping[str, ArraySpec]) -> set[int]:
        """Create (or check) the arrays of the group at ``key``; return its finished shards."""
        create_arrays(self.storage.zarr_store(key, read_only=False), layout, arrays, self.storage.child_url(key))
        return {i for i, r in read_receipts(self.storage, key).items()
                if (r.start, r.stop) == layout.shard_range(i) and set(r.digests) == set(arrays)}

    def _pending(self, key: str, mine: Pending, where: str) -> Pending:
        """Create the claim, or read the one another run created first."""
        if self.storage.create(f"{key}/{PENDING}", canonical_json(mine.to_json())):
            return mine
        obj = self.storage.read_json(f"{key}/{PENDING}")
        # None: removed by a run that committed in between; that commit will be adopted.
        return mine if obj is None else Pending.from_json(obj, where)

    def collect_receipts(self, name: str, vid: str, layout: Layout, fresh: Sequence[ShardReceipt],
                         views: int | None = None) -> list[ShardReceipt]:
        """Every (view, shard) unit's receipt for the commit, in manifest order: this run's, and
        earlier runs' from the store."""
        key = version_key(name, vid)
        out = []
        for view in [None] if views is None else range(views):
            vk = view_key(key, view)
            by_index = {r.index: r for r in fresh if r.view == view}
            missing = [i for i in range(layout.n_shards) if i not in by_index]
            by_index.update(read_receipts(self.storage, vk, missing))
            for i in missing:
                if i not in by_index:
                    raise ComputeFailed(f"shard {i} of {vk} has no receipt after the run; rerun compute.")
            out += [by_index[i] for i in range(layout.n_shards)]
        return out

    def commit(self, manifest: Manifest) -> Version:
        """Make the version visible: its data durable first, then the manifest, created
        if absent. An identical concurrent run that committed first is adopted; a different
        manifest under the same id is a :class:`StoreConflict`."""
        key = version_key(manifest.name, manifest.id)
        self.storage.sync(key)  # the data must be durable before the commit makes it visible
        try:
            self.storage.create_json(f"{key}/{MANIFEST}", manifest.to_json())
        except StoreConflict:
            winner = self.read_manifest(manifest.name, manifest.id)
            if winner is None or winner.fingerprint != manifest.fingerprint:
                raise
            return self._version(winner)  # an identical concurrent run committed first: adopt it
        # _pending.json stays: deleting it would let a late concurrent run re-claim a committed folder.
        return self._version(manifest)
