"""The catalog of a store's versions: list, resolve, tags, delete, gc (:class:`Catalog`).

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
is: :meth:`Commits.claim` (create ``_pending.json`` or join the run that did, create the arrays,
find finished shards) -> shard tasks write data and :func:`write_receipt` -> :meth:`Commits.commit`
(durable data, then the manifest create-if-absent, adopting an identical concurrent winner).
The catalog holds that protocol as :attr:`Catalog.commits`; the keys, receipts and the
committed :class:`StoredVersion` are in their own modules beside it.
"""

from __future__ import annotations

import logging
import time

from featstore.errors import FeatstoreError, IncompatibleFormat, InvalidInput, VersionNotFound
from featstore.format import logical_key
from featstore.format import newer_manifest
from featstore.format import tag_json, tag_target
from featstore._allowed_names import check_name, check_tag, is_version_id
from featstore.storage import Storage
from featstore.versions._keys import MANIFEST, REFS, ref_key, split_version_key, spread_roots, tag_key, version_key
from featstore.versions._committed import HasStoredVersion, StoredVersion, read_manifest, stored
from featstore.versions._commits import Commits

log = logging.getLogger("featstore")

#: What names one version: ``"name"`` (its newest), ``"name@tag"``, ``"name@<id>"``, or a version.
Ref = str | StoredVersion | HasStoredVersion


class Catalog:
    """The versions and tags of one store: list, resolve, tag, delete, gc; :attr:`commits` is
    the commit protocol (claim, receipts, records, commit) that compute runs go through."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.commits = Commits(storage)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.storage.url!r})"

    @property
    def url(self) -> str:
        return self.storage.url

    # -- listing --------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Every feature set that has at least one committed version."""
        found = self.storage.find("")
        names = {k.split("/_versions/")[0] for k in found if k.endswith("/" + MANIFEST) and "/_versions/" in k}
        return sorted(names)

    def versions(self, name: str) -> list[StoredVersion]:
        """Committed versions of ``name``, oldest first (uncommitted ones are invisible; one whose
        manifest cannot be read is left out and logged: see :meth:`damaged`)."""
        found, damaged = self.scan(name)
        for vid, exc in damaged.items():
            log.warning("skipping version %s@%s: %s", name, vid, exc)
        return found

    def scan(self, name: str) -> tuple[list[StoredVersion], dict[str, IncompatibleFormat]]:
        """``(committed versions oldest first, {version id: why its manifest cannot be read})``:
        a damaged manifest (or one of a newer featstore) affects only its own version."""
        base = f"{check_name(name)}/_versions"
        out, damaged = [], {}
        for vid in self.storage.list_dirs(base):
            if not is_version_id(vid):
                continue
            try:
                m = read_manifest(self.storage, name, vid)
            except IncompatibleFormat as exc:
                damaged[vid] = exc
                continue
            if m is not None:
                out.append(StoredVersion(self.storage, m))
        return sorted(out, key=lambda v: (v.manifest.created_at, v.id)), damaged

    def damaged(self, name: str | None = None) -> dict[str, str]:
        """``{"name@id": what is wrong}`` for every version (of ``name``, or of every feature
        set) whose manifest exists but cannot be read."""
        out = {}
        for n in [name] if name is not None else self.names():
            out.update({f"{n}@{vid}": str(exc) for vid, exc in self.scan(n)[1].items()})
        return out

    def committed(self, name: str, vid: str) -> StoredVersion | None:
        """``name@vid`` if it is committed, else None (no tag or "newest" resolution)."""
        m = read_manifest(self.storage, name, vid)
        return None if m is None else StoredVersion(self.storage, m)

    def _tag(self, name: str, tag: str) -> str | None:
        """The version id a tag points at (validated), or None if there is no such tag."""
        key = tag_key(name, tag)
        obj = self.storage.read_json(key)
        return None if obj is None else tag_target(obj, self.storage.child_url(key), tag)

    def tags(self, name: str) -> dict[str, str]:
        """``{tag: version id}`` for one feature set."""
        out = {}
        for tag in (e[:-5] for e in self.storage.list_dirs(f"{check_name(name)}/_tags") if e.endswith(".json")):
            try:
                check_tag(tag)
            except FeatstoreError:
                continue  # not a tag featstore wrote: never addressed
            try:
                vid = self._tag(name, tag)
            except IncompatibleFormat as exc:  # a damaged tag hides only itself
                log.warning("skipping tag %s@%s: %s", name, tag, exc)
                continue
            if vid is not None:
                out[tag] = vid
        return out

    # -- resolving ------------------------------------------------------------------------
    def open(self, ref: Ref) -> StoredVersion:
        """Resolve ``"name"`` (newest version), ``"name@tag"``, ``"name@<version id>"`` or a
        version (public or stored: :func:`~featstore.versions.stored`)."""
        if not isinstance(ref, str):
            try:
                return stored(ref)
            except InvalidInput:
                raise InvalidInput(f"expected 'name', 'name@tag', 'name@id' or a Version, got {ref!r}") from None
        name, at, sel = ref.partition("@")
        check_name(name)
        if at and not is_version_id(sel):
            check_tag(sel)
        if not sel:
            versions, damaged = self.scan(name)
            if damaged:
                bad, exc = next(iter(damaged.items()))
                raise IncompatibleFormat(
                    f"the newest version of {name!r} cannot be told: the manifests of {sorted(damaged)} cannot be "
                    f"read ({bad}: {exc}). Open a version by id or tag ({name}@<id>), or remove the damaged ones "
                    f"first (featstore delete URL {name}@<id>).") from exc
            if not versions:
                raise VersionNotFound(
                    f"feature set {name!r} has no committed version in {self.url}; "
                    f"existing sets: {self.names() or 'none'}. Run store.compute({name!r}, ...) first."
                )
            return versions[-1]
        vid = sel if is_version_id(sel) else self._tag(name, sel)
        found = None if vid is None else self.committed(name, vid)
        if found is not None:
            return found
        if vid is not None and not is_version_id(sel):  # a tag left behind by a deleted version
            raise VersionNotFound(f"tag {sel!r} points at version {vid}, which was deleted; move it "
                                  f"(store.tag) or remove it (store.untag({name!r}, {sel!r})).")
        raise VersionNotFound(
            f"{name!r} has no committed version or tag {sel!r}; versions: "
            f"{[v.id for v in self.versions(name)]}, tags: {sorted(self.tags(name))}."
        )

    # -- tags, delete, gc -----------------------------------------------------------------
    def tag(self, version: Ref, tag: str) -> None:
        """Point ``tag`` at a committed version (moving it if it pointed elsewhere).

        A tag never outlives its version: the tag is written, then the manifest is checked
        again; :meth:`delete` removes the manifest, then sweeps the tags again. Whichever runs
        second sees the other's step, so a tag written during a delete is removed by one of them
        (this call then raises :class:`VersionNotFound` saying the version was deleted).
        """
        v = self.open(version)
        key = tag_key(v.name, tag)
        self.storage.write_json(key, tag_json(v.id))
        if read_manifest(self.storage, v.name, v.id) is None:
            if self._tag(v.name, tag) == v.id:
                self.storage.delete(key)
            raise VersionNotFound(f"version {v.ref} was deleted while it was being tagged {tag!r}; "
                                  "tag another version.")

    def untag(self, name: str, tag: str) -> None:
        """Remove a tag (the version stays)."""
        if not self.storage.exists(tag_key(name, tag)):
            raise VersionNotFound(f"{name!r} has no tag {tag!r}; tags: {sorted(self.tags(name))}")
        self.storage.delete(tag_key(name, tag))

    def delete(self, version: Ref) -> str:
        """Delete a committed version (or one whose manifest is damaged, named by id or tag) and
        return its ``name@id``: its tags first, then its manifest (it becomes invisible at once),
        its tags again (one a concurrent :meth:`tag` wrote meanwhile), then its data, unless a
        child (committed or being computed) still has a reference marker in it; then each base
        it extended loses its marker, and its data too once no live version reads it."""
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

    def _damaged_target(self, ref: Ref) -> tuple[str, str] | None:
        """``(name, id)`` when ``ref`` names one version by id or tag whose manifest exists but
        cannot be read (so :meth:`delete` can still remove it), else None."""
        if not isinstance(ref, str) or "@" not in ref:
            return None
        name, _, sel = ref.partition("@")
        vid = sel if is_version_id(sel) else self._tag(name, sel)
        return (name, vid) if vid is not None and self._unreadable(name, vid) else None

    def _unreadable(self, name: str, vid: str) -> bool:
        """Whether the manifest of ``name@vid`` exists but cannot be read."""
        try:
            read_manifest(self.storage, name, vid)
        except IncompatibleFormat:
            return True
        return False

    def _untag_all(self, name: str, vid: str) -> None:
        for tag, target in self.tags(name).items():
            if target == vid:
                self.storage.delete(tag_key(name, tag))

    def _drop_if_unreferenced(self, vkey: str) -> bool:
        refs = self.commits.live_refs(vkey)
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
        """Delete what no committed version needs (``store.gc``), and return the keys deleted:
        uncommitted folders (never committed, or deleted while a child read them and no longer
        read) whose newest object is older than ``older_than`` seconds, old ``*.partial``
        objects, and with ``damaged`` every version whose manifest is damaged (not merely newer).

        A compute still running in a folder gc deletes never commits missing data: gc marks the
        folder and checks it is still uncommitted before deleting
        (:meth:`Commits.delete_uncommitted`); the commit checks every object after writing its
        manifest, and withdraws it if a mark or a hole is there (:meth:`Commits.commit`).
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
                    any(f"/{REFS}/" in k for k in members) and self.commits.live_refs(vkey)):
                old = sorted(members)
            else:
                continue
            if dry_run or self.commits.delete_uncommitted(vkey, old):
                deleted.extend(old)
        return deleted

    def _damaged_folder(self, vkey: str) -> tuple[str, str] | None:
        """``(name, id)`` of the version in folder ``vkey`` if its manifest is damaged (not merely
        newer than this featstore), else None."""
        name, _, vid = vkey.partition("/_versions/")
        try:
            if not self._unreadable(name, vid):
                return None
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
