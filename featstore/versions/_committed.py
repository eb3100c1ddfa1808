"""One committed version: :class:`Version` (random access, ``load()``, arrays, views) and
:func:`verify_version` (every shard object against the digest recorded at compute time).
"""


from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any


from featstore.codecs._dense import codec_by_name
from featstore.errors import (CorruptChunk, FeatstoreError, InvalidInput,
                              StoreUnavailable, VersionNotFound)
from featstore.format._keys import chunk_key, shard_digest, view_path
from featstore.format._shard_decoder import ChunkRef, ShardFormat, decode_shard_rows, shard_index, shard_index_bytes
from featstore.format._manifests import (Manifest, ShardReceipt)
from featstore.codecs._parts import assemble, parts_codec
from featstore.codecs._ragged import OFFSETS, TOKEN_FIELDS, TOKEN_LENGTH, TOKEN_START, gather_rows, offsets
from featstore.storage import Storage
from featstore.versions._views import view_seed
from featstore._lazy import lazy_module


from featstore.versions._keys import MANIFEST, RECORDS, group_store, object_key, version_key, view_key
from featstore.versions._receipts import read_records

if TYPE_CHECKING:  # zarr only where an array is opened (array()): list, info and verify never do
    import zarr
    import zarr.abc.store

torch = lazy_module("torch")  # imported on first use: the quick commands never need it
np = lazy_module("numpy")  # likewise numpy: listing and tagging versions never touch an array
log = logging.getLogger("featstore")


def deleted_while_reading(ref: str) -> VersionNotFound:
    """The error for data that vanished because its version was deleted mid-read."""
    return VersionNotFound(f"version {ref} was deleted (store.delete) while it was being read; its data "
                           "is gone. Open another version (store.versions(name)) and start the epoch again.")


def missing_data_error(version: Version, ref: ChunkRef, data: bytes | memoryview | None) -> FeatstoreError:
    """The one "deleted or damaged?" decision for a shard object that read back missing
    (``data`` None) or empty: :class:`VersionNotFound` when the version's manifest is gone
    (deleted while it was read), else :class:`CorruptChunk` naming the object."""
    if data is None and version.was_deleted():
        return deleted_while_reading(version.ref)
    return CorruptChunk.damaged(ref.version, ref.array, ref.chunk, "is missing" if data is None else "is empty")


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
            from featstore.format._arrays import open_array

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
