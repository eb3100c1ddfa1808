"""Real Lightning Trainers and torchrun on 2 CPU ranks (gloo): every rank reads its own samples
wherever the dataset was built, every epoch is a new order without set_epoch, and
featstore.lightning's data module resumes a mid-epoch checkpoint with every sample once.

Each run is a subprocess (tests/lightning_child.py, tests/torchrun_child.py); one Trainer covers
the dataset cases of a strategy at once (ddp: four; ddp_spawn: the two that differ from ddp), to keep
2-core CI cheap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from featstore.versions import stored

from .helpers import SharedVersions
from .lightning_child import CASES_OF
from tests.read.test_clients import figures

ROOT = Path(__file__).resolve().parents[1]
N = SharedVersions.KINDS["local-400"][0]  # 4 consumers (2 ranks x 2 workers) of 100: no padding, ranks disjoint


@pytest.fixture(scope="module")
def version(shared_versions):
    return shared_versions["local-400"]


def _run(args: list[str], timeout: float = 600) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


STEPS = 3  # the data module's first run stops here, mid-epoch (of 8 steps per rank and epoch)


@pytest.fixture(scope="module")
def runs(version, tmp_path_factory):
    """Each strategy's child run, once: ``ddp`` also runs the data module's two fits (in the
    same processes, to pay Lightning's start-up once)."""
    done: dict[str, Path] = {}

    def run(strategy: str) -> Path:
        if strategy not in done:
            out = tmp_path_factory.mktemp(strategy)
            _run(["-m", "tests.lightning_child", strategy, stored(version).storage.url, version.ref, str(out),
                  *([str(STEPS)] if strategy == "ddp" else [])])
            done[strategy] = out
        return done[strategy]
    return run


def _ranks(out: Path) -> list[dict[str, list[int]]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _check_split(ranks: list[dict[str, list[int]]], key: str, what: str) -> dict[str, int]:
    a, b = ranks[0][key], ranks[1][key]
    assert len(a) == len(b), f"{what}: uneven ranks"
    assert not set(a) & set(b), f"{what}: {len(set(a) & set(b))} samples read by both ranks"
    got = figures(a + b)
    assert got == {"rows": N, "duplicates": 0, "missing": 0}, (what, got)
    return got


@pytest.mark.timeout(660)
@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp"])
def test_lightning_ranks_and_epochs_wherever_the_dataset_is_built(runs, strategy):
    ranks = _ranks(runs(strategy) / "grid")
    for case in CASES_OF[strategy]:
        for epoch in (0, 1):
            _check_split(ranks, f"{epoch}/{case}", f"{strategy} {case} epoch {epoch}")
        assert ranks[0][f"0/{case}"] != ranks[0][f"1/{case}"], f"{case}: epoch 1 repeated epoch 0's order"
        print(f"\n{strategy} {case}: per epoch {figures(ranks[0][f'1/{case}'] + ranks[1][f'1/{case}'])}")


@pytest.mark.timeout(660)
def test_lightning_data_module_resumes_a_mid_epoch_checkpoint_exactly_once(runs):
    out = runs("ddp")
    first, second = _ranks(out / "first"), _ranks(out / "second")
    assert all(len(r["0/train"]) == (STEPS + 1) * 25 for r in first)  # one step past the checkpoint
    joined = [{"0/train": f["0/train"][:STEPS * 25] + s["0/train"], "1/train": s["1/train"]}
              for f, s in zip(first, second, strict=True)]
    epoch0 = _check_split(joined, "0/train", "data module, epoch 0 interrupted and resumed")
    _check_split(joined, "1/train", "data module, epoch 1")
    assert joined[0]["0/train"] != joined[0]["1/train"]
    print(f"\ndata module resumed at step {STEPS}: epoch 0 {epoch0}")


@pytest.mark.timeout(660)
def test_lightning_checkpoint_of_two_ranks_resumes_on_one_device_exactly_once(runs, version):
    """The same mid-epoch checkpoint resumed on 1 device, 1 worker, batch 50 (the global batch of
    2 ranks x 25): the rest of epoch 0 once, then a whole epoch 1."""
    out = runs("ddp")
    _run(["-m", "tests.lightning_child", "resume-on-1", stored(version).storage.url, version.ref, str(out)])
    first = _ranks(out / "first")
    second = json.loads((out / "second-1" / "rank0.json").read_text())
    before = [i for r in first for i in r["0/train"][:STEPS * 25]]
    got = figures(before + second["0/train"])
    assert got == {"rows": N, "duplicates": 0, "missing": 0}, got
    assert figures(second["1/train"]) == {"rows": N, "duplicates": 0, "missing": 0}
    assert second["1/train"] != second["0/train"]
    print(f"\n2-rank checkpoint at step {STEPS} resumed on 1 device: epoch 0 {got}")


@pytest.mark.timeout(300)
def test_torchrun_ranks_from_the_environment_and_the_process_group(version, tmp_path):
    _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "tests.torchrun_child",
          stored(version).storage.url, version.ref, str(tmp_path)])
    ranks = _ranks(tmp_path)
    for case in ("early-persistent", "late"):
        for epoch in (0, 1):
            _check_split(ranks, f"{epoch}/{case}", f"torchrun {case} epoch {epoch}")
        assert ranks[0][f"0/{case}"] != ranks[0][f"1/{case}"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers,drop_last,per_epoch", [(0, False, 14), (2, False, 14), (2, True, 12)])
def test_estimated_stepping_batches_and_a_one_cycle_schedule_count_the_readers_batches(version, workers, drop_last,
                                                                                      per_epoch):
    """len() of the data module's loader is the batches the reader yields (400 samples, batch 30:
    14 in one process; 2 workers of 200: 7 each, 6 each with drop_last), so Lightning's
    estimated_stepping_batches is the run's steps and a OneCycleLR sized by it steps to its end."""
    import lightning.pytorch as pl

    from featstore.lightning import FeatureDataModule, LoaderOptions

    class Counting(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.steps = torch.nn.Linear(8, 1), 0

        def training_step(self, batch, i):
            self.steps += 1
            return self.lin(batch["features"].float()).mean()

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.01)
            total = self.trainer.estimated_stepping_batches
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.OneCycleLR(
                opt, max_lr=0.1, total_steps=total), "interval": "step"}}

    dm = FeatureDataModule(stored(version).storage.url, train=version.ref, batch_size=30, seed=1, drop_last=drop_last,
                           loader=LoaderOptions(num_workers=workers))
    model = Counting()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)  # OneCycleLR raises if stepped past total_steps
    assert trainer.estimated_stepping_batches == model.steps == 2 * per_epoch
    assert len(dm.train_dataloader()) == per_epoch
