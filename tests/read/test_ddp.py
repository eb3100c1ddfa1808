"""DDP (gloo, CPU) x DataLoader workers x shard layouts that do not divide evenly, and the
DataLoader worker matrix (workers x start methods x parent-used-S3) against the S3 store."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

import featstore
from featstore.versions import stored
from tests.ddp_child import run
from tests.helpers import write_version


@pytest.fixture(scope="module")
def layouts(shared_versions, tmp_path_factory):
    """11 shards for 2 or 3 ranks (333 samples in shards of 32: uneven at every consumer count),
    and fewer shards than consumers (100 samples in shards of 48)."""
    store = featstore.open_store(tmp_path_factory.mktemp("ddp") / "store")
    return {"11-shards": shared_versions["local"],
            "fewer-shards-than-consumers": write_version(store, "ddp/fewer", n=100, samples_per_shard=48)}


# Real gloo process groups for what only they show: each rank's dataset takes its rank and world
# size from torch.distributed, in DataLoader workers too, and a collective per step plus one after
# the loop complete (uneven batch counts would hang). Both layouts, both world sizes, with and
# without workers, each once; the ranks x workers x layouts arithmetic (equal counts per consumer,
# coverage, the padding) is tests/read/test_plan.py's, over every combination, in milliseconds;
# equal batch counts per rank through real DataLoader workers, tests/read/test_dataset.py's.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,world,workers", [("11-shards", 2, 0), ("fewer-shards-than-consumers", 3, 2)])
def test_ddp_ranks_yield_equal_batches_and_cover_every_sample(layouts, layout, world, workers, tmp_path):
    version = layouts[layout]
    mp.spawn(run, args=(world, str(tmp_path / "init"), version, workers, str(tmp_path)), nprocs=world,
             join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert [r["rank"] for r in results] == list(range(world)) and {r["world"] for r in results} == {world}
    counts = {r["batches"] for r in results}
    assert len(counts) == 1 and counts.pop() > 0  # the same number of batches on every rank
    assert {r["total"] for r in results} == {results[0]["batches"] * world}  # the collective completed
    seen = [i for r in results for i in r["indices"]]
    n = len(version)
    assert set(seen) == set(range(n))
    assert len(seen) - n < world * max(1, workers)  # only the documented padding repeats


@pytest.fixture(scope="module")
def s3_version(shared_versions):
    """The S3 version and its values, read here once (so each test's own Version object is fresh)."""
    v = shared_versions["s3"]
    return v, v.load()


# Every start method with 2 workers (what a start method changes is the same for 2 workers as
# for 4; how 4 consumers split the samples is tests/read/test_plan.py's arithmetic).
MATRIX = [(0, None)] + [(2, c) for c in ("fork", "spawn", "forkserver")]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("parent_used_s3", [False, True])
@pytest.mark.parametrize("workers,context", MATRIX)
def test_dataloader_matrix_on_s3(s3_version, workers, context, parent_used_s3):
    if context is not None and context not in multiprocessing.get_all_start_methods():
        pytest.skip(f"this platform has no {context!r} start method ({multiprocessing.get_all_start_methods()})")
    s3_version, expected = s3_version
    # A fresh Version object each time: the "parent did not use S3" case must really not have.
    storage = stored(s3_version).storage
    version = featstore.open_store(storage.url, storage._options).open(s3_version.ref)
    if parent_used_s3:
        assert torch.equal(version.load()["features"], expected["features"])
    ds = version.dataset(batch_size=20, seed=4)
    for epoch in range(2 if context in (None, "fork") else 1):  # spawned workers are slow to start
        ds.set_epoch(epoch)
        loader = DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context=context,
                            timeout=60 if workers else 0)
        batches = list(loader)
        idx = torch.cat([b["index"] for b in batches])
        assert sorted(idx.tolist()) == list(range(len(version)))  # exactly once per epoch
        for field in ("features", "logits"):  # and each row is the stored row of its index
            assert torch.equal(torch.cat([b[field] for b in batches]), expected[field][idx]), field
