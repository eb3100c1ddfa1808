"""The worker/rank/shuffle arithmetic, exhaustively over ranks x workers x shard layouts."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from featstore.read.plans._assignment import (UniformShards, consumer_plan, consumer_span, dropped_pieces,
                                        round_robin_consumed, shard_order, span_pieces, window_permutation)
from featstore.read.plans._shuffle import ShardPermutation

LAYOUTS = {
    "one-shard": [10],
    "fewer-shards-than-consumers": [7, 7],
    "even": [16] * 6,
    "ragged-tail": [32] * 5 + [3],
    "many-small": [5] * 23 + [2],
    # the layouts tests/read/test_ddp.py reads under real gloo ranks: 333 samples in shards of 32,
    # and 100 in shards of 48 (fewer shards than 2 ranks x 2 workers)
    "ddp-11-shards": [32] * 10 + [13],
    "ddp-fewer-shards-than-consumers": [48, 48, 4],
}


def epoch_indices(sizes, world, workers, partition, seed=0, epoch=0, shuffle=True, window=20):
    """Global sample ids each consumer reads, as {(rank, worker): [ids in read order]}."""
    spp = max(sizes)  # shards are equal-sized except the last, as in a Layout
    w = max(1, workers)
    out = {}
    for rank, worker in itertools.product(range(world), range(w)):
        plan = consumer_plan(sizes, seed=seed, epoch=epoch, shuffle=shuffle, consumers=world * w,
                             cid=rank * w + worker, partition=partition, window=window)
        ids = []
        for wi, window_ in enumerate(plan.windows):
            rows = np.concatenate([np.arange(p.shard * spp + p.lo, p.shard * spp + p.hi) for p in window_])
            if shuffle:
                rows = rows[window_permutation(seed, epoch, rank * w + worker, wi, len(rows))]
            ids.extend(rows.tolist())
        assert len(ids) == plan.n_samples
        out[(rank, worker)] = ids
    return out


def documented_coverage(sizes, world, workers, partition, seed=0, epoch=0) -> Counter:
    """How often each sample is read in an epoch, from the rule in featstore.plan's docstring,
    not from its span code: the samples in the epoch's shard order (``shard_order``, the
    permutation) form one sequence of N; "even" reads it once, "pad" reads C * ceil(N/C)
    positions wrapping around to its start, "drop" its first C * floor(N/C)."""
    spp, n, c = max(sizes), sum(sizes), world * max(1, workers)
    sequence = [s * spp + r for s in shard_order(len(sizes), seed, epoch, True) for r in range(sizes[s])]
    read = {"even": n, "pad": c * -(-n // c), "drop": c * (n // c)}[partition]
    return Counter(sequence[p % n] for p in range(read))


def test_documented_coverage_counts_the_padding_and_the_dropped_tail():
    """The rule itself on a small case: 10 samples (shards of 4, 4, 2) over 3 consumers."""
    order = shard_order(3, 0, 0, True)
    sequence = [s * 4 + r for s in order for r in range((4, 4, 2)[s])]
    assert sorted(sequence) == list(range(10))
    pad, drop = documented_coverage([4, 4, 2], 3, 0, "pad"), documented_coverage([4, 4, 2], 3, 0, "drop")
    assert pad == Counter(range(10)) + Counter(sequence[:2]) and sum(pad.values()) == 12
    assert drop == Counter(sequence[:9]) and sequence[9] not in drop


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_even_partition_reads_every_sample_exactly_once(layout, world, workers):
    sizes = LAYOUTS[layout]
    got = epoch_indices(sizes, world, workers, "even")
    flat = [i for ids in got.values() for i in ids]
    spp = max(sizes)
    expected = [s * spp + r for s, size in enumerate(sizes) for r in range(size)]
    assert sorted(flat) == expected
    counts = [len(v) for v in got.values()]
    assert max(counts) - min(counts) <= 1


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_pad_gives_equal_counts_and_covers_everything(layout, world, workers):
    sizes = LAYOUTS[layout]
    n = sum(sizes)
    got = epoch_indices(sizes, world, workers, "pad")
    counts = {len(v) for v in got.values()}
    assert counts == {-(-n // (world * max(1, workers)))}
    # every sample once, plus the padding: the epoch's first samples again, wrapping around
    assert Counter(i for ids in got.values() for i in ids) == documented_coverage(sizes, world, workers, "pad")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("workers", [0, 2])
def test_drop_gives_equal_counts_without_repeats(layout, world, workers):
    sizes = LAYOUTS[layout]
    got = epoch_indices(sizes, world, workers, "drop")
    consumers = world * max(1, workers)
    assert {len(v) for v in got.values()} == {sum(sizes) // consumers}
    flat = [i for ids in got.values() for i in ids]
    assert len(flat) == len(set(flat))


def test_same_seed_and_epoch_same_order_next_epoch_different():
    sizes = LAYOUTS["even"]
    a = epoch_indices(sizes, 2, 2, "even", seed=3, epoch=1)
    b = epoch_indices(sizes, 2, 2, "even", seed=3, epoch=1)
    c = epoch_indices(sizes, 2, 2, "even", seed=3, epoch=2)
    d = epoch_indices(sizes, 2, 2, "even", seed=4, epoch=1)
    assert a == b
    assert a != c and a != d


def test_no_shuffle_is_sequential():
    sizes = [4, 4, 2]
    got = epoch_indices(sizes, 1, 0, "even", shuffle=False)
    assert got[(0, 0)] == list(range(10))


def test_shuffle_window_spans_several_shards():
    sizes = [8] * 8
    plan = consumer_plan(sizes, seed=0, epoch=0, shuffle=True, consumers=1, cid=0, partition="even", window=24)
    assert all(len({p.shard for p in w}) >= 3 for w in plan.windows[:-1])


def test_span_pieces_wraps_for_padding():
    pieces = span_pieces([1, 0], [3, 3], 4, 8)
    assert [(p.shard, p.lo, p.hi) for p in pieces] == [(0, 1, 3), (1, 0, 2)]


def test_consumer_span_rejects_bad_input():
    with pytest.raises(ValueError):
        consumer_span(10, 2, 2, "even")
    with pytest.raises(ValueError):
        consumer_span(10, 2, 0, "sideways")  # type: ignore[arg-type]


def test_shard_order_is_a_permutation():
    assert sorted(shard_order(17, 5, 2, True)) == list(range(17))
    assert shard_order(4, 5, 2, False) == [0, 1, 2, 3]


@pytest.mark.parametrize("per_worker,seen,expected", [
    ([3, 3], 3, [2, 1]),
    ([3, 1], 3, [2, 1]),
    ([1, 3], 4, [1, 3]),
    ([2, 2, 2], 6, [2, 2, 2]),
    ([5], 4, [4]),
])
def test_round_robin_consumed(per_worker, seen, expected):
    assert round_robin_consumed(seen, per_worker) == expected


def test_round_robin_consumed_rejects_too_many():
    with pytest.raises(ValueError):
        round_robin_consumed(5, [2, 2])


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    world=st.integers(1, 4), workers=st.integers(0, 3), seed=st.integers(0, 2**31),
    epoch=st.integers(0, 50), window=st.integers(1, 100),
    partition=st.sampled_from(["even", "pad", "drop"]),
)
def test_plan_property(sizes, world, workers, seed, epoch, window, partition):
    # Shards of a real layout are equal except the last.
    sizes = [max(sizes)] * (len(sizes) - 1) + [sizes[-1] if sizes[-1] <= max(sizes) else max(sizes)]
    n = sum(sizes)
    got = epoch_indices(sizes, world, workers, partition, seed=seed, epoch=epoch, window=window)
    consumers = world * max(1, workers)
    flat = [i for ids in got.values() for i in ids]
    counts = [len(v) for v in got.values()]
    if partition == "even":
        assert len(flat) == n and len(set(flat)) == n
    elif partition == "pad":
        assert set(counts) == {-(-n // consumers)} and len(set(flat)) == n
    else:
        assert set(counts) == {n // consumers} and len(set(flat)) == len(flat)


# -- the permutation evaluated per position, and the uniform plan -------------------------------
@pytest.mark.parametrize("n", [*range(0, 70), 127, 128, 129, 1000, 4097, 65537])
def test_shard_permutation_is_a_bijection_with_its_inverse(n):
    p = ShardPermutation(n, seed=3, epoch=7)
    got = p.shards(np.arange(n))
    assert sorted(got.tolist()) == list(range(n))
    assert p.positions(got).tolist() == list(range(n))
    assert ShardPermutation(n, 3, 7, shuffle=False).shards(np.arange(n)).tolist() == list(range(n))


def test_shard_permutation_depends_on_seed_and_epoch_and_looks_random():
    n = 1000
    orders = {(s, e): tuple(ShardPermutation(n, s, e).shards(np.arange(n)).tolist()) for s in (0, 1) for e in (0, 1)}
    assert len(set(orders.values())) == 4
    order = np.array(orders[(0, 0)])
    assert np.sum(order == np.arange(n)) < 10  # not close to the identity (about 1 fixed point expected)
    assert abs(np.corrcoef(order, np.arange(n))[0, 1]) < 0.1


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 400), spp=st.integers(1, 60), consumers=st.integers(1, 12), seed=st.integers(0, 3),
       epoch=st.integers(0, 3), shuffle=st.booleans(), partition=st.sampled_from(["even", "pad", "drop"]))
def test_uniform_plan_equals_the_plan_over_listed_sizes(n, spp, consumers, seed, epoch, shuffle, partition):
    shards = UniformShards(n, spp)
    for cid in range(consumers):
        kw = dict(seed=seed, epoch=epoch, shuffle=shuffle, consumers=consumers, cid=cid, partition=partition,
                  window=7)
        assert consumer_plan(shards, **kw) == consumer_plan(shards.sizes(), **kw)


@pytest.mark.parametrize("world,workers", [(1, 0), (2, 2), (3, 4)])
@pytest.mark.parametrize("partition", ["even", "pad", "drop"])
def test_uniform_plans_cover_every_sample_as_documented(world, workers, partition):
    shards = UniformShards(1003, 64)  # a short last shard, somewhere in each epoch's order
    got = epoch_indices(shards.sizes(), world, workers, partition, epoch=5)
    w = max(1, workers)
    for (rank, worker), ids in got.items():
        plan = consumer_plan(shards, seed=0, epoch=5, shuffle=True, consumers=world * w, cid=rank * w + worker,
                             partition=partition, window=20)
        assert plan.n_samples == len(ids)
    seen = Counter(i for ids in got.values() for i in ids)
    assert seen == documented_coverage(shards.sizes(), world, workers, partition, epoch=5)
    if partition == "even":
        assert seen == Counter(range(1003))


@pytest.mark.parametrize(("n", "spp"), [(10, 4), (200, 32), (97, 5), (8, 8), (3, 1)])
@pytest.mark.parametrize("consumers", [1, 2, 3, 7, 12])
@pytest.mark.parametrize("shuffle", [False, True])
def test_dropped_pieces_are_exactly_what_drop_leaves_out(n, spp, consumers, shuffle):
    """The consumers' pieces under "drop" and the dropped pieces tile the epoch's samples once."""
    shards = UniformShards(n, spp)
    read = Counter()
    for cid in range(consumers):
        plan = consumer_plan(shards, seed=3, epoch=1, shuffle=shuffle, consumers=consumers, cid=cid,
                             partition="drop", window=2 * spp)
        read.update(p.shard * spp + r for window in plan.windows for p in window for r in range(p.lo, p.hi))
    dropped = dropped_pieces(shards, seed=3, epoch=1, shuffle=shuffle, consumers=consumers)
    left_out = Counter(p.shard * spp + r for p in dropped for r in range(p.lo, p.hi))
    assert sum(left_out.values()) == n % consumers and not set(left_out) & set(read)
    assert read + left_out == Counter(range(n))
