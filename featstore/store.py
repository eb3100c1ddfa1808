"""The public face: :class:`FeatureStore` (compute, read, list, tag) and :func:`open_store`.

It sits on top of both sides: the versions core (:mod:`featstore.versions`), the writer
(:mod:`featstore.writer`) and the reader (:mod:`featstore.dataset`). Nothing below imports it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from .dataset import FeatureDataset
from .errors import InvalidInput
from .export import Exported, export_version
from .online import Teacher, online_dataset
from .ragged import Tokens
from .storage import Storage
from .versions import Catalog
from .versions import Version as CoreVersion
from .writer import ComputeOptions, compute


class Version(CoreVersion):
    """One committed, immutable version of a feature set: random access, ``load()``,
    ``verify()``, and :meth:`dataset` to stream it.

    >>> v = store.open("cnn-a/train")
    >>> len(v), v.id, sorted(v.manifest.arrays)
    (20000, '3f2a9c0e1b7d4a55', ['features', 'logits', 'target'])
    >>> v[10:20]["features"].shape
    torch.Size([10, 512])
    """

    def dataset(self, **options: Any) -> FeatureDataset:
        """A :class:`~featstore.FeatureDataset` over this version (see :class:`ReaderOptions`).

        >>> ds = store.open("cnn-a/train@best").dataset(batch_size=256, seed=0)
        """
        return FeatureDataset(self, **options)

    def export(self, url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None, *,
               verify: bool = True, progress: bool = False) -> Exported:
        """Write this version to ``url`` (a new folder, any fsspec URL) as a self-contained
        standard Zarr v3 group that zarr, xarray and TensorStore read as it is: the route for
        versions made with ``extends=`` or spread over prefixes (see :mod:`featstore.export`).

        >>> store.open("cnn-a/train-grown").export("/data/grown.zarr")
        Exported(url='/data/grown.zarr', objects=48, bytes=50331648, shards_checked=48)
        """
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

    def compute(self, name: str, *, model: Any, dataset: Any, input_key: Any = "input",
                keep: Sequence[Any] | Mapping[str, Any] = (), outputs: Mapping[str, str] | None = None,
                batch_size: int = 256, samples_per_shard: int | None = None, client: Any = None,
                options: ComputeOptions | None = None, extends: str | CoreVersion | None = None,
                views: int | None = None, augment: Any = None, augment_seed: int = 0,
                tokens: Tokens | None = None) -> Version:
        """Compute Model A's outputs over ``dataset`` once and commit them as a version.

        See :func:`featstore.writer.compute` for every argument.

        >>> v = store.compute("cnn-a/train", model=model_a, dataset=train_set,
        ...                   input_key="input", keep=["target"],
        ...                   outputs={"features": "float16", "logits": "float32"})
        >>> grown = store.compute("cnn-a/train", model=model_a, dataset=bigger_train_set,
        ...                       input_key="input", keep=["target"], extends=v.ref,
        ...                       outputs={"features": "float16", "logits": "float32"})
        """
        return compute(self, name, model=model, dataset=dataset, input_key=input_key, keep=keep,
                       outputs=outputs, batch_size=batch_size, samples_per_shard=samples_per_shard,
                       client=client, options=options, extends=extends, views=views, augment=augment,
                       augment_seed=augment_seed, tokens=tokens)

    def dataset(self, ref: str | CoreVersion, *, teacher: Teacher | None = None, **options: Any) -> FeatureDataset:
        """A torch ``IterableDataset`` over one committed version (pinned at this call).

        ``teacher=featstore.Teacher(model=A, dataset=ds, ...)`` with a feature set's name: the
        same batches with Model A run in the consuming process (online), and with
        ``Teacher(fill=True)`` written into the version as they are computed (see
        :mod:`featstore.online`, :mod:`featstore.fill`).

        ``source=train_set`` (with ``augment=fn`` for a version with views) adds the student's
        own input to every batch, augmented exactly as Model A saw it; see
        :class:`~featstore.viewreading.ViewReading`.

        >>> ds = store.dataset("cnn-a/train", batch_size=256, shuffle=True, seed=0)
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
        >>> ds = store.dataset("teacher/views", source=train_set, augment=augment)  # + "input", "view"
        >>> ds = store.dataset("cnn-a/train", batch_size=256, teacher=featstore.Teacher(model=a, dataset=train_set))
        """
        if teacher is not None:
            if not isinstance(ref, str):
                raise InvalidInput("with teacher=, name the feature set (a str): the teacher decides the version.")
            return online_dataset(self, ref, teacher, **options)
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
