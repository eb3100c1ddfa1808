"""The public face: :class:`FeatureStore` (compute, read, list, tag), :class:`Version` and
:func:`open_store`.

It sits on top of both sides: the versions core (:mod:`featstore.versions`), the compute side
(:mod:`featstore.compute`) and the read side (:mod:`featstore.read`), the last two imported when
first used (torch and Dask are not needed to list, verify or tag). Nothing below imports it.
Each class holds the objects that do the work: a :class:`FeatureStore` its
:class:`~featstore.versions.Catalog`, a :class:`Version` its
:class:`~featstore.versions.StoredVersion`; below this face every layer takes the latter.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from featstore._keywords import keywords_of, own_keywords_of
from featstore.compute import ComputeCall
from featstore.errors import InvalidInput
from featstore.format import Manifest
from featstore.storage import Storage, backend_for
from featstore.storage import StorageOptions
from featstore.versions import Catalog
from featstore.versions import StoredVersion, verify_version
from featstore.read import ReadKeywords
from featstore.versions import view_seed

if TYPE_CHECKING:  # the reader imports torch and the driver Dask: both only when used
    import torch

    from featstore.compute import ComputeReport
    from zarr.abc.store import Store as ZarrStore

    from featstore.online import Teacher
    from featstore.read import FeatureDataset
    from featstore.versions import Exported, Index


class Version:
    """One committed, immutable version of a feature set: random access, ``load()``,
    ``verify()``, and :meth:`dataset` to stream it.

    >>> v = store.open("cnn-a/train")
    >>> len(v), v.id, sorted(v.manifest.arrays)
    (20000, '3f2a9c0e1b7d4a55', ['features', 'logits', 'target'])
    >>> v[10:20]["features"].shape
    torch.Size([10, 512])
    """

    __slots__ = ("_stored", "_report")

    def __init__(self, stored: StoredVersion, report: ComputeReport | None = None) -> None:
        self._stored = stored
        self._report = report

    def __featstore_version__(self) -> StoredVersion:
        """The stored version behind this one (:func:`featstore.versions.stored`)."""
        return self._stored

    def __reduce__(self) -> tuple[type[Version], tuple[StoredVersion]]:
        return Version, (self._stored,)

    def __repr__(self) -> str:
        return f"<Version {self.ref} samples={len(self)} arrays={sorted(self.manifest.arrays)}>"

    def __eq__(self, other: object) -> bool:
        return self._stored.__eq__(other)

    def __hash__(self) -> int:
        return hash(self._stored)

    def __len__(self) -> int:
        return len(self._stored)

    def __getitem__(self, index: Index) -> dict[str, torch.Tensor]:
        """Random access: ``v[i]``, ``v[a:b]``, ``v[[rows]]`` give a dict of tensors (one per
        array) plus ``index``; ``v[view, rows]`` reads view ``view`` of a version with views
        (and adds ``view``). Read through the reader's sources (:func:`featstore.read.version_rows`)."""
        from featstore.read import version_rows

        return version_rows(self._stored, index)

    @property
    def report(self) -> ComputeReport | None:
        """What the ``store.compute`` call that returned this object did: whether A ran, how the
        dataset was compared with what was stored, how many items changed, shards computed and
        reused (None on a version opened any other way).

        >>> store.compute("cnn-a/train", model=a, dataset=edited).report.items_changed
        1
        """
        return self._report

    @property
    def id(self) -> str:
        """The version id: the first 16 hex digits of its fingerprint."""
        return self._stored.id

    @property
    def name(self) -> str:
        """The feature set's name (``"cnn-a/train"``)."""
        return self._stored.name

    @property
    def ref(self) -> str:
        """``name@id``: how errors and logs name this version, and what ``store.open`` takes."""
        return self._stored.ref

    @property
    def fingerprint(self) -> str:
        """sha256 of everything that decides the stored outputs (Model A, the dataset, the config)."""
        return self._stored.fingerprint

    @property
    def manifest(self) -> Manifest:
        """The version's manifest: layout, arrays, statistics, timings, libraries."""
        return self._stored.manifest

    @property
    def url(self) -> str:
        """The Zarr group's URL: ``zarr.open_group(version.url)`` reads it with plain zarr,
        unless its shard objects are spread over prefixes (``ComputeOptions.spread_prefixes``):
        then use :meth:`zarr_store`."""
        return self._stored.storage.child_url(self._stored.key)

    # -- augmented views ----------------------------------------------------------------
    @property
    def views(self) -> int | None:
        """How many augmented views per sample the version holds (None: computed without views)."""
        return self._stored.views

    def view(self, view: int) -> Version:
        """This version reading view ``view``: ``version.view(2)[10:20]``, ``.load()``, ...

        Views are laid out like a version without views, so everything that reads one works.
        """
        return Version(self._stored.view(view))

    def view_seed(self, index: int, view: int) -> int:
        """The seed of view ``view`` of sample ``index``: Model A ran on exactly
        ``augment(dataset[index], torch.Generator().manual_seed(version.view_seed(index, view)))``.

        >>> v.view_seed(10, 3)
        5812337108410417153
        """
        spec = self.manifest.views
        if spec is None:
            raise InvalidInput(f"{self.ref} was computed without views; it has no view seeds.")
        if not 0 <= view < spec.count or not 0 <= index < len(self):
            raise IndexError(f"(index {index}, view {view}) is out of range for {len(self)} samples "
                             f"and {spec.count} views")
        return view_seed(spec.seed, index, view)

    @property
    def views_of(self) -> str | None:
        """``"name@id"`` of the version whose views this one was computed on (``views_of=``), or None."""
        from featstore.versions import views_of

        return views_of(self._stored)

    # -- reading ------------------------------------------------------------------------
    def load(self) -> dict[str, torch.Tensor]:
        """The whole version in RAM as tensors (the classic in-memory cache, from the store)."""
        return self[0:len(self)]

    def verify(self, progress: bool = False) -> list[str]:
        """Read every shard of every array and compare it with the digest recorded at compute
        time; return one line per bad shard (empty when the version is intact).

        >>> store.open("cnn-a/train").verify()
        []
        """
        return verify_version(self._stored, progress)

    @own_keywords_of(ReadKeywords)
    def dataset(self, **keywords: Any) -> FeatureDataset:
        """A :class:`~featstore.FeatureDataset` over this version; the keywords are every
        reader's (:class:`~featstore.read.ReadKeywords`: :class:`ReaderOptions`' fields,
        ``rank``, ``source``, ...), checked by it.

        >>> ds = store.open("cnn-a/train@best").dataset(batch_size=256, seed=0)
        """
        from featstore.read import FeatureDataset, Stream, read_call

        return FeatureDataset.of([Stream(self)], read_call(keywords), mixture=False)

    def zarr_store(self) -> ZarrStore:
        """A read-only Zarr store of this version's group (this view's, after :meth:`view`),
        which finds spread shard objects under their prefixes: plain Zarr reads a version
        through it. Not for an incremental version (``extends=``), whose inherited shards lie in
        its parents' folders, nor for one a rerun made referencing the unchanged shards of
        another: that raises :class:`InvalidInput` (read it with featstore, ``load()`` or
        :meth:`export` it), rather than give a store in which they would read as zeros.

        >>> group = zarr.open_group(version.zarr_store(), mode="r")
        >>> group["features"][:10].shape
        (10, 512)
        """
        from featstore.versions import group_store

        v = self._stored
        if v.manifest.bases:
            raise InvalidInput(f"{v.ref} references shards of {v.manifest.bases[0].name}@{v.manifest.bases[0].id} "
                               "(extends=, or a rerun that kept the shards whose items did not change): they lie in "
                               "that version's folder, so no single Zarr group holds it. Read it with featstore "
                               "(store.open(ref)[a:b], .load(), store.dataset(ref)), or export it (version.export, "
                               "featstore export) for plain Zarr readers.")
        return group_store(v.storage, v.data_key, v.spread, read_only=True)

    def export(self, url: str | os.PathLike[str], storage_options: StorageOptions | None = None, *,
               verify: bool = True, progress: bool = False) -> Exported:
        """Write this version to ``url`` (a new folder, any fsspec URL) as a self-contained
        standard Zarr v3 group that zarr, xarray and TensorStore read as it is: the route for
        versions made with ``extends=`` or spread over prefixes (see :mod:`featstore.versions`).

        >>> store.open("cnn-a/train-grown").export("/data/grown.zarr")
        Exported(url='/data/grown.zarr', objects=48, bytes=50331648, shards_checked=48)
        """
        from featstore.versions import export_version

        options = dict(storage_options or {}) or None
        if not progress:
            return export_version(self._stored, os.fspath(url), options, verify=verify)
        from tqdm.auto import tqdm

        with tqdm(desc=f"export {self.ref}", unit="shard") as bar:
            def step(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)
            return export_version(self._stored, os.fspath(url), options, verify=verify, progress=step)


#: What names a version at the face: ``"name"`` (its newest), ``"name@tag"``, ``"name@<id>"``, or a Version.
VersionRef = str | Version


@dataclass(frozen=True, kw_only=True)
class DatasetKeywords(ReadKeywords):
    """``store.dataset``'s keywords: every reader's, and the teacher in the loop.

    Attributes:
        teacher: ``featstore.Teacher(model=A, dataset=ds, ...)``: Model A run in the consuming
            process (the version ``store.compute`` would make of the same arguments), and with
            ``Teacher(fill=True)`` stored as it is computed (see :mod:`featstore.online`).
    """

    teacher: Teacher | None = None


class FeatureStore:
    """A store root on any fsspec filesystem, holding versioned feature sets.

    >>> store = featstore.open_store("./feats")     # or "s3://bucket/feats", storage_options={...}
    >>> store.names()
    ['cnn-a/train']
    """

    def __init__(self, storage: Storage) -> None:
        #: The versions and tags, with the commit protocol (``catalog.commits``): the internals' entry.
        self.catalog = Catalog(storage)

    def __repr__(self) -> str:
        return f"FeatureStore({self.url!r})"

    @property
    def storage(self) -> Storage:
        """The store root's :class:`~featstore.storage.Storage`."""
        return self.catalog.storage

    @property
    def url(self) -> str:
        """The store root's URL."""
        return self.catalog.url

    @keywords_of(ComputeCall)
    def compute(self, name: str, *args: Any, **keywords: Any) -> Version:
        """Compute Model A's outputs over ``dataset`` once and commit them as a version.

        The keywords are :class:`~featstore.compute.ComputeRequest`'s (the ones
        :class:`~featstore.Teacher` takes too) and ``client`` (listed below). Augmented views
        are one option: ``views=featstore.Views(k=8, augment=fn, seed=0)`` (the keywords
        ``views=8, augment=fn, augment_seed=0`` still work for one release, with a
        ``DeprecationWarning``).

        Returns the committed :class:`Version`; if a version with the same fingerprint is
        already committed it is returned at once, without running A. If the run dies, calling
        ``compute`` again recomputes only the shards without a receipt.

        >>> v = store.compute("cnn-a/train", model=model_a, dataset=train_set,
        ...                   input_key="input", keep=["target"],
        ...                   outputs={"features": "float16", "logits": "float32"})
        >>> grown = store.compute("cnn-a/train", model=model_a, dataset=bigger_train_set,
        ...                       input_key="input", keep=["target"], extends=v.ref,
        ...                       outputs={"features": "float16", "logits": "float32"})
        >>> b = store.compute("cnn-b/train", model=model_b, dataset=train_set, augment=augment,
        ...                   views_of="cnn-a/train@3f2a9c0e1b7d4a55")   # on exactly A's views

        ``views_of=`` takes K and the seed from that version; ``augment=`` (a function cannot be
        read back from a store) must be the same function, and is given alone, without a warning.
        """
        from featstore.compute import run_compute

        done = run_compute(self.catalog, name, ComputeCall(*args, **keywords))
        return Version(done.version, done.report)

    @keywords_of(DatasetKeywords, first="ref: a version (``\"name\"``, ``\"name@tag\"``, ``\"name@<id>\"``, a "
                                          ":class:`Version`), or several teachers' (``{label: ref}`` or a list).")
    def dataset(self, ref: VersionRef | Mapping[str, VersionRef] | Sequence[VersionRef], **keywords: Any
                ) -> FeatureDataset:
        """A :class:`~featstore.FeatureDataset` (a torch ``IterableDataset``) over one committed
        version (pinned at this call), or over several aligned ones read on the same rows: a dict
        ``{label: ref}`` or a list (labels ``t0``, ``t1``, ...), whose batches hold each
        teacher's arrays as ``"<label>/<array>"``.

        ``teacher=featstore.Teacher(model=A, dataset=ds, ...)`` with a feature set's name: the
        same batches with Model A run in the consuming process (online), and with
        ``Teacher(fill=True)`` written into the version as they are computed (see
        :mod:`featstore.online`).

        ``source=train_set`` (with ``augment=fn`` for a version with views) adds the student's
        own input to every batch, augmented exactly as Model A saw it; see :class:`~featstore.read.Join`.

        >>> ds = store.dataset("cnn-a/train", batch_size=256, shuffle=True, seed=0)
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
        >>> ds = store.dataset("teacher/views", source=train_set, augment=augment)  # + "input", "view"
        >>> ds = store.dataset({"a": "teacher-a/train", "b": "teacher-b/train"})  # "a/logits", "b/logits"
        >>> ds = store.dataset("cnn-a/train", batch_size=256, teacher=featstore.Teacher(model=a, dataset=train_set))
        """
        from featstore.read import FeatureDataset, Stream, read_call

        teacher = keywords.pop("teacher", None)
        call = read_call(keywords)
        if teacher is not None:
            if not isinstance(ref, str):
                raise InvalidInput("with teacher=, name the feature set (a str): the teacher decides the version.")
            from featstore.online import online_dataset

            return online_dataset(self.catalog, ref, teacher, call, public=Version)
        if isinstance(ref, (str, Version)):
            return FeatureDataset.of([Stream(self.open(ref))], call, mixture=False)
        if isinstance(ref, Mapping):
            return FeatureDataset.of([Stream({label: self.open(r) for label, r in ref.items()})], call, mixture=False)
        return FeatureDataset.of([Stream([self.open(r) for r in ref])], call, mixture=False)

    # -- listing, resolving, tags, delete, gc (the catalog's) -----------------------------
    def open(self, ref: VersionRef) -> Version:
        """Resolve ``"name"`` (newest version), ``"name@tag"`` or ``"name@<version id>"``.

        >>> store.open("cnn-a/train@best").id
        '3f2a9c0e1b7d4a55'
        """
        return Version(self.catalog.open(ref))

    def versions(self, name: str) -> list[Version]:
        """Committed versions of ``name``, oldest first (uncommitted ones are invisible; one whose
        manifest cannot be read is left out and logged: see :meth:`damaged`)."""
        return [Version(v) for v in self.catalog.versions(name)]

    def names(self) -> list[str]:
        """Every feature set that has at least one committed version."""
        return self.catalog.names()

    def tag(self, version: VersionRef, tag: str) -> None:
        """Point ``tag`` at a committed version (moving it if it pointed elsewhere). A tag never
        outlives its version: tagging one that is being deleted raises :class:`VersionNotFound`.

        >>> store.tag("cnn-a/train@3f2a9c0e1b7d4a55", "best")
        """
        self.catalog.tag(version, tag)

    def untag(self, name: str, tag: str) -> None:
        """Remove a tag (the version stays)."""
        self.catalog.untag(name, tag)

    def tags(self, name: str) -> dict[str, str]:
        """``{tag: version id}`` for one feature set."""
        return self.catalog.tags(name)

    def delete(self, version: VersionRef) -> str:
        """Delete a committed version: its tags, its manifest (it becomes invisible at once),
        then its data, unless an incremental child still reads shards from it. A reader still
        streaming it gets :class:`VersionNotFound` saying it was deleted.

        Shared shards stay until no version references them: a parent's data is kept while a
        child (committed or being computed) has a reference marker in it, and deleting the
        last such child removes the parent's data too.

        A version whose manifest is damaged (:meth:`damaged`) is deleted the same way when named by
        id or tag (``"name@id"``). Returns the ``name@id`` deleted.
        """
        return self.catalog.delete(version)

    def gc(self, older_than: float = 3600.0, dry_run: bool = False, damaged: bool = False) -> list[str]:
        """Delete what no committed version needs, and return the keys deleted.

        That is: folders of versions that were never committed (an interrupted ``compute``),
        or were deleted while a child read shards from them and no longer are, whose newest
        object is older than ``older_than`` seconds (younger ones may belong to a compute
        still running, or waiting to be resumed), and temporary ``*.partial`` objects left by a
        killed writer. Committed versions, tags, and folders a live child reads are never touched.
        ``damaged=True`` also deletes every version whose manifest exists but is damaged (see
        :meth:`damaged`; one written by a newer featstore is kept: upgrade to read it), as
        :meth:`delete` would.

        A compute still running in a folder gc deletes (``older_than=0``, or a run that paused
        longer than ``older_than``) never commits missing data: its commit raises
        :class:`ComputeFailed`, and rerunning it recomputes what was deleted.

        >>> store.gc(older_than=24 * 3600)
        ['cnn-a/train/_versions/0123456789abcdef/logits/c/0/0', ...]
        """
        return self.catalog.gc(older_than, dry_run, damaged)

    def damaged(self, name: str | None = None) -> dict[str, str]:
        """``{"name@id": what is wrong and what to do}`` for every version (of ``name``, or of every
        feature set) whose manifest exists but cannot be read; remove one with :meth:`delete`
        (``featstore delete URL name@id``) or all with ``gc(damaged=True)``.

        >>> store.damaged()
        {'cnn-a/train@0123456789abcdef': '.../manifest.json is not valid JSON (...) ...'}
        """
        return self.catalog.damaged(name)


def open_store(url: str | os.PathLike[str], storage_options: StorageOptions | None = None, *,
               create: bool = True) -> FeatureStore:
    """Open a store at any fsspec URL; a local folder is created unless ``create=False``.

    ``create=False`` is for reading: a local store that does not exist is
    :class:`~featstore.StoreNotFound` and nothing is created (what ``featstore list``, ``info``,
    ``verify``, ``tag``, ``delete`` and ``gc`` use). A path that is a file is
    :class:`~featstore.InvalidInput`.

    Prefer the standard credential chain (environment, profile, role) over secrets in
    ``storage_options``: options travel to DataLoader workers and Dask workers.

    >>> store = featstore.open_store("s3://bucket/feats", storage_options={"endpoint_url": url})
    >>> store = featstore.open_store("./feats", create=False)     # StoreNotFound if there is none
    """
    storage = backend_for(os.fspath(url))(os.fspath(url), storage_options)
    storage.check_reachable(create=create)
    return FeatureStore(storage)
