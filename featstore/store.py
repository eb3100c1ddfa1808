"""The public face: :class:`FeatureStore` (compute, read, list, tag) and :func:`open_store`.

It sits on top of both sides: the versions core (:mod:`featstore.versions`), the compute side
(:mod:`featstore.compute`) and the read side (:mod:`featstore.read`), the last two imported when
first used (torch and Dask are not needed to list, verify or tag). Nothing below imports it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from featstore.compute._request import ComputeCall, keywords_of
from featstore.errors import InvalidInput
from featstore.storage import Storage
from featstore.versions._catalog import Catalog
from featstore.versions._committed import Version as CoreVersion

if TYPE_CHECKING:  # the reader imports torch and the driver Dask: both only when used
    from featstore.read._dataset import FeatureDataset
    from featstore.versions._export import Exported


class Version(CoreVersion):
    """One committed, immutable version of a feature set: random access, ``load()``,
    ``verify()``, and :meth:`dataset` to stream it.

    >>> v = store.open("cnn-a/train")
    >>> len(v), v.id, sorted(v.manifest.arrays)
    (20000, '3f2a9c0e1b7d4a55', ['features', 'logits', 'target'])
    >>> v[10:20]["features"].shape
    torch.Size([10, 512])
    """

    @property
    def views_of(self) -> str | None:
        """``"name@id"`` of the version whose views this one was computed on (``views_of=``), or None."""
        from featstore.versions._alignment import views_of

        return views_of(self)

    def dataset(self, **options: Any) -> FeatureDataset:
        """A :class:`~featstore.FeatureDataset` over this version (see :class:`ReaderOptions`).

        >>> ds = store.open("cnn-a/train@best").dataset(batch_size=256, seed=0)
        """
        from featstore.read._dataset import FeatureDataset

        return FeatureDataset(self, **options)

    def export(self, url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None, *,
               verify: bool = True, progress: bool = False) -> Exported:
        """Write this version to ``url`` (a new folder, any fsspec URL) as a self-contained
        standard Zarr v3 group that zarr, xarray and TensorStore read as it is: the route for
        versions made with ``extends=`` or spread over prefixes (see :mod:`featstore.versions`).

        >>> store.open("cnn-a/train-grown").export("/data/grown.zarr")
        Exported(url='/data/grown.zarr', objects=48, bytes=50331648, shards_checked=48)
        """
        from featstore.versions._export import export_version

        if not progress:
            return export_version(self, os.fspath(url), dict(storage_options or {}) or None, verify=verify)
        from tqdm.auto import tqdm

        with tqdm(desc=f"export {self.ref}", unit="shard") as bar:
            def step(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)
            return export_version(self, os.fspath(url), dict(storage_options or {}) or None, verify=verify,
                                  progress=step)


class FeatureStore(Catalog):
    """A store root on any fsspec filesystem, holding versioned feature sets.

    >>> store = featstore.open_store("./feats")     # or "s3://bucket/feats", storage_options={...}
    >>> store.names()
    ['cnn-a/train']
    """

    version_class = Version

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
        from featstore.compute._driver import run_compute

        return run_compute(self, name, ComputeCall(*args, **keywords))

    def dataset(self, ref: str | CoreVersion | Mapping[str, str | CoreVersion] | Sequence[str | CoreVersion],
                *, teacher: Any = None, **options: Any) -> Any:
        """A torch ``IterableDataset`` over one committed version (pinned at this call), or over
        several aligned ones read on the same rows: a dict ``{label: ref}`` or a list (labels
        ``t0``, ``t1``, ...) gives a :class:`~featstore.read.MultiTeacherDataset`, whose
        batches hold each teacher's arrays as ``"<label>/<array>"``.

        ``teacher=featstore.Teacher(model=A, dataset=ds, ...)`` with a feature set's name: the
        same batches with Model A run in the consuming process (online), and with
        ``Teacher(fill=True)`` written into the version as they are computed (see
        :mod:`featstore.online`).

        ``source=train_set`` (with ``augment=fn`` for a version with views) adds the student's
        own input to every batch, augmented exactly as Model A saw it; see
        :class:`~featstore.read.ViewReading`.

        >>> ds = store.dataset("cnn-a/train", batch_size=256, shuffle=True, seed=0)
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
        >>> ds = store.dataset("teacher/views", source=train_set, augment=augment)  # + "input", "view"
        >>> ds = store.dataset({"a": "teacher-a/train", "b": "teacher-b/train"})  # "a/logits", "b/logits"
        >>> ds = store.dataset("cnn-a/train", batch_size=256, teacher=featstore.Teacher(model=a, dataset=train_set))
        """
        from featstore.read._dataset import FeatureDataset

        if teacher is not None:
            if not isinstance(ref, str):
                raise InvalidInput("with teacher=, name the feature set (a str): the teacher decides the version.")
            from featstore.online import online_dataset

            return online_dataset(self, ref, teacher, **options)

        if isinstance(ref, Mapping) or isinstance(ref, (list, tuple)):
            from featstore.read._multiread import MultiTeacherDataset

            if isinstance(ref, Mapping):
                return MultiTeacherDataset({label: self.open(r) for label, r in ref.items()}, **options)
            return MultiTeacherDataset([self.open(r) for r in ref], **options)
        return FeatureDataset(self.open(ref), **options)


def open_store(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None, *,
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
    storage = Storage(os.fspath(url), storage_options)
    storage.check_reachable(create=create)
    return FeatureStore(storage)
