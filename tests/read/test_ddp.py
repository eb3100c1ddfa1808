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
from featstore import ComputeOptions
from featstore.versions import stored

from tests.ddp_child import run
from tests.models import TinyA, VectorData

LAYOUTS = {"11-shards": (333, 32), "fewer-shards-than-consumers": (100, 48)}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, dask_client):
    store = featstore.open_store(tmp_path_factory.mktemp("ddp") / "store")
    return {k: store.compute(f"ddp/{k}", model=TinyA(), dataset=VectorData(n), samples_per_shard=spp,
                             outputs={"features": "float32", "logits": "float32"}, client=dask_client,
                             options=ComputeOptions(progress=False, chunk_rows=16))
            for k, (n, spp) in LAYOUTS.items()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("workers", [0, 2])
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
def s3_version(dask_client, moto_endpoint):
    """The S3 version and its values, read here once (so each test's own Version object is fresh)."""
    import uuid

    import boto3

    bucket = f"dl-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=bucket)
    store = featstore.open_store(f"s3://{bucket}/f", {"endpoint_url": moto_endpoint})
    v = store.compute("dl/s3", model=TinyA(), dataset=VectorData(250), samples_per_shard=32,
                      outputs={"features": "float32", "logits": "float32"}, client=dask_client,
                      options=ComputeOptions(progress=False, chunk_rows=16))
    return v, v.load()


# Every start method with 2 workers; 4 workers once (spawn, the slowest and strictest).
MATRIX = [(0, None)] + [(2, c) for c in ("fork", "spawn", "forkserver")] + [(4, "spawn")]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("parent_used_s3", [False, True])
@pytest.mark.parametrize("workers,context", MATRIX)
def test_dataloader_matrix_on_s3(s3_version, workers, context, parent_used_s3):
    if context is not None and context not in multiprocessing.get_all_start_methods():
        pytest.skip(f"this platform has no {context!r} start method ({multiprocessing.get_all_start_methods()})")
    s3_version, expected = s3_version
    # A fresh Version object each time: the "parent did not use S3" case must really not have.
    version = featstore.open_store(stored(s3_version).storage.url, stored(s3_version).storage._options).open(
        f"dl/s3@{s3_version.id}")
    if parent_used_s3:
        assert torch.equal(version.load()["features"], expected["features"])
    ds = version.dataset(batch_size=20, seed=4)
    for epoch in range(2 if context in (None, "fork") else 1):  # spawned workers are slow to start
        ds.set_epoch(epoch)
        loader = DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context=context,
                            timeout=60 if workers else 0)
        batches = list(loader)
        idx = torch.cat([b["index"] for b in batches])
        assert sorted(idx.tolist()) == list(range(250))  # exactly once per epoch
        for field in ("features", "logits"):  # and each row is the stored row of its index
            assert torch.equal(torch.cat([b[field] for b in batches]), expected[field][idx]), field
