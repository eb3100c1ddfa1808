"""The commit protocol of a store's versions (:class:`Commits`): claim a version folder (create
``_pending.json`` or join the run that did, create the arrays, find finished shards), collect
the receipts the tasks wrote, write the shard records, commit (durable data, then the manifest
create-if-absent), which folders a child still reads (:meth:`Commits.live_refs`), and the
mark ``gc`` leaves while it deletes an uncommitted folder (:meth:`Commits.delete_uncommitted`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from featstore.errors import ComputeFailed, CorruptChunk, IncompatibleFormat, StoreConflict, VersionNotFound
from featstore.format import chunk_key
from featstore._json import JSONObject, canonical_json, load_json
from featstore.format import ArraySpec, Base, Layout, Manifest, ShardReceipt, ShardRecords
from featstore.format import Pending, gc_mark_json, ref_json, ref_target
from featstore.storage import Storage
from featstore.versions._keys import (GC_MARK, MANIFEST, PENDING, RECEIPTS, REFS, group_store, ref_key,
                                      spread_homes, stored_objects, version_key, view_key)
from featstore.versions._receipts import finished_shards, forget_receipts, read_many, read_receipts, write_records
from featstore.versions._committed import StoredVersion, read_manifest

log = logging.getLogger("featstore")


@dataclass(frozen=True)
class Claim:
    """What a compute run works with once it has claimed (or joined) a version folder."""

    layout: Layout
    arrays: dict[str, ArraySpec]
    done: frozenset[int]
    done_views: frozenset[tuple[int, int]] = frozenset()  # finished (view, shard) units, with views


def _sans_compression(specs: Mapping[str, JSONObject] | None) -> dict[str, JSONObject]:
    return {n: {k: v for k, v in a.items() if k != "compression"} for n, a in (specs or {}).items()}


def _shards_with_holes(vkey: str, arrays: Mapping[str, ArraySpec], shards: Iterable[int],
                       have: set[str]) -> dict[int, list[str]]:
    """``{shard: its objects not in the listing have}`` for the shards among ``shards`` that lack one."""
    keys = {i: [f"{vkey}/{chunk_key(a, i, len(spec.shape))}" for a, spec in arrays.items()] for i in shards}
    return {i: gone for i, ks in keys.items() if (gone := [k for k in ks if k not in have])}


@dataclass(frozen=True)
class Commits:
    """The commit protocol of the versions of one store (its :class:`~featstore.versions.Catalog`
    holds one): what a compute run (or a filling reader) calls to claim a version folder and
    commit it, and the handshakes with ``delete`` and ``gc`` that keep a commit from naming
    data they remove."""

    storage: Storage

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
        mine = Pending.of(layout, dict(arrays))
        claimed = self._pending(key, mine)
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
            from featstore.format import create_views_group  # zarr: only where a run writes

            create_views_group(group_store(self.storage, key, claimed.layout.spread, read_only=False))
            units = {(v, i) for v in range(views) for i in self._prepare(view_key(key, v), claimed.layout, adopted)}
            return Claim(claimed.layout, adopted, frozenset(), frozenset(units))
        self._reference(name, vid, bases)
        inherited = {i for b in bases for i in range(b.first, b.stop)}
        done = self._prepare(key, claimed.layout, adopted, inherits=bool(bases))
        return Claim(claimed.layout, adopted, frozenset(done | inherited))

    def _prepare(self, key: str, layout: Layout, arrays: Mapping[str, ArraySpec], inherits: bool = False) -> set[int]:
        """Create (or check) the arrays of the group at ``key``; return its finished shards.

        A receipt whose shard objects are gone (a gc ran during an earlier run) is not done;
        it is removed, so no task or commit of this run trusts it.
        """
        from featstore.format import create_arrays  # zarr: only where a run writes

        create_arrays(group_store(self.storage, key, layout.spread, read_only=False, inherits=inherits),
                      layout, arrays, self.storage.child_url(key))
        done = {i for i in finished_shards(self.storage, key) if i < layout.n_shards}
        holes = _shards_with_holes(key, arrays, done, stored_objects(self.storage, key, layout.spread))
        forget_receipts(self.storage, key, holes)
        return done - set(holes)

    def _reference(self, name: str, vid: str, bases: Sequence[Base]) -> None:
        """Mark each base folder as read by ``name@vid``; refuse a base whose data is gone."""
        for b in bases:
            bkey = version_key(b.name, b.id)
            self.storage.write_json(ref_key(bkey, name, vid), ref_json(name, vid))
            if not self.storage.exists(f"{bkey}/{PENDING}"):
                self.storage.delete(ref_key(bkey, name, vid))
                raise VersionNotFound(f"{b.name}@{b.id}, which {name}@{vid} extends, was deleted; "
                                      "compute the dataset without extends, or from another parent.")

    def _pending(self, key: str, mine: Pending) -> Pending:
        """Create the claim, or read the one another run created first."""
        if self.storage.create(f"{key}/{PENDING}", canonical_json(mine.to_json())):
            return mine
        obj = self.storage.read_json(f"{key}/{PENDING}")
        # None: removed by a run that committed in between; that commit will be adopted.
        return mine if obj is None else Pending.from_json(obj, self.storage.child_url(f"{key}/{PENDING}"))

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

    def commit(self, manifest: Manifest) -> StoredVersion:
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
        from featstore.format import consolidate, consolidated_groups  # zarr: only where a run writes

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
            winner = read_manifest(self.storage, manifest.name, manifest.id)
            if winner is None or winner.fingerprint != manifest.fingerprint:
                raise
            return StoredVersion(self.storage, winner)  # an identical concurrent run committed first: adopt it
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
        return StoredVersion(self.storage, manifest)

    def _check_stored(self, manifest: Manifest) -> None:
        """Raise :class:`ComputeFailed` unless every object of ``manifest`` is on storage and
        every array's stored metadata is the manifest's layout (every view's, with views)."""
        vkey = version_key(manifest.name, manifest.id)
        have = stored_objects(self.storage, vkey, manifest.layout.spread)
        for view in [None] if manifest.views is None else range(manifest.views.count):
            self._check_group(manifest, view_key(vkey, view), have)
            self._check_layout(manifest, view_key(vkey, view))

    def _check_layout(self, manifest: Manifest, key: str) -> None:
        """Raise :class:`ComputeFailed` unless each array's ``zarr.json`` in the group at ``key``
        describes the manifest's layout (shape, shard and chunk rows, dtype, codecs): a version
        whose metadata another writer changed would be committed unreadable (issue 20)."""
        from featstore.format import check_array_metadata  # zarr: only where a run writes

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
        # a base's shards live in its folder, kept by a reference: only the version's own are checked
        holes = _shards_with_holes(key, manifest.arrays, manifest.own_shards, have)
        missing = [k for k in meta if k not in have] + [k for i in sorted(holes) for k in holes[i]]
        if not missing:
            return
        forget_receipts(self.storage, key, holes)  # those shards must be computed again
        shown = ", ".join(k[len(key) + 1:] for k in missing[:4]) + (", ..." if len(missing) > 4 else "")
        raise ComputeFailed(
            f"{len(missing)} objects of {manifest.name}@{manifest.id} were deleted while it was computed "
            f"({shown}), by store.gc or another process; nothing was committed. Rerun compute: the "
            "shards still stored are kept, the others are recomputed.")

    # -- the handshakes with delete and gc ------------------------------------------------
    def live_refs(self, vkey: str) -> list[str]:
        """``name@id`` of every version that reads shards from folder ``vkey`` and still exists
        (committed, or claimed by a compute that may still commit)."""
        out = []
        keys = [f"{vkey}/{REFS}/{e}" for e in self.storage.list_dirs(f"{vkey}/{REFS}") if e.endswith(".json")]
        for key, data in read_many(self.storage, keys).items():
            if data is None:
                continue
            name, vid = ref_target(load_json(data, self.storage.child_url(key)), self.storage.child_url(key))
            if self.storage.exists(f"{version_key(name, vid)}/{PENDING}") or read_manifest(self.storage, name, vid):
                out.append(f"{name}@{vid}")
        return out

    def delete_uncommitted(self, vkey: str, keys: list[str]) -> bool:
        """Delete ``keys`` of one version folder unless it got committed meanwhile; whether they went.

        The mark comes first, the look at the manifest second (:meth:`commit` does the reverse):
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
