"""Real Lightning Trainers on 2 CPU ranks (gloo), run as a script by tests/test_lightning.py.

``python -m tests.lightning_child STRATEGY STORE REF OUT [STEPS]``:

- ``OUT/grid``: one ``Trainer.fit`` over plain DataLoaders at once (a CombinedLoader): the
  dataset built in the LightningModule's ``__init__`` (before the process group exists) or in
  ``train_dataloader()``, with persistent workers or not (``CASES_OF``: ``ddp`` all four,
  ``ddp_spawn`` the two early ones); 2 epochs, no ``set_epoch`` anywhere.
  Under ``ddp_spawn`` the early persistent loader's workers are spawned (that strategy's
  default: the dataset is pickled to them) and the others forked (the fork path; spawned workers
  each import torch, and 20 more would cost minutes on 2 cores).
- with STEPS, ``OUT/first`` and ``OUT/second``: featstore.lightning's data module
  (StatefulDataLoader, 2 persistent workers), a run checkpointed after STEPS steps (mid-epoch),
  then ``fit(ckpt_path=...)`` from that checkpoint to the end of epoch 1.
- ``python -m tests.lightning_child resume-on-1 STORE REF OUT``: that checkpoint resumed on one
  device (another split: elastic resume), into ``OUT/second-1``.
- ``python -m tests.lightning_child resume-fixture STORE REF OUT CKPT``: a checkpoint an older
  featstore saved (tests/data/states-*/lightning) resumed on one device, into ``OUT/resumed``.

Each rank writes the indices its training steps saw, per epoch (and loader).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections import defaultdict

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import featstore

CASES = {"early-persistent": (True, True), "early": (True, False), "late-persistent": (False, True),
         "late": (False, False)}
#: The cases each strategy runs. Under ``ddp_spawn`` only the early datasets differ from ``ddp``'s
#: (built in the parent process and pickled to the spawned ranks); a late one is built in its
#: rank after the process group exists under either strategy, which ``ddp`` covers.
CASES_OF = {"ddp_spawn": ("early-persistent", "early"), "ddp": tuple(CASES)}


class Recorder(pl.LightningModule):
    """Records every batch's indices per epoch (and per loader of a combined batch)."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out, self.lin = out, torch.nn.Linear(8, 1)
        self.seen: dict[str, list[int]] = defaultdict(list)

    def _record(self, key: str, batch: dict) -> torch.Tensor:
        self.seen[f"{self.current_epoch}/{key}"] += batch["index"].tolist()
        return self.lin(batch["features"].float()).mean()

    def training_step(self, batch, i):
        if "index" in batch:
            return self._record("train", batch)
        return sum(self._record(k, b) for k, b in batch.items() if b is not None)

    def on_train_end(self) -> None:
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as f:
            json.dump(self.seen, f)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Grid(Recorder):
    """One loader per case the strategy runs (CASES_OF), each over its own dataset."""

    def __init__(self, out: str, store: str, ref: str, strategy: str) -> None:
        super().__init__(out)
        self.store, self.ref, self.spawned = store, ref, strategy == "ddp_spawn"
        self.cases = {k: CASES[k] for k in CASES_OF[strategy]}
        self.early = {k: self._dataset() for k, (early, _) in self.cases.items() if early}

    def _dataset(self) -> featstore.FeatureDataset:
        return featstore.open_store(self.store).dataset(self.ref, batch_size=25, seed=3)

    def train_dataloader(self):
        from lightning.pytorch.utilities import CombinedLoader

        loaders = {k: DataLoader(self.early[k] if early else self._dataset(), batch_size=None, num_workers=2,
                                 persistent_workers=persistent, timeout=300,
                                 multiprocessing_context="fork" if self.spawned and k != "early-persistent" else None)
                   for k, (early, persistent) in self.cases.items()}
        return CombinedLoader(loaders, mode="max_size")


def _trainer(strategy: str, **kw) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **kw)


def grid(strategy: str, store: str, ref: str, out: str) -> None:
    _trainer(strategy, max_epochs=2, enable_checkpointing=False).fit(Grid(out, store, ref, strategy))


def datamodule(strategy: str, store: str, ref: str, out: str, steps: int) -> None:
    from featstore.lightning import FeatureDataModule, LoaderOptions

    def dm():
        return FeatureDataModule(store, train=ref, val=ref, batch_size=25, seed=5,
                                 loader=LoaderOptions(num_workers=2, persistent_workers=True))

    # A checkpoint after STEPS steps, taken while the epoch runs on (Lightning marks an epoch that
    # max_steps stops as finished, so the run goes one step further and the test uses STEPS).
    every = pl.callbacks.ModelCheckpoint(dirpath=out, filename="mid", every_n_train_steps=steps, save_top_k=-1,
                                         save_on_train_epoch_end=False)
    _trainer(strategy, max_steps=steps + 1, limit_val_batches=0, callbacks=[every]).fit(
        Recorder(os.path.join(out, "first")), datamodule=dm())
    _trainer(strategy, max_epochs=2, enable_checkpointing=False, limit_val_batches=2).fit(
        Recorder(os.path.join(out, "second")), datamodule=dm(), ckpt_path=os.path.join(out, "mid.ckpt"))


def resume_on_one_device(store: str, ref: str, out: str) -> None:
    """The data module's mid-epoch checkpoint of the 2-rank run (``OUT/mid.ckpt``) resumed on one
    device with 1 DataLoader worker and the same global batch (2 x 25 = 1 x 50), to the end of
    epoch 1, into ``OUT/second-1``."""
    from featstore.lightning import FeatureDataModule, LoaderOptions

    dm = FeatureDataModule(store, train=ref, val=ref, batch_size=50, seed=5,
                           loader=LoaderOptions(num_workers=1, persistent_workers=True))
    pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
               num_sanity_val_steps=0, max_epochs=2, enable_checkpointing=False, limit_val_batches=2).fit(
        Recorder(os.path.join(out, "second-1")), datamodule=dm, ckpt_path=os.path.join(out, "mid.ckpt"))


def resume_fixture(store: str, ref: str, out: str, ckpt: str) -> None:
    """A checkpoint an older featstore saved (tests/data/make_resume_states.py: 1 device, 2
    persistent workers, batch 16, seed 5) resumed to the end of epoch 1, into ``OUT/resumed``."""
    from featstore.lightning import FeatureDataModule, LoaderOptions

    dm = FeatureDataModule(store, train=ref, batch_size=16, seed=5,
                           loader=LoaderOptions(num_workers=2, persistent_workers=True))
    pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
               num_sanity_val_steps=0, max_epochs=2, enable_checkpointing=False).fit(
        Recorder(os.path.join(out, "resumed")), datamodule=dm, ckpt_path=ckpt)


def main(strategy: str, store: str, ref: str, out: str, steps: str | None = None) -> None:
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and logging, in this script only
    if strategy == "resume-fixture":  # here ``steps`` is the checkpoint's path
        os.makedirs(os.path.join(out, "resumed"), exist_ok=True)
        return resume_fixture(store, ref, out, str(steps))
    if strategy == "resume-on-1":
        os.makedirs(os.path.join(out, "second-1"), exist_ok=True)
        return resume_on_one_device(store, ref, out)
    for sub in ("grid", "first", "second"):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
    grid(strategy, store, ref, os.path.join(out, "grid"))
    if steps is not None:
        datamodule(strategy, store, ref, out, int(steps))


if __name__ == "__main__":
    main(*sys.argv[1:])
