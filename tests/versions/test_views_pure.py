"""The pure side of augmented views: seeds, the view each epoch reads, replay checks, the join."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from featstore.errors import InvalidInput, NondeterministicAugment
from featstore.versions._views import (
    SourceJoin, ViewDataset, check_replayable, check_view_mode, epoch_seeds, epoch_view, item_columns,
    item_fields, replay, replay_rows, view_seed, view_seeds,
)


def test_view_seeds_are_a_pure_vectorised_function():
    idx = np.arange(1000)
    a = view_seeds(7, 3, idx)
    assert a.dtype == np.int64 and (a >= 0).all()
    assert np.array_equal(a, view_seeds(7, 3, idx))  # pure
    assert [view_seed(7, int(i), 3) for i in idx[:20]] == a[:20].tolist()
    # a change of seed, view or index gives another seed (no collisions on this grid)
    grid = {int(s) for v in range(8) for s in view_seeds(7, v, idx)}
    assert len(grid) == 8 * 1000
    assert not np.array_equal(a, view_seeds(8, 3, idx))
    # pinned: the policy is a stored contract (plain Zarr readers and other tools replay it),
    # so it is derived here from its definition, independently of featstore's numpy code
    assert view_seed(0, 0, 0) == view_seeds(0, 0, [0])[0] == _policy(0, 0, 0) == 1279368494785126216
    for seed in (0, 1, 7, 2**40 + 3, -1):
        for view in (0, 1, 5):
            got = view_seeds(seed, view, np.array([0, 1, 2, 999, 2**33]))
            assert got.tolist() == [_policy(seed, view, i) for i in (0, 1, 2, 999, 2**33)], (seed, view)


_U64 = 2**64 - 1


def _splitmix64(x: int) -> int:
    """splitmix64's finaliser (Steele, Lea & Flood 2014; Vigna's reference C), on Python ints."""
    z = (x + 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def _policy(seed: int, view: int, index: int) -> int:
    """SEED_POLICY "splitmix64(seed,view,index)>>1/v1", from featstore.views' docstring: the
    finaliser applied three times, mixing in the seed, the view and the index in turn, >> 1."""
    return _splitmix64(_splitmix64(_splitmix64(seed & _U64) ^ view) ^ index) >> 1


def test_epoch_seeds_differ_from_view_seeds_and_per_epoch():
    idx = np.arange(50)
    assert not np.array_equal(epoch_seeds(0, 0, idx), view_seeds(0, 0, idx))
    assert not np.array_equal(epoch_seeds(0, 0, idx), epoch_seeds(0, 1, idx))


@pytest.mark.parametrize("views", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_epoch_mode_reads_every_view_once_per_cycle(views, seed):
    for cycle in range(3):
        seen = [epoch_view(views, "epoch", seed, e) for e in range(cycle * views, (cycle + 1) * views)]
        assert sorted(seen) == list(range(views))
    assert [epoch_view(views, "epoch", seed, e) for e in range(views)] == \
        [epoch_view(views, "epoch", seed, e) for e in range(views)]


def test_cycles_use_different_permutations():
    orders = {tuple(epoch_view(8, "epoch", 0, e) for e in range(c * 8, c * 8 + 8)) for c in range(6)}
    assert len(orders) > 1


@pytest.mark.parametrize("views", [1, 3, 16])
def test_random_and_pinned_modes(views):
    draws = [epoch_view(views, "random", 5, e) for e in range(200)]
    assert all(0 <= d < views for d in draws)
    assert draws == [epoch_view(views, "random", 5, e) for e in range(200)]
    if views > 1:
        assert len(set(draws)) == views
    assert {epoch_view(views, views - 1, 5, e) for e in range(10)} == {views - 1}


@pytest.mark.parametrize("mode, views, expect", [
    (None, None, None), (None, 4, "epoch"), ("random", 4, "random"), (3, 4, 3), (np.int64(0), 1, 0),
])
def test_check_view_mode_accepts(mode, views, expect):
    assert check_view_mode(mode, views) == expect


@pytest.mark.parametrize("mode, views", [
    (0, None), ("epoch", None), (4, 4), (-1, 4), ("first", 4), (True, 4), (1.0, 4),
])
def test_check_view_mode_refuses(mode, views):
    with pytest.raises(InvalidInput):
        check_view_mode(mode, views)


def _aug(item, gen):
    return {"input": item["input"] + torch.randn(item["input"].shape, generator=gen), "target": item["target"]}


def _global_aug(item, gen):
    return {"input": item["input"] + torch.randn(item["input"].shape), "target": item["target"]}


def _numpy_aug(item, gen):
    return {"input": item["input"] * float(np.random.rand()), "target": item["target"]}


def _data(n=10):
    g = torch.Generator().manual_seed(0)
    return [{"input": torch.randn(4, generator=g), "target": torch.tensor(i)} for i in range(n)]


def test_view_dataset_replays_bit_identically():
    data = _data()
    vd = ViewDataset(data, _aug, seed=3, view=2)
    again = [_aug(data[i], torch.Generator().manual_seed(view_seed(3, i, 2))) for i in range(len(data))]
    got = vd.__getitems__(list(range(10)))
    assert all(torch.equal(a["input"], b["input"]) for a, b in zip(got, again, strict=True))
    assert torch.equal(vd[4]["input"], again[4]["input"])
    assert not torch.equal(ViewDataset(data, _aug, 3, 1)[4]["input"], vd[4]["input"])


def test_check_replayable_passes_a_generator_augment_and_restores_global_state():
    torch.manual_seed(11)
    np.random.seed(11)
    random.seed(11)
    expect = (torch.rand(1), np.random.rand(), random.random())
    torch.manual_seed(11)
    np.random.seed(11)
    random.seed(11)
    first = check_replayable(_data(), _aug, 0, [0, 9])
    assert torch.equal(first["input"], _aug(_data()[0], torch.Generator().manual_seed(view_seed(0, 0, 0)))["input"])
    assert (torch.rand(1), np.random.rand(), random.random()) == expect


@pytest.mark.parametrize("augment", [_global_aug, _numpy_aug])
def test_check_replayable_detects_global_randomness(augment):
    with pytest.raises(NondeterministicAugment, match="generator"):
        check_replayable(_data(), augment, 0, [0])


def test_item_fields_defaults_and_selectors():
    t = torch.zeros(2)
    assert set(item_fields({"a": t, "b": 1}, None)) == {"a", "b"}
    assert set(item_fields((t, 1), None)) == {"field0", "field1"}
    assert set(item_fields(t, None)) == {"input"}
    assert item_fields({"a": t, "b": 1}, {"y": "b", "n": lambda it: 2}) == {"y": 1, "n": 2}
    with pytest.raises(InvalidInput, match="source_fields"):
        item_fields({"a": t}, {"x": "missing"})


def test_source_join_collates_augmented_rows():
    data = _data()
    join = SourceJoin(data, _aug, {"input": "input"})
    seeds = view_seeds(1, 0, [3, 5])
    rows = join.rows(np.array([3, 5]), seeds)
    assert rows["input"].shape == (2, 4)
    assert torch.equal(rows["input"][1], _aug(data[5], torch.Generator().manual_seed(int(seeds[1])))["input"])
    plain = SourceJoin(data, None, None).rows(np.array([2]), None)
    assert torch.equal(plain["input"][0], data[2]["input"]) and plain["target"].tolist() == [2]


def _every_draw_aug(item, gen):
    """Draws of every kind, odd normal counts included (a CPU generator caches the spare normal
    sample of a pair: a re-seeded generator must not hand the previous row's spare out)."""
    noise = torch.randn(1, generator=gen) + torch.randn(3, dtype=torch.float64, generator=gen).sum()
    extra = torch.empty(5).normal_(generator=gen).sum() + torch.rand(2, generator=gen).sum()
    order = torch.randperm(4, generator=gen)
    keep = torch.bernoulli(torch.full((4,), 0.5), generator=gen)
    return {"input": (item["input"][order] * keep + noise + extra).float(),
            "flip": torch.randint(0, 2, (), generator=gen)}


def test_replay_rows_is_bit_identical_to_a_fresh_generator_per_row():
    data = _data()
    seeds = view_seeds(5, 1, range(len(data)))
    fresh = [replay(_every_draw_aug, it, int(s)) for it, s in zip(data, seeds, strict=True)]
    reused = replay_rows(_every_draw_aug, data, seeds)
    for a, b in zip(fresh, reused, strict=True):
        assert torch.equal(a["input"], b["input"]) and torch.equal(a["flip"], b["flip"])
    # in the join too, batch after batch (the generator carries no state from the last row)
    join = SourceJoin(data, _every_draw_aug, None)
    for rows in ([7, 1, 4], [4, 2]):
        got = join.rows(np.array(rows), view_seeds(5, 1, rows))
        want = [fresh[i] for i in rows]
        assert torch.equal(got["input"], torch.stack([w["input"] for w in want]))
        assert got["flip"].tolist() == [int(w["flip"]) for w in want]
    with pytest.raises(InvalidInput, match="seeds"):
        replay_rows(_aug, data, seeds[:3])


def test_item_columns_match_item_fields_per_row():
    items = [{"a": torch.tensor([i]), "b": i} for i in range(3)]
    cols = item_columns(items, None)
    assert cols == {k: [item_fields(it, None)[k] for it in items] for k in ("a", "b")}
    assert item_columns([(1, 2), (3, 4)], None) == {"field0": [1, 3], "field1": [2, 4]}
    assert list(item_columns([torch.zeros(1), torch.ones(1)], None)) == ["input"]
    assert item_columns(items, {"y": "b", "n": lambda it: 2}) == {"y": [0, 1, 2], "n": [2, 2, 2]}
    assert item_columns([], None) == {}
    with pytest.raises(InvalidInput, match="source_fields"):
        item_columns(items, {"x": "missing"})
