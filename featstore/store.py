"""FeatureStore and Version: open, list, resolve, tag, delete and read committed versions.

Layout under the store root (``_``-prefixed folders can never collide with a name segment)::

    <name>/_versions/<id>/zarr.json, <array>/...   the Zarr v3 group, one array per output
    <name>/_versions/<id>/_receipts/<shard>.json    one per finished shard (resume markers)
    <name>/_versions/<id>/manifest.json             written last, create-if-absent: the commit
    <name>/_tags/<tag>.json                         {"version": <id>}: the only mutable pointers

A version id is the first 16 hex digits of its fingerprint, so the same inputs always land on
the same id and a second commit of it is recognised, not duplicated.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import zarr
import zarr.storage

from .codecs import codec_by_name
from .errors import (CorruptChunk, FeatstoreError, IncompatibleFormat, InvalidInput, StoreUnavailable,
                     VersionNotFound)
from .manifest import OBJECT_VERSION, TAG_SCHEMA, Manifest, check_schema
from .names import check_name, check_tag, check_version_id, is_version_id
from .storage import Storage
from .zarrmeta import check_array_metadata

if TYPE_CHECKING:
    from .dataset import FeatureDataset
    from .writer import ComputeOptions

MANIFEST = "manifest.json"
RESERVED_FIELDS = ("index",)


def version_key(name: str, vid: str) -> str:
    """The store key of a version's folder."""
    return f"{check_name(name)}/_versions/{check_version_id(vid)}"


def _tag_key(name: str, tag: str) -> str:
    return f"{check_name(name)}/_tags/{check_tag(tag)}.json"


class _StrictStore(zarr.storage.WrapperStore):
    """Refuses to read a missing or empty chunk object as the fill value (zarr#486)."""

    def __init__(self, store: Any, where: str) -> None:
        super().__init__(store)
        self._where = where

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        buf = await self._store.get(key, prototype, byte_range)
        if "/c/" in key and (buf is None or len(buf) == 0):
            raise CorruptChunk(
                f"version {self._where}, array {key.split('/c/')[0]!r}, chunk object {key!r} is "
                f"{'missing' if buf is None else 'empty'}; the stored data is damaged. Run "
                "`featstore verify` to list every bad chunk, then delete and recompute the version.",
                version=self._where, array=key.split("/c/")[0], chunk=key,
            )
        return buf

    def _with_store(self, store: Any) -> "_StrictStore":
        return type(self)(store, self._where)


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

    def __getstate__(self) -> dict[str, Any]:
        return {"storage": self.storage, "manifest": self.manifest}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["storage"], state["manifest"])  # type: ignore[misc]

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
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    @property
    def key(self) -> str:
        return version_key(self.name, self.id)

    @property
    def url(self) -> str:
        """The Zarr group's URL: ``zarr.open_group(version.url)`` reads it with plain zarr."""
        return self.storage.child_url(self.key)

    def __len__(self) -> int:
        return self.manifest.n_samples

    # -- reading ------------------------------------------------------------------------
    def array(self, field: str) -> zarr.Array:
        """The Zarr array of one field, opened lazily once per process (fork/spawn safe)."""
        if self._pid != os.getpid():
            self._arrays, self._pid = {}, os.getpid()
        if field not in self._arrays:
            if field not in self.manifest.arrays:
                raise KeyError(f"version {self.id} has no array {field!r}; it has "
                               f"{sorted(self.manifest.arrays)}")
            store = _StrictStore(self.storage.zarr_store(self.key, read_only=True),
                                 f"{self.name}@{self.id}")
            where = f"{self.name}@{self.id}"
            try:
                arr = zarr.open_array(store, path=field, mode="r")
            except FeatstoreError:
                raise
            except FileNotFoundError as exc:
                raise CorruptChunk(f"array {field!r} of version {self.name}@{self.id} is missing "
                                   "its zarr.json; delete and recompute the version.",
                                   version=where, array=field, chunk="zarr.json") from exc
            except Exception as exc:  # noqa: BLE001 - zarr raises many types on bad metadata
                # Say "newer format" when it is one, else "damaged", from the raw JSON.
                raw = self.storage.read_bytes(f"{self.key}/{field}/zarr.json")
                meta = _loads_or_none(raw)
                check_array_metadata(meta, self.manifest.arrays[field], self.manifest.layout,
                                     version=where, array=field)
                raise CorruptChunk(f"{field}/zarr.json of version {where} cannot be opened "
                                   f"({type(exc).__name__}: {exc}); delete and recompute the version.",
                                   version=where, array=field, chunk=f"{field}/zarr.json") from exc
            # Validate what zarr parsed (the very metadata it will use) before any chunk is decoded.
            check_array_metadata(arr.metadata.to_dict(), self.manifest.arrays[field], self.manifest.layout,
                                 version=where, array=field)
            self._arrays[field] = arr
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
            raise StoreUnavailable(f"reading {self.name}@{self.id}/{field} failed: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - zarr/numcodecs raise plain errors on bad bytes
            shard = self._bad_shard(field, selection, first_row)
            obj = self.chunk_key(field, shard)
            raise CorruptChunk(
                f"version {self.name}@{self.id}, array {field!r}, chunk object {obj!r} failed to "
                f"decode ({type(exc).__name__}: {exc}). The stored bytes are damaged; run "
                "`featstore verify` to list every bad chunk, then delete and recompute the version.",
                version=f"{self.name}@{self.id}", array=field, chunk=obj,
            ) from exc

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
        """The key of shard ``shard`` of ``field`` inside the version (one object per shard)."""
        return "/".join([field, "c", str(shard), *["0"] * len(self.manifest.arrays[field].shape)])

    def decode(self, field: str, stored: np.ndarray) -> torch.Tensor:
        """Stored values -> the tensor a reader gets (see :mod:`featstore.codecs`)."""
        return codec_by_name(self.manifest.arrays[field].codec).decode(stored)

    def __getitem__(self, index: int | slice | Sequence[int] | np.ndarray | torch.Tensor) -> dict[str, torch.Tensor]:
        """Random access: a dict of tensors (one per array) plus ``index``."""
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

    def dataset(self, **options: Any) -> "FeatureDataset":
        """A :class:`~featstore.FeatureDataset` over this version (see :class:`ReaderOptions`)."""
        from .dataset import FeatureDataset

        return FeatureDataset(self, **options)


class FeatureStore:
    """A store root on any fsspec filesystem, holding versioned feature sets.

    >>> store = featstore.open_store("./feats")     # or "s3://bucket/feats", storage_options={...}
    >>> store.names()
    ['cnn-a/train']
    """

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def __repr__(self) -> str:
        return f"FeatureStore({self.storage.url!r})"

    @property
    def url(self) -> str:
        return self.storage.url

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
            m = self._manifest(name, vid)
            if m is not None:
                out.append(Version(self.storage, m))
        return sorted(out, key=lambda v: (v.manifest.created_at, v.id))

    def _manifest(self, name: str, vid: str) -> Manifest | None:
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
        key = _tag_key(name, tag)
        obj = self.storage.read_json(key)
        if obj is None:
            return None
        where = self.storage.child_url(key)
        check_schema(obj, TAG_SCHEMA, OBJECT_VERSION, where)
        vid = obj.get("version")
        if not isinstance(vid, str) or not is_version_id(vid):
            raise IncompatibleFormat(f"{where} does not point at a version id ({vid!r}); the tag is "
                                     f"damaged: move it with store.tag(version, {tag!r}) or remove it.")
        return vid

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
    def open(self, ref: "str | Version") -> Version:
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
        if is_version_id(sel):
            m = self._manifest(name, sel)
            if m is not None:
                return Version(self.storage, m)
        tag_vid = self._tag(name, sel) if not is_version_id(sel) else None
        if tag_vid is not None:
            m = self._manifest(name, tag_vid)
            if m is not None:
                return Version(self.storage, m)
        raise VersionNotFound(
            f"{name!r} has no committed version or tag {sel!r}; versions: "
            f"{[v.id for v in self.versions(name)]}, tags: {sorted(self.tags(name))}."
        )

    # -- mutating -------------------------------------------------------------------------
    def tag(self, version: "Version | str", tag: str) -> None:
        """Point ``tag`` at a committed version (moving it if it pointed elsewhere)."""
        v = self.open(version)
        self.storage.write_json(_tag_key(v.name, tag),
                                {"schema": TAG_SCHEMA, "schema_version": OBJECT_VERSION, "version": v.id})

    def untag(self, name: str, tag: str) -> None:
        """Remove a tag (the version stays)."""
        if not self.storage.exists(_tag_key(name, tag)):
            raise VersionNotFound(f"{name!r} has no tag {tag!r}; tags: {sorted(self.tags(name))}")
        self.storage.delete(_tag_key(name, tag))

    def delete(self, version: "Version | str") -> None:
        """Delete a committed version: its tags first, then its manifest (it becomes invisible
        at once), then its data."""
        v = self.open(version)
        for tag, vid in self.tags(v.name).items():
            if vid == v.id:
                self.storage.delete(_tag_key(v.name, tag))
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
        import time

        now = time.time()
        deleted: list[str] = []
        objects = self.storage.find_modified("")
        by_version: dict[str, dict[str, float]] = {}
        for key, mtime in objects.items():
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

    def compute(self, name: str, *, model: Any, dataset: Any, input_key: Any = "input",
                keep: Sequence[Any] | Mapping[str, Any] = (), outputs: Mapping[str, str] | None = None,
                batch_size: int = 256, samples_per_shard: int | None = None, client: Any = None,
                options: "ComputeOptions | None" = None) -> Version:
        """Compute Model A's outputs over ``dataset`` once and commit them as a version.

        See :func:`featstore.writer.compute` for every argument.

        >>> v = store.compute("cnn-a/train", model=model_a, dataset=train_set,
        ...                   input_key="input", keep=["target"],
        ...                   outputs={"features": "float16", "logits": "float32"})
        """
        from .writer import compute

        return compute(self, name, model=model, dataset=dataset, input_key=input_key, keep=keep,
                       outputs=outputs, batch_size=batch_size, samples_per_shard=samples_per_shard,
                       client=client, options=options)

    def dataset(self, ref: "str | Version", **options: Any) -> "FeatureDataset":
        """A torch ``IterableDataset`` over one committed version (pinned at this call).

        >>> ds = store.dataset("cnn-a/train", batch_size=256, shuffle=True, seed=0)
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
        """
        return self.open(ref).dataset(**options)


def _loads_or_none(raw: bytes | None) -> Any:
    import json

    try:
        return None if raw is None else json.loads(raw)
    except (ValueError, RecursionError):
        return None


def open_store(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> FeatureStore:
    """Open (and for a local path, create) a store at any fsspec URL.

    Prefer the standard credential chain (environment, profile, role) over secrets in
    ``storage_options``: options travel to DataLoader workers and Dask workers.

    >>> store = featstore.open_store("s3://bucket/feats", storage_options={"endpoint_url": url})
    """
    storage = Storage(os.fspath(url), storage_options)
    storage.check_reachable()
    return FeatureStore(storage)


def verify_version(version: Version, progress: bool = False) -> list[str]:
    """Read every shard of every array and compare it with the digest recorded at compute
    time; return one line per bad shard (empty when the version is intact).

    >>> verify_version(store.open("cnn-a/train"))
    []
    """
    import hashlib

    problems = []
    receipts = version.manifest.shards
    it = receipts
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(receipts, desc=f"verify {version.name}@{version.id}", unit="shard")
    for r in it:
        for field, digest in r.digests.items():
            try:
                stored = version.read_rows(field, r.start, r.stop)
                got = hashlib.sha256(np.ascontiguousarray(stored).tobytes()).hexdigest()
            except CorruptChunk as exc:
                problems.append(f"{version.chunk_key(field, r.index)} (rows {r.start}-{r.stop}): {exc}")
                continue
            if got != digest:
                problems.append(f"{version.chunk_key(field, r.index)} (rows {r.start}-{r.stop}): content "
                                "differs from the digest recorded at compute time")
    return problems
