"""A failure inside one compute task stops the job, names the samples and the task, commits
nothing, and keeps the finished shards for the resume."""

from __future__ import annotations

import pytest

from featstore import ComputeFailed, ComputeOptions, NonFiniteOutput
from featstore.versions._fingerprints import sample_positions

from tests.helpers import QUIET
from tests.models import FailsAt, IdData, NaNAt, TinyA, VectorData

N, SPP, BAD = 256, 32, 200


def receipts(store) -> set[int]:
    return {int(k.rsplit("/", 1)[1].split(".")[0]) for k in store.storage.find("") if "/_receipts/" in k}


def running_tasks(client) -> int:
    """Tasks occupying a worker thread now, on every worker, plus those the scheduler has
    processing: also the tasks the failed compute cancelled (the scheduler forgets a cancelled
    task at once, the worker runs it to its end)."""
    per_worker = client.run(lambda dask_worker: len(dask_worker.state.all_running_tasks))
    return sum(per_worker.values()) + sum(map(len, client.processing().values()))


def quiescent(client, timeout: float = 120.0) -> None:
    """Wait until the cluster runs no task. A failed compute raises as soon as one task fails;
    the other tasks already running finish their current shards (Dask cannot stop a running
    task), so the receipts on storage settle only once they are done. Raises if they are still
    running after ``timeout`` seconds (the test could not judge the receipts)."""
    import time

    deadline = time.monotonic() + timeout
    while n := running_tasks(client):
        if time.monotonic() > deadline:
            raise AssertionError(f"the cluster is still busy after {timeout} s ({n} tasks running or processing)")
        time.sleep(0.2)


def test_dataset_error_in_one_task_keeps_finished_shards(local_store, dask_client):
    assert BAD not in sample_positions(N)  # the driver's fingerprint sampling does not hit it
    kw = dict(model=TinyA(), keep=["target"], outputs={"features": "float32", "logits": "float32"},
              batch_size=16, samples_per_shard=SPP, client=dask_client, options=QUIET)
    with pytest.raises(ComputeFailed) as err:
        local_store.compute("fail/set", dataset=FailsAt(N, BAD), **kw)
    msg = str(err.value)
    assert "dataset[200] raised ValueError: cannot decode item 200" in msg and "featstore-shards-" in msg
    assert local_store.versions("fail/set") == []
    quiescent(dask_client)
    kept = receipts(local_store)
    assert BAD // SPP not in kept and kept  # the broken shard is not marked finished; others are
    v = local_store.compute("fail/set", dataset=VectorData(N), **kw)  # the data fixed, same content
    assert v.manifest.timings["shards_computed"] == N // SPP - len(kept)
    assert v.verify() == []


def test_nan_in_one_task_reports_the_sample_and_keeps_finished_shards(local_store, dask_client):
    with pytest.raises(NonFiniteOutput, match=r"first: \[150\].*featstore-shards-"):
        local_store.compute("nan/set", model=NaNAt(150), dataset=IdData(N), outputs={"out": "float32"},
                            batch_size=16, samples_per_shard=SPP, client=dask_client, options=QUIET)
    quiescent(dask_client)
    kept = receipts(local_store)
    assert 150 // SPP not in kept and kept
    v = local_store.compute("nan/set", model=NaNAt(150), dataset=IdData(N), outputs={"out": "float32"},
                            batch_size=16, samples_per_shard=SPP, client=dask_client,
                            options=ComputeOptions(progress=False, allow_nonfinite=True))
    assert v.manifest.timings["shards_computed"] == N // SPP - len(kept)
    assert v.manifest.stats["out"]["nonfinite_samples"] == [150]
