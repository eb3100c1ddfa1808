"""A Lightning data module over featstore versions (``pip install featstore[lightning]``).

>>> from featstore.lightning import FeatureDataModule, LoaderOptions
>>> dm = FeatureDataModule("s3://bucket/feats", train="cnn-a/train", val="cnn-a/val",
...                        batch_size=256, loader=LoaderOptions(num_workers=4, persistent_workers=True))
>>> lightning.Trainer(accelerator="gpu", devices=8, strategy="ddp").fit(model_b, datamodule=dm)

What it handles, so the training script does not:

- **Pinned versions.** ``setup()`` resolves each ref once, on rank 0, and every rank reads that
  version (a commit between two ranks' lookups cannot split them); the pins are saved in the
  checkpoint (:meth:`FeatureDataModule.state_dict`), so ``fit(ckpt_path=...)`` reads the same
  versions even if the refs moved since.
- **Ranks.** The datasets find their rank when each epoch's iteration starts (any strategy:
  ``ddp``, ``ddp_spawn``; see :mod:`featstore.read`), and every rank yields the same number of
  batches.
- **Epochs.** Each training epoch reads the next epoch's order (and view); the first one
  ``train_dataloader()`` serves is the Trainer's current epoch, so a run resumed at an epoch
  boundary continues the sequence.
- **Mid-epoch checkpoints.** The loaders are :class:`featstore.StatefulLoader`\\ s (torchdata
  ``StatefulDataLoader``\\ s), which Lightning checkpoints; the resumed run reads the rest of the
  epoch, each sample once, on any number of devices and DataLoader workers with the same global
  batch (``docs/elastic.md``). The datasets know their length (the batches each rank yields with the
  loader's workers: the data module tells them), so Lightning counts the steps right
  (``estimated_stepping_batches``, learning-rate schedules) and fetches nothing ahead of the step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from featstore import FeatureDataset, FeatureStore, InvalidInput, ReaderOptions, Version, open_store

if TYPE_CHECKING:  # the type checker reads the `lightning` extra's package
    from lightning.pytorch import LightningDataModule

    from featstore._user_types import FieldKey, MapDataset
    from featstore.storage import StorageOptions
    from featstore.versions import Augment
else:
    try:
        from lightning.pytorch import LightningDataModule
    except ImportError:  # the standalone package
        try:
            from pytorch_lightning import LightningDataModule
        except ImportError as exc:
            raise ImportError("featstore.lightning needs Lightning and torchdata: pip install "
                              "'featstore[lightning]'") from exc
try:
    from featstore.stateful import StatefulLoader
except ImportError as exc:
    raise ImportError("featstore.lightning needs torchdata: pip install 'featstore[lightning]'") from exc

__all__ = ["FeatureDataModule", "LoaderOptions", "StatefulLoader"]


@dataclass(frozen=True)
class LoaderOptions:
    """How the data module's DataLoaders run (see ``torch.utils.data.DataLoader``).

    Attributes:
        num_workers: DataLoader worker processes per rank.
        persistent_workers: keep them between epochs (with ``num_workers > 0``).
        pin_memory: pin batches for the copy to the GPU.
        multiprocessing_context: ``"fork"``, ``"spawn"``, ``"forkserver"`` or None (the default).
        prefetch_factor: batches each worker reads ahead (None: DataLoader's default).
        timeout: seconds to wait for a worker's batch (0: forever).
    """

    num_workers: int = 0
    persistent_workers: bool = False
    pin_memory: bool = False
    multiprocessing_context: str | None = None
    prefetch_factor: int | None = None
    timeout: float = 0

    def kwargs(self) -> dict[str, object]:
        if self.num_workers < 0:
            raise InvalidInput(f"num_workers must be >= 0, got {self.num_workers}.")
        out: dict[str, object] = {"num_workers": self.num_workers, "pin_memory": self.pin_memory,
                               "timeout": self.timeout if self.num_workers else 0}
        if self.num_workers:
            out.update(persistent_workers=self.persistent_workers, multiprocessing_context=self.multiprocessing_context)
            if self.prefetch_factor is not None:
                out["prefetch_factor"] = self.prefetch_factor
        return out


class FeatureDataModule(LightningDataModule):
    """Train (and validation) datasets from featstore refs, for ``Trainer.fit(datamodule=...)``.

    Args:
        store: a store URL (any fsspec URL) or a :class:`~featstore.FeatureStore`.
        train: the training version's ref (``NAME``, ``NAME@TAG``, ``NAME@VERSION``).
        val: the validation version's ref, or None.
        storage_options: for a store URL.
        options: :class:`~featstore.ReaderOptions` of the training dataset (``**reader`` fields
            override them: ``batch_size=256, seed=0, view="epoch"``).
        val_options: of the validation dataset (default: the training options without shuffle).
        loader: :class:`LoaderOptions` of both loaders.
        source, val_source: ``source=`` datasets to join (see :class:`~featstore.FeatureDataset`),
            with ``augment``/``source_fields``/``source_id`` passed through.
    """

    def __init__(self, store: str | FeatureStore, train: str, val: str | None = None, *,
                 storage_options: StorageOptions | None = None, options: ReaderOptions | None = None,
                 val_options: ReaderOptions | None = None, loader: LoaderOptions | None = None,
                 source: MapDataset | None = None, val_source: MapDataset | None = None, augment: Augment | None = None,
                 source_fields: Sequence[FieldKey] | Mapping[str, FieldKey] | None = None,
                 source_id: str | None = None, **reader: Any) -> None:
        super().__init__()
        self._store_arg, self._storage_options = store, storage_options
        self.refs = {"train": train, **({"val": val} if val is not None else {})}
        self.options = replace(options or ReaderOptions(), **reader)
        self.val_options = val_options or replace(self.options, shuffle=False, drop_last=False)
        self.loader = loader or LoaderOptions()
        self.loader.kwargs()  # bad loader options fail here, not in the first epoch
        self._sources = {"train": source, "val": val_source}
        self._augment, self._source_fields, self._source_id = augment, source_fields, source_id
        self.pins: dict[str, str] = {}  # "train"/"val" -> "name@version", fixed by setup()
        self.datasets: dict[str, FeatureDataset] = {}

    def _store(self) -> FeatureStore:
        if isinstance(self._store_arg, FeatureStore):
            return self._store_arg
        return open_store(self._store_arg, self._storage_options)

    def setup(self, stage: str) -> None:
        """Pin each ref to one version, the same on every rank (rank 0's lookup)."""
        if self.pins:
            return
        store = self._store()
        pins = {k: store.open(ref).ref for k, ref in self.refs.items()}
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.world_size > 1:
            pins = trainer.strategy.broadcast(pins, src=0)
        self.pins = pins

    def _version(self, which: str) -> Version:
        if not self.pins:
            self.setup("fit")
        return self._store().open(self.pins[which])

    def _dataset(self, which: str) -> FeatureDataset:
        if which not in self.datasets:
            options = self.options if which == "train" else self.val_options
            source, workers = self._sources[which], self.loader.num_workers
            self.datasets[which] = self._version(which).dataset(options=options, num_workers=workers) \
                if source is None else self._version(which).dataset(
                    options=options, num_workers=workers, source=source, augment=self._augment,
                    source_fields=self._source_fields, source_id=self._source_id)
        return self.datasets[which]

    def train_dataloader(self) -> StatefulLoader:
        """The training loader; its first epoch is the Trainer's current one."""
        ds = self._dataset("train")
        trainer = getattr(self, "trainer", None)
        ds.set_epoch(trainer.current_epoch if trainer is not None else 0)
        return StatefulLoader(ds, batch_size=None, **self.loader.kwargs())

    def val_dataloader(self) -> StatefulLoader | list[StatefulLoader]:
        """The validation loader (an empty list without ``val``: Lightning then skips validation)."""
        if "val" not in self.refs:
            return []
        return StatefulLoader(self._dataset("val"), batch_size=None, **self.loader.kwargs())

    def state_dict(self) -> dict[str, dict[str, str]]:
        """The pinned versions, saved in Lightning checkpoints."""
        return {"pins": dict(self.pins)}

    def load_state_dict(self, state: Mapping[str, Mapping[str, str]]) -> None:
        """Read the checkpoint's versions (Lightning calls this after ``setup``, before the
        loaders are built)."""
        pins = dict(state.get("pins") or {})
        if set(pins) != set(self.refs):
            raise InvalidInput(f"the checkpoint pins {sorted(pins)} but this data module reads {sorted(self.refs)}.")
        if pins != self.pins:
            self.pins, self.datasets = pins, {}
