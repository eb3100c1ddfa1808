"""An unmodified transformers Trainer and TRL's SFTTrainer on featstore soft labels (issue 31):
the teacher's columns survive the Trainer's defaults, 2 gloo ranks under torchrun read disjoint
samples, and a checkpoint resumes mid-epoch exactly."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.hf.conftest import N
from tests.hf.trainer_child import run

ROOT = Path(__file__).resolve().parents[2]


def _all_trained(trained: list[list[int]]) -> list[int]:
    return [i for step in trained for i in step]


def test_the_trainer_with_its_defaults_trains_on_every_sample(world, tmp_path):
    store, v, _, _ = world
    got = run(store.storage.url, v.ref, str(tmp_path), "map", steps=N // 4)  # one epoch
    assert sorted(_all_trained(got["trained"])) == list(range(N))  # remove_unused_columns=True left them
    assert sorted(got["read"]) == list(range(N)) and math.isfinite(got["loss"])


def test_sft_trainer_trains_on_the_iterable(world, tmp_path):
    pytest.importorskip("trl")
    store, v, _, _ = world
    got = run(store.storage.url, v.ref, str(tmp_path), "iterable", steps=4, sft=True)
    seen = _all_trained(got["trained"])
    assert len(seen) == 16 == len(set(seen)) and math.isfinite(got["loss"])


@pytest.mark.parametrize("mode", ["map", "iterable"])
def test_a_checkpoint_resumes_mid_epoch_exactly(world, tmp_path, mode):
    store, v, _, _ = world
    steps, at = 9, 4  # 12 steps per epoch of the map-style dataset: both mid-epoch
    whole = run(store.storage.url, v.ref, str(tmp_path / "whole"), mode, steps)
    run(store.storage.url, v.ref, str(tmp_path / "first"), mode, steps, save_strategy="steps", save_steps=at)
    resumed = run(store.storage.url, v.ref, str(tmp_path / "first"), mode, steps,
                  resume=str(tmp_path / "first" / f"checkpoint-{at}"))
    assert resumed["trained"] == whole["trained"][at:]
    for name, w in whole["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], w, rtol=1e-5, atol=1e-6)


def _torchrun(store_url: str, ref: str, out: Path, mode: str, steps: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "tests.hf.trainer_child", store_url, ref, str(out), mode, str(steps)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("mode,steps", [("map", N // 8), ("iterable", 5)])
def test_two_torchrun_ranks_read_and_train_on_disjoint_samples(world, tmp_path, mode, steps):
    store, v, _, _ = world
    proc = _torchrun(store.storage.url, v.ref, tmp_path, mode, steps)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    trained = [_all_trained(r["trained"]) for r in ranks]
    assert not set(trained[0]) & set(trained[1]) and len(trained[0]) == len(trained[1]) == 4 * steps
    assert not set(ranks[0]["read"]) & set(ranks[1]["read"])  # nothing read twice
    if mode == "map":  # the Trainer's sampler shards the indices: each rank reads exactly what it trains on
        assert sorted(trained[0] + trained[1]) == list(range(N))
        assert [sorted(r["read"]) for r in ranks] == [sorted(t) for t in trained]


def test_the_iterable_under_the_trainers_dispatch_default_is_refused_saying_what_to_set(world, tmp_path):
    # accelerate dispatches an iterable's batches from rank 0 by default; it refuses batches of
    # different lengths (a language model's), naming the setting (dispatch_batches=False)
    store, v, _, _ = world
    proc = _torchrun(store.storage.url, v.ref, tmp_path, "iterable-dispatch", 3)
    assert proc.returncode != 0 and "dispatch_batches=False" in proc.stdout + proc.stderr
