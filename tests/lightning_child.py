"""Real Lightning Trainers on 2 CPU ranks (gloo), run as a script by tests/test_clients.py.

``python -m tests.lightning_child grid STRATEGY STORE REF OUT``: one ``Trainer.fit`` over four
plain DataLoaders at once (a CombinedLoader): the dataset built in the LightningModule's
``__init__`` (before the process group exists) or in ``train_dataloader()``, with persistent
workers or not; 2 epochs, no ``set_epoch`` anywhere. Each rank writes the indices each loader
gave it per epoch.

``python -m tests.lightning_child datamodule STORE REF OUT STEPS``: featstore.lightning's data
module (StatefulDataLoader, 2 persistent workers), ``ddp_spawn``: a run stopped after STEPS
steps (mid-epoch) and checkpointed, then ``fit(ckpt_path=...)`` to the end of epoch 1; each
rank writes the indices its training steps saw in each run.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections import defaultdict

import torch
from torch.utils.data import DataLoader

import featstore

CASES = {"early-persistent": (True, True), "early": (True, False), "late-persistent": (False, True),
         "late": (False, False)}


def _lightning():
    import lightning.pytorch as pl

    warnings.filterwarnings("ignore")  # Lightning's advice on workers and logging
    return pl


pl = _lightning()


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
    """Four loaders, one per case of CASES, each over its own dataset."""

    def __init__(self, out: str, store: str, ref: str) -> None:
        super().__init__(out)
        self.store, self.ref = store, ref
        self.early = {k: self._dataset() for k, (early, _) in CASES.items() if early}

    def _dataset(self) -> featstore.FeatureDataset:
        return featstore.open_store(self.store).dataset(self.ref, batch_size=25, seed=3)

    def train_dataloader(self):
        from lightning.pytorch.utilities import CombinedLoader

        loaders = {k: DataLoader(self.early[k] if early else self._dataset(), batch_size=None, num_workers=2,
                                 persistent_workers=persistent) for k, (early, persistent) in CASES.items()}
        return CombinedLoader(loaders, mode="max_size")


class SaveAtEnd(pl.Callback):
    """Checkpoint inside the ranks when fit stops (the loop and loader states live there)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, module) -> None:
        trainer.save_checkpoint(self.path)


def _trainer(strategy: str, **kw) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **kw)


def grid(strategy: str, store: str, ref: str, out: str) -> None:
    _trainer(strategy, max_epochs=2, enable_checkpointing=False).fit(Grid(out, store, ref))


def datamodule(store: str, ref: str, out: str, steps: int) -> None:
    from featstore.lightning import FeatureDataModule, LoaderOptions

    def dm():
        return FeatureDataModule(store, train=ref, val=ref, batch_size=25, seed=5,
                                 loader=LoaderOptions(num_workers=2, persistent_workers=True))

    first = os.path.join(out, "first")
    os.makedirs(first, exist_ok=True)
    ckpt = os.path.join(out, "mid.ckpt")
    _trainer("ddp_spawn", max_steps=steps, enable_checkpointing=False, limit_val_batches=0,
             callbacks=[SaveAtEnd(ckpt)]).fit(Recorder(first), datamodule=dm())
    second = os.path.join(out, "second")
    os.makedirs(second, exist_ok=True)
    _trainer("ddp_spawn", max_epochs=2, enable_checkpointing=False, limit_val_batches=2).fit(
        Recorder(second), datamodule=dm(), ckpt_path=ckpt)


if __name__ == "__main__":
    if sys.argv[1] == "grid":
        grid(*sys.argv[2:6])
    else:
        datamodule(*sys.argv[2:5], int(sys.argv[5]))
