"""One committed version's storage plumbing: :class:`StoredVersion` (where its shards lie, rows,
arrays, views), :func:`stored` (the :class:`StoredVersion` of a public :class:`featstore.Version`),
:func:`read_manifest`, :func:`missing_data_error` (the one "deleted or damaged?" decision) and
:func:`verify_version`.

The user's :class:`featstore.Version` (the face, :mod:`featstore.store`) wraps a
:class:`StoredVersion`; every layer below the face takes a :class:`StoredVersion` and turns what
it is given into one with :func:`stored`, as ``os.fspath`` does for paths.
"""


from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeAlias

from featstore.codecs import codec_by_name
from featstore.codecs import parts_codec
from featstore.codecs import TOKEN_LENGTH
from featstore.errors import (CorruptChunk, FeatstoreError, IncompatibleFormat, InvalidInput, StoreUnavailable,
                              VersionNotFound)
from featstore.format import chunk_key, shard_digest, view_path
from featstore.format import Manifest, ShardReceipt
from featstore.format import ChunkRef, ShardFormat, decode_shard_rows, shard_index, shard_index_bytes
from featstore.storage import Storage
from featstore._lazy import np, torch  # imported on first use: the quick commands never need them
from featstore.versions._keys import MANIFEST, RECORDS, group_store, object_key, version_key, view_key
from featstore.versions._receipts import read_records

if TYPE_CHECKING:  # zarr only where an array is opened (array()): list, info and verify never do
    import zarr

    #: Rows of a version: one (an int), a slice, or a list or array of row numbers.
    Rows: TypeAlias = int | np.integer | slice | Sequence[int] | np.ndarray
    #: What ``version[...]`` takes: rows, or ``(view, rows)`` for a version with views.
    Index: TypeAlias = Rows | tuple[int, Rows]


#: ``[(first row, stop row, version folder key, that folder's n_samples), ...]``: see :meth:`StoredVersion.homes`.
Home = tuple[int, int, str, int]


class HasStoredVersion(Protocol):
    """What :func:`stored` accepts besides a :class:`StoredVersion`: an object that names the
    stored version it stands for (the public :class:`featstore.Version`)."""

    def __featstore_version__(self) -> StoredVersion: ...


def stored(version: StoredVersion | HasStoredVersion) -> StoredVersion:
    """The :class:`StoredVersion` of ``version``: itself if it is one, else what its
    ``__featstore_version__()`` returns (like ``os.fspath``); anything else is :class:`InvalidInput`.

    >>> stored(store.open("cnn-a/train")).key
    'cnn-a/train/_versions/3f2a9c0e1b7d4a55'
    """
    got = _as_stored(version)
    if got is None:
        raise InvalidInput(f"expected a featstore Version (store.open(ref)), got {type(version).__name__}: "
                           f"{version!r:.80}")
    return got


def _as_stored(version: object) -> StoredVersion | None:
    if isinstance(version, StoredVersion):
        return version
    protocol = getattr(type(version), "__featstore_version__", None)
    got = None if protocol is None else protocol(version)
    return got if isinstance(got, StoredVersion) else None


def read_manifest(storage: Storage, name: str, vid: str) -> Manifest | None:
    """The validated manifest of ``name@vid``, or None while it is not committed; one that
    cannot be read is :class:`IncompatibleFormat` saying how to remove that version."""
    key = f"{version_key(name, vid)}/{MANIFEST}"
    where, ref = storage.child_url(key), f"{name}@{vid}"
    try:
        obj = storage.read_json(key)
        if obj is None:
            return None
        m = Manifest.from_json(obj, where)
        if (m.name, m.id) != (name, vid):  # a manifest copied or planted under another path
            raise IncompatibleFormat(f"{where} describes {m.name}@{m.id}, not {ref}; the store is damaged.")
    except IncompatibleFormat as exc:
        raise IncompatibleFormat(
            f"{exc} Only version {ref} is affected: `featstore delete {shlex.quote(storage.url)} {ref}` (or "
            f"store.delete({ref!r})) removes it; recompute it if you need it.") from exc
    return m


def deleted_or(version: StoredVersion, error: FeatstoreError) -> FeatstoreError:
    """``error`` about ``version``'s data, unless the version was deleted (its manifest is gone:
    ``store.delete`` removes it before the data): then :class:`VersionNotFound` saying so.
    Asked on error paths only, through a storage of this process's own."""
    if version.storage.reopen().exists(f"{version.key}/{MANIFEST}"):
        return error
    return VersionNotFound(f"version {version.ref} was deleted (store.delete) while it was being read; its data "
                           "is gone. Open another version (store.versions(name)) and start the epoch again.")


def missing_data_error(version: StoredVersion, ref: ChunkRef, data: bytes | memoryview | None) -> FeatstoreError:
    """The one "deleted or damaged?" decision for a shard object read as ``data`` (None: there
    is no such object): :class:`VersionNotFound` when the version was deleted while it was read,
    else :class:`CorruptChunk` naming ``ref`` ("is missing" or "is empty")."""
    return deleted_or(version, CorruptChunk.damaged(ref.version, ref.array, ref.chunk,
                                                    "is missing" if data is None else "is empty"))


# -- one committed version ---------------------------------------------------------------------
class StoredVersion:
    """One committed version as stored: its storage and manifest, where each shard lies (an
    incremental version reads its bases' shards in place), and its rows. The plumbing behind
    the user's :class:`featstore.Version`, which the readers and the compute side take."""

    def __init__(self, storage: Storage, manifest: Manifest, view: int | None = None) -> None:
        self.storage = storage
        self.manifest = manifest
        self._arrays: dict[tuple[str, str], zarr.Array[Any]] = {}
        self._pid = -1
        self._view = view  # the view this object reads (see view())
        self._views: dict[int, StoredVersion] = {}

    def __reduce__(self) -> tuple[type[StoredVersion], tuple[Storage, Manifest, int | None]]:
        return StoredVersion, (self.storage, self.manifest, self._view)  # no open array, no cache

    def __repr__(self) -> str:
        return f"<StoredVersion {self.ref} samples={len(self)} arrays={sorted(self.manifest.arrays)}>"

    def _identity(self) -> tuple[str, str, str]:
        return self.storage.url, self.name, self.id

    def __eq__(self, other: object) -> bool:
        """The same version of the same store (a public :class:`featstore.Version` of it too)."""
        theirs = _as_stored(other)
        return NotImplemented if theirs is None else self._identity() == theirs._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    def __len__(self) -> int:
        return self.manifest.n_samples

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
    def spread(self) -> int:
        """How many prefixes the version's shard objects are spread over (1: its own folder)."""
        return self.manifest.layout.spread

    @property
    def data_key(self) -> str:
        """The key of the group whose arrays this object reads: the version's, or its view's."""
        return view_key(self.key, self._view)

    @property
    def views(self) -> int | None:
        """How many augmented views per sample the version holds (None: computed without views)."""
        return None if self.manifest.views is None else self.manifest.views.count

    @property
    def read_view(self) -> int | None:
        """The view this object reads (:meth:`view`; None: the version itself)."""
        return self._view

    def view(self, view: int) -> StoredVersion:
        """This version reading view ``view`` (laid out like a version without views, so
        everything that reads one works); cached, one object per view."""
        if self.views is None or isinstance(view, bool) or not isinstance(view, (int, np.integer)) \
                or not 0 <= int(view) < self.views:
            raise InvalidInput(f"view {view!r} does not exist: {self.ref} has "
                               f"{'no views' if self.views is None else f'views 0..{self.views - 1}'}.")
        if int(view) not in self._views:
            self._views[int(view)] = StoredVersion(self.storage, self.manifest, int(view))
        return self._views[int(view)]

    # -- where shards live (an incremental version reads its bases' shards in place) ----
    def homes(self) -> list[Home]:
        """``[(first row, stop row, version key, that folder's n_samples), ...]`` in row order:
        each run of shards a base holds, and the runs between them, which are this version's own."""
        spp, n = self.manifest.layout.samples_per_shard, len(self)
        out: list[Home] = []
        pos = 0  # the first shard not yet placed: the runs between bases are this version's own
        for b in self.manifest.bases:
            if b.first > pos:
                out.append((pos * spp, b.first * spp, self.data_key, n))
            out.append((b.first * spp, min(b.stop * spp, n), version_key(b.name, b.id), b.n_samples))
            pos = b.stop
        if pos < self.manifest.layout.n_shards:
            out.append((pos * spp, n, self.data_key, n))
        return out

    def _home(self, shard: int) -> tuple[str, int]:
        """``(folder key, its n_samples)`` of the group that stores shard ``shard``."""
        row = shard * self.manifest.layout.samples_per_shard
        return next(((h, n) for a, b, h, n in self.homes() if a <= row < b), (self.data_key, len(self)))

    def shard_home(self, shard: int) -> str:
        """The key of the version folder that stores shard ``shard`` (the version's own folder
        for a view's shards: :meth:`chunk_key` then starts with ``_views/<v>/``)."""
        home = self._home(shard)[0]
        return self.key if home == self.data_key else home

    def object_key(self, field: str, shard: int) -> str:
        """The store key of the object holding shard ``shard`` of ``field`` (in a base's folder
        for an incremental version's inherited shards, which share its spread; under its
        prefix's folder when the version is spread)."""
        return object_key(self.shard_home(shard), self.chunk_key(field, shard), self.spread)

    def chunk_key(self, field: str, shard: int) -> str:
        """The key of shard ``shard`` of ``field`` inside the version (one object per shard;
        under ``_views/<v>/`` when this object reads a view)."""
        key = chunk_key(field, shard, len(self.manifest.arrays[field].shape))
        return key if self._view is None else f"{view_path(self._view)}/{key}"

    def shard_receipts(self) -> list[ShardReceipt]:
        """Every shard's digests and statistics: inline in a schema 1 manifest, read from the
        records objects (a few concurrent GETs) in schema 2. Only verify and compute need them."""
        if self.manifest.shards is not None:
            return list(self.manifest.shards)
        return read_records(self.storage, self.key, self.manifest, self.ref)

    # -- reading ------------------------------------------------------------------------
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
        whole = 2 * (c1 - c0) > fmt.chunks_per_shard
        data = storage.read_buffer(key) if whole else storage.read_range(key, -shard_index_bytes(fmt))
        if not data:
            raise missing_data_error(self, ref, data)
        if whole:
            decode_shard_rows(data, fmt, lo, hi, out, ref)
            return
        index = shard_index(data, fmt, ref)
        spans = index[c0:c1]
        start, stop = int(spans[:, 0].min()), int((spans[:, 0] + spans[:, 1]).max())
        if start > stop or stop > 2**62:  # an empty-chunk marker: decode_shard_rows names it
            start, stop = 0, 0
        data = storage.read_range(key, start, stop) if stop > start else b""
        decode_shard_rows(data or b"", fmt, lo, hi, out, ref, index=index, base=start)

    def array(self, field: str, home: str | None = None, n_samples: int | None = None) -> zarr.Array[Any]:
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
            from featstore.format import open_array

            layout = replace(self.manifest.layout, n_samples=n_samples or len(self))
            try:
                self._arrays[(home, field)] = open_array(
                    group_store(self.storage, home, self.spread, read_only=True), field, self.manifest.arrays[field],
                    layout, self.ref, lambda: self.storage.read_bytes(f"{home}/{field}/zarr.json", metadata=True))
            except CorruptChunk as exc:  # a missing zarr.json is a deleted version, not damaged data
                self._raise(exc)
        return self._arrays[(home, field)]

    def _raise(self, exc: CorruptChunk) -> NoReturn:
        """Raise ``exc``, or :class:`VersionNotFound` if the version was deleted meanwhile."""
        found = deleted_or(self, exc)
        if found is exc:
            raise exc
        raise found from exc

    def _guarded(self, field: str, read: Callable[[], np.ndarray], shard: Callable[[], int]) -> np.ndarray:
        """``read()`` with what the store and Zarr raise turned into featstore's errors: a deleted
        version is :class:`VersionNotFound`, bytes that do not decode a :class:`CorruptChunk`
        naming the shard (``shard()``, asked on that error path only)."""
        try:
            return read()
        except CorruptChunk as exc:
            self._raise(exc)
        except FeatstoreError:
            raise
        except (ConnectionError, TimeoutError, PermissionError) as exc:
            raise StoreUnavailable(f"reading {self.ref}/{field} failed: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - zarr/numcodecs raise plain errors on bad bytes
            damaged = CorruptChunk.damaged(self.ref, field, self.chunk_key(field, shard()),
                                           f"failed to decode ({type(exc).__name__}: {exc})")
            raise deleted_or(self, damaged) from exc

    def read_rows(self, field: str, start: int, stop: int) -> np.ndarray:
        """Stored values of rows ``[start, stop)`` of ``field`` (numpy, stored dtype)."""
        return self._read(field, slice(start, stop))

    def _read(self, field: str, selection: slice | np.ndarray) -> np.ndarray:
        """Read a slice or row list, split by the folder each row's shard lives in (rows of a
        per-token array are tokens: only a version without bases reads those here)."""
        if not self.manifest.bases:
            return self._read_home(field, self.data_key, len(self), selection)
        if isinstance(selection, slice):
            parts = [(home, n, slice(max(lo, selection.start), min(hi, selection.stop)))
                     for lo, hi, home, n in self.homes() if max(lo, selection.start) < min(hi, selection.stop)]
            if len(parts) <= 1:
                home, n, sel = parts[0] if parts else (self.data_key, len(self), selection)
                return self._read_home(field, home, n, sel)
            return np.concatenate([self._read_home(field, home, n, sel) for home, n, sel in parts])
        rows = np.asarray(selection, dtype=np.int64).reshape(-1)
        spec = self.manifest.arrays[field]
        out = np.empty((len(rows), *spec.shape), dtype=spec.dtype)
        for lo, hi, home, n in self.homes():
            mask = (rows >= lo) & (rows < hi)
            if mask.any():
                out[mask] = self._read_home(field, home, n, rows[mask])
        return out

    def _read_home(self, field: str, home: str, n_samples: int, selection: slice | np.ndarray) -> np.ndarray:
        def read() -> np.ndarray:
            arr = self.array(field, home, n_samples)
            return np.asarray(arr[selection] if isinstance(selection, slice) else arr.oindex[selection])

        return self._guarded(field, read, lambda: self._bad_shard(field, home, n_samples, selection))

    def _bad_shard(self, field: str, home: str, n_samples: int, selection: slice | np.ndarray) -> int:
        """On a failed multi-shard read, find the shard that fails on its own (error path only)."""
        spp = self.manifest.layout.samples_per_shard
        if isinstance(selection, slice):
            shards: Sequence[int] = range(selection.start // spp, -(-selection.stop // spp))
        else:
            shards = sorted({int(r) // spp for r in np.asarray(selection).reshape(-1)})
        for shard in shards:
            try:
                self.array(field, home, n_samples)[shard * spp:min((shard + 1) * spp, len(self))]
            except Exception:  # noqa: BLE001 - the failing one is what we are looking for
                return shard
        return shards[0] if shards else 0

    def token_rows(self, field: str, shard: int, lo: int, hi: int) -> np.ndarray:
        """Stored rows ``[lo, hi)`` of a per-token array, all in shard ``shard`` (in a base's
        folder for an incremental version's inherited shard); damage is a :class:`CorruptChunk`
        naming that shard."""
        home, n = self._home(shard)
        return self._guarded(field, lambda: np.asarray(self.array(field, home, n)[lo:hi]), lambda: shard)

    def token_span(self, shard: int) -> tuple[int, int]:
        """The token rows ``[lo, hi)`` shard ``shard`` stores in each per-token array."""
        start, stop = self.manifest.layout.shard_range(shard)
        lengths = self.read_rows(TOKEN_LENGTH, start, stop)
        per_shard = next(a.tokens[0] for a in self.manifest.arrays.values() if a.ragged)
        return shard * per_shard, shard * per_shard + int(lengths.sum(dtype=np.int64))

    def decode(self, field: str, stored: np.ndarray) -> torch.Tensor:
        """Stored values -> the tensor a reader gets (see :mod:`featstore.codecs`)."""
        spec = self.manifest.arrays[field]
        if spec.output:  # one part of an output stored in parts: ids as int64, -1 in unused slots
            return parts_codec(spec.codec).decode_part(spec.part, stored)
        return codec_by_name(spec.codec).decode(stored)


def verify_version(version: StoredVersion | HasStoredVersion, progress: bool = False) -> list[str]:
    """Read every shard of every array and compare it with the digest recorded at compute
    time; return one line per bad shard (empty when the version is intact).

    >>> verify_version(store.open("cnn-a/train"))
    []
    """
    version = stored(version)
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
