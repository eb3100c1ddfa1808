"""Compute a frozen Model A's outputs into a local store once, then distil them into Model B with
Lightning's Trainer on 2 CPU ranks (DDP, gloo), through featstore.lightning's data module.

    pip install 'featstore[lightning]'
    python examples/distill_lightning.py [STORE_DIR]

Every rank reads its own share of each epoch (a new order each epoch, without set_epoch), and
the ModelCheckpoint taken mid-epoch resumes with every sample exactly once:
``python examples/distill_lightning.py STORE_DIR --resume`` continues from the last checkpoint.
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F

import featstore
from featstore.demo import ModelA, SyntheticImages
from featstore.lightning import FeatureDataModule, LoaderOptions


class Student(pl.LightningModule):
    """An MLP on A's features: one head learns the labels, one distils A's 1000 logits."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(128, 256), nn.ReLU())
        self.classify, self.distill = nn.Linear(256, 10), nn.Linear(256, 1000)

    def training_step(self, batch, batch_idx):
        h = self.body(batch["features"].float())
        logits = self.classify(h)
        loss = F.cross_entropy(logits, batch["target"]) + F.kl_div(
            F.log_softmax(self.distill(h), 1), F.log_softmax(batch["logits"], 1), log_target=True,
            reduction="batchmean")
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self.classify(self.body(batch["features"].float()))
        self.log("val_accuracy", (logits.argmax(1) == batch["target"]).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main(root: str = "./example-store", *flags: str) -> None:
    if "--resume" not in flags:  # compute A once (an embedded Dask LocalCluster); a rerun finds it
        store = featstore.open_store(root)
        data = SyntheticImages(8000)
        train = store.compute("example/cnn-a", model=ModelA(), dataset=data, input_key="input", keep=["target"],
                              outputs={"features": "float16", "logits": "float32"}, batch_size=256)
        store.tag(train, "latest-example")
        print(f"stored {train}")
    dm = FeatureDataModule(root, train="example/cnn-a@latest-example", val="example/cnn-a@latest-example",
                           batch_size=256, seed=0, loader=LoaderOptions(num_workers=2, persistent_workers=True))
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=f"{root}/checkpoints", filename="last",
                                               every_n_train_steps=5, save_on_train_epoch_end=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=3, callbacks=[checkpoints],
                         logger=False, limit_val_batches=4)
    trainer.fit(Student(), datamodule=dm,
                ckpt_path=f"{root}/checkpoints/last.ckpt" if "--resume" in flags else None)


if __name__ == "__main__":
    main(*sys.argv[1:])
