"""FeatureDataset through real DataLoader worker processes, on local disk and S3."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from featstore.versions import stored
from featstore import InvalidInput

from tests.helpers import epoch

N = 333


@pytest.fixture(scope="module")
def versions(shared_versions):
    """One version (N samples, shards of 32) on local disk and one on S3, shared with other files."""
    return {kind: shared_versions[kind] for kind in ("local", "s3")}


@pytest.mark.parametrize("workers", [0, 2])
def test_one_rank_reads_every_sample_once_with_correct_values(versions, workers):
    v = versions["local"]
    ref = v.load()
    ds = v.dataset(batch_size=25, shuffle=True, seed=1)
    batches = epoch(ds, workers)
    idx = torch.cat([b["index"] for b in batches])
    assert sorted(idx.tolist()) == list(range(N))
    for b in batches:  # each row is the row of its index
        assert torch.equal(b["logits"], ref["logits"][b["index"]])
        assert torch.equal(b["target"], ref["target"][b["index"]])
        assert b["features"].dtype == torch.float16
    assert all(len(b["index"]) == 25 for b in batches[:-2])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("workers", [0, 2])
def test_ranks_get_equal_batch_counts_and_cover_everything(versions, world, workers):
    v = versions["local"]
    per_rank = []
    seen = []
    for rank in range(world):
        ds = v.dataset(batch_size=16, rank=rank, world_size=world, seed=3)
        batches = epoch(ds, workers)
        assert len(batches) == ds.batches_per_rank(workers)
        per_rank.append(len(batches))
        seen += torch.cat([b["index"] for b in batches]).tolist()
    assert len(set(per_rank)) == 1  # uneven ranks would hang DDP
    assert set(seen) == set(range(N))
    assert len(seen) - N < world * max(1, workers)  # only the padding repeats


def test_drop_partition_has_no_repeats(versions):
    v = versions["local"]
    seen = []
    for rank in range(2):
        seen += torch.cat([b["index"] for b in epoch(v.dataset(batch_size=10, rank=rank, world_size=2,
                                                               partition="drop"), 0)]).tolist()
    assert len(seen) == len(set(seen)) == N - N % 2


def test_same_seed_same_order_next_epoch_different(versions):
    v = versions["local"]
    a, b = v.dataset(seed=5, batch_size=50), v.dataset(seed=5, batch_size=50)
    order = lambda ds: torch.cat([x["index"] for x in epoch(ds, 2)]).tolist()
    first = order(a)
    assert first == order(b)
    a.set_epoch(1)
    second = order(a)
    assert second != first and sorted(second) == sorted(first)


def test_no_shuffle_reads_in_order(versions):
    v = versions["local"]
    idx = torch.cat([b["index"] for b in epoch(v.dataset(shuffle=False, batch_size=40), 0)])
    assert idx.tolist() == list(range(N))


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_s3_workers_after_parent_used_s3(versions, context):
    v = versions["s3"]
    first = v[0:5]["logits"]  # the parent touches S3 first: its fs/loop must not leak into workers
    ds = v.dataset(batch_size=40, seed=2)
    batches = epoch(ds, 2, context=context)
    idx = torch.cat([b["index"] for b in batches])
    assert sorted(idx.tolist()) == list(range(N))
    by_index = {int(i): row for b in batches for i, row in zip(b["index"], b["logits"], strict=True)}
    assert all(torch.equal(by_index[i], first[i]) for i in range(5))


@pytest.mark.parametrize("workers", [0, 2])
def test_state_dict_resumes_mid_epoch(versions, workers):
    v = versions["local"]
    full = epoch(v.dataset(batch_size=20, seed=7), workers)
    k = 7
    ds = v.dataset(batch_size=20, seed=7)
    state = ds.state_dict(batches_seen=k)
    resumed_ds = v.dataset(batch_size=20, seed=7)
    resumed_ds.load_state_dict(state)
    rest = epoch(resumed_ds, workers)
    assert [b["index"].tolist() for b in rest] == [b["index"].tolist() for b in full[k:]]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_persistent_workers_follow_set_epoch_and_resume(versions, context):
    v = versions["local"]
    fresh = [epoch(_at(v.dataset(batch_size=20, seed=4), e), 2) for e in range(3)]
    ds = v.dataset(batch_size=20, seed=4)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context=context, timeout=120)
    seen = []
    for e in range(3):
        ds.set_epoch(e)
        seen.append([b["index"].tolist() for b in loader])
    # the same workers, yet every epoch is that epoch's order (not epoch 0's again)
    assert seen == [[b["index"].tolist() for b in f] for f in fresh]
    assert seen[0] != seen[1] and all(sorted(sum(s, [])) == list(range(N)) for s in seen)
    # a resume point set after the workers started reaches them too
    ds.load_state_dict(v.dataset(batch_size=20, seed=4).state_dict(batches_seen=5) | {"epoch": 1})
    ds.set_epoch(1)
    assert [b["index"].tolist() for b in loader] == seen[1][5:]


def _at(ds, e):
    ds.set_epoch(e)
    return ds


def test_state_dict_counts_batches_in_process(versions):
    v = versions["local"]
    ds = v.dataset(batch_size=30, seed=1)
    it = iter(ds)
    got = [next(it) for _ in range(4)]
    state = ds.state_dict()
    assert state["batches_seen"] == 4 and state["streams"][0]["members"][0]["id"] == v.id
    ds2 = v.dataset(batch_size=30, seed=1)
    ds2.load_state_dict(state)
    nxt = next(iter(ds2))
    assert torch.equal(nxt["index"], next(it)["index"])
    assert got[0]["index"].tolist() != nxt["index"].tolist()


def test_state_dict_rejects_other_settings(versions):
    v = versions["local"]
    state = v.dataset(batch_size=30).state_dict(batches_seen=1)
    with pytest.raises(InvalidInput, match="must match"):
        v.dataset(batch_size=31).load_state_dict(state)


def test_fields_and_bad_options(versions):
    v = versions["local"]
    b = next(iter(v.dataset(fields=("target",), batch_size=8)))
    assert set(b) == {"target", "index"}
    with pytest.raises(InvalidInput):
        v.dataset(fields=("nope",))
    with pytest.raises(InvalidInput):
        v.dataset(batch_size=0)
    with pytest.raises(InvalidInput):
        v.dataset(partition="sideways")


def test_reader_fast_path_reads_featstore_layout(versions):
    """Versions featstore writes are read by the whole-shard fast path, never silently by zarr."""
    v = versions["local"]
    ds = v.dataset(batch_size=32, shuffle=False)
    assert all(ds.process_reads().shard_format(f) is not None for f in ds.fields)
    got = torch.cat([b["logits"] for b in ds])
    assert torch.equal(got, v[0:len(v)]["logits"])


def _client_in_worker(_: int) -> None:
    """worker_init_fn: which client this worker's reads go through, as an attribute of the
    dataset copy (read back through a batch is not possible; the assertion is in the worker)."""
    from torch.utils.data import get_worker_info

    ds = get_worker_info().dataset
    getter = ds.process_reads().storage._s3_getter()
    from featstore.storage import _s3_reads as s3get

    assert (getter is None) == (not s3get.usable()), "obstore used where its runtime cannot run"


@pytest.mark.timeout(180)
def test_fork_workers_after_parent_used_obstore(versions):
    """The parent reads a shard object through obstore (its tokio runtime starts), then forks
    DataLoader workers: they must not touch the inherited runtime (it hangs), read through s3fs,
    and yield every sample once with the stored values, within the DataLoader timeout."""
    from featstore.storage import _s3_reads as s3get

    v = versions["s3"]
    ds = v.dataset(batch_size=40, seed=5)
    storage = ds.process_reads().storage
    assert storage._s3_getter() is not None or not s3get.usable()  # obstore in this process
    key = stored(v).object_key("logits", 0)
    assert storage.read_bytes(key)  # the runtime is started now (or was already)
    assert s3get._STARTED_IN is not None or not s3get.usable()
    expected = v.load()
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60,
                        worker_init_fn=_client_in_worker)
    batches = list(loader)
    idx = torch.cat([b["index"] for b in batches])
    assert sorted(idx.tolist()) == list(range(N))
    for field in ("features", "logits"):
        assert torch.equal(torch.cat([b[field] for b in batches]), expected[field][idx]), field
