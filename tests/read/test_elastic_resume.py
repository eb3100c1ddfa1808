"""Elastic resume through the real reader: a job of several ranks (simulated in this process with
``rank=``/``world_size=``), each with its own DataLoader and real worker processes, saves a state
mid-epoch and resumes it under another world size, number of workers, or both. Every sample of the
epoch is read exactly once across before and after (partition="even"), and the same split resumed
twice reads the same order; and once with real gloo process groups (2 ranks saved, 4 resumed).
Before this change, another world size raised "world_size must match".
"""

from __future__ import annotations

from collections import Counter

import pytest
from torch.utils.data import DataLoader

from featstore import InvalidInput, StatefulLoader

N = 400
GLOBAL = 12  # the global batch: world x batch_size, kept across splits
SEED = 3


@pytest.fixture(scope="module")
def version(shared_versions):
    return shared_versions["local-400"]


def dataset(version, world, rank):
    return version.dataset(batch_size=GLOBAL // world, seed=SEED, partition="even", rank=rank, world_size=world)


def loader(ds, workers, cls=DataLoader):
    return cls(ds, batch_size=None, num_workers=workers, timeout=120 if workers else 0)


def run(version, world, workers, steps=None, state=None):
    """Each rank's batches (index lists): ``steps`` of them (None: to the epoch's end), resuming
    ``state`` if given; and rank 0's state after them."""
    out, saved = [], None
    for r in range(world):
        ds = dataset(version, world, r)
        if state is not None:
            ds.load_state_dict(state)
        got = []
        for b in loader(ds, workers):
            got.append(b["index"].tolist())
            if steps is not None and len(got) == steps:
                break
        out.append(got)
        if r == 0 and steps is not None:
            saved = ds.state_dict(batches_seen=len(got) + (0 if state is None else state["batches_seen"]),
                                  num_workers=workers)
    return out, saved


def rows(per_rank):
    return [i for batches in per_rank for b in batches for i in b]


# (world, workers) before -> after: grow and shrink the world, change the workers, both
CHANGES = [((2, 0), (4, 0)), ((4, 1), (1, 0)), ((2, 2), (3, 0)), ((1, 0), (2, 2)), ((3, 2), (2, 1)), ((1, 2), (1, 0))]


@pytest.mark.parametrize("before,after", CHANGES, ids=[f"{a}->{b}" for a, b in CHANGES])
def test_state_resumes_under_another_split_every_sample_once(version, before, after):
    seen, state = run(version, *before, steps=5)
    assert "progress" in state
    rest, _ = run(version, *after, state=state)
    assert Counter(rows(seen) + rows(rest)) == Counter(range(N))
    assert len(rows(seen)) == 5 * GLOBAL


def test_two_resumes_in_one_epoch_and_the_same_split_twice_same_order(version):
    seen1, s1 = run(version, 2, 2, steps=4)
    seen2, s2 = run(version, 3, 0, steps=3, state=s1)
    assert len(s2["progress"]["segments"]) == 2
    rest, _ = run(version, 1, 2, state=s2)
    assert Counter(rows(seen1) + rows(seen2) + rows(rest)) == Counter(range(N))
    again, _ = run(version, 1, 2, state=s2)
    assert again == rest  # deterministic


def test_next_epoch_after_a_resumed_one_is_whole(version):
    _, state = run(version, 2, 0, steps=6)
    ds = dataset(version, 4, 0)
    ds.load_state_dict(state)
    it = loader(ds, 0)
    list(it)  # the rest of epoch 0
    nxt = [b["index"].tolist() for b in it]  # epoch 1, whole, as a fresh run would read it
    fresh = dataset(version, 4, 0)
    fresh.set_epoch(1)
    assert nxt == [b["index"].tolist() for b in loader(fresh, 0)]


def test_old_state_without_progress_loads_under_the_same_split_only(version):
    full, _ = run(version, 2, 0)
    _, state = run(version, 2, 0, steps=5)
    old = {k: v for k, v in state.items() if k != "progress"}
    rest, _ = run(version, 2, 0, state=old)
    assert rest == [b[5:] for b in full]
    with pytest.raises(InvalidInput, match="world_size must match"):
        dataset(version, 3, 0).load_state_dict(old)


def test_global_batch_that_does_not_divide_is_refused_with_the_valid_world_sizes(version):
    _, state = run(version, 2, 0, steps=2)
    ds = version.dataset(batch_size=2, seed=SEED, partition="even", rank=0, world_size=5)
    with pytest.raises(InvalidInput, match=r"divides 12 \(1, 2, 3, 4, 6, 12\)"):
        ds.load_state_dict(state)
    with pytest.raises(InvalidInput, match="batch_size=3"):
        version.dataset(batch_size=6, seed=SEED, partition="even", rank=0, world_size=4).load_state_dict(state)


@pytest.mark.parametrize("workers_before,workers_after", [(2, 0), (2, 1), (1, 2)])
def test_stateful_loader_resumes_with_another_number_of_workers(version, workers_before, workers_after):
    """torchdata's per-worker states, saved by 2 ranks' loaders, resumed by one rank."""
    seen, state = [], None
    for r in range(2):
        ld = loader(dataset(version, 2, r), workers_before, StatefulLoader)
        it = iter(ld)
        seen.append([next(it)["index"].tolist() for _ in range(5)])
        if r == 0:  # a reader has a length: its loader's state is after the batches yielded
            state = ld.state_dict()
        del it
    resumed = loader(dataset(version, 1, 0), workers_after, StatefulLoader)
    resumed.load_state_dict(state)
    rest = [b["index"].tolist() for b in resumed]
    assert Counter(rows(seen) + [i for b in rest for i in b]) == Counter(range(N))


# Real gloo process groups: a job of 2 ranks saves rank 0's state mid-epoch, and a job of 4 ranks
# with a DataLoader worker each resumes it, with a collective per step (unequal batch counts on the
# resumed ranks would hang). 400 samples, global batch 8: every split divides, so nothing pads.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_real_ddp_job_resumes_on_twice_the_ranks_every_sample_once(version, tmp_path):
    import json

    import torch.multiprocessing as mp

    from tests.ddp_child import elastic_run

    def job(world, workers, steps, name):
        out = tmp_path / name
        out.mkdir()
        mp.spawn(elastic_run, args=(world, str(out / "init"), version, workers, str(out), 8, steps,
                                    str(tmp_path / "state.json")), nprocs=world, join=True)
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]

    before = job(2, 0, 7, "before")
    assert [r["batches"] for r in before] == [7, 7]
    after = job(4, 1, None, "after")
    counts = {r["batches"] for r in after}
    assert len(counts) == 1 and {r["total"] for r in after} == {4 * counts.pop()}  # the collectives completed
    seen = [i for r in before + after for i in r["indices"]]
    assert Counter(seen) == Counter(range(N))
    assert len([i for r in before for i in r["indices"]]) == 7 * 8
