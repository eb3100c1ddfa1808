"""Elastic resume arithmetic: a job interrupted under one split and resumed under others.

The tests simulate the job itself - each rank's DataLoader taking its workers' batches in turn,
all ranks stepping together - from the rows every consumer yields, and check the module's
answers against that simulation and the rule in its docstring: the remaining sequence is every
old consumer's unread rows, consumer after consumer, split like an epoch.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from featstore.errors import InvalidInput
from featstore.read.plans import _assignment
from featstore.read.plans._assignment import UniformShards, consumer_plan, consumer_span, round_robin_consumed, \
    window_permutation
from featstore.read.plans._elastic import (EpochOrder, ResumeState, Segment, Split, check_global_batch,
                                     check_same_order, epoch_share, progress, remaining_samples, resume,
                                     segment_share)
from featstore.read.plans._slices import Share, slice_rows
from tests.read.plan_rows import (batches, count_pieces, every_row, rank_batches, rank_totals, resumed_shares,
                                  share_rows)

LAYOUTS = {
    "one-shard": UniformShards(10, 10),
    "fewer-shards-than-consumers": UniformShards(14, 7),
    "ragged-tail": UniformShards(163, 32),
    "many-small": UniformShards(117, 5),
}
#: (world, workers) pairs: grow and shrink the world, change the workers, both.
SPLITS = [(1, 0), (1, 2), (2, 0), (2, 1), (3, 2), (4, 3)]
GLOBAL = 12  # divides over every world above


def split(world: int, workers: int, partition: str = "even", drop_last: bool = False, g: int = GLOBAL) -> Split:
    return Split(world, workers, g // world, partition, drop_last)  # type: ignore[arg-type]


def consumer_rows(state: ResumeState, sp: Split) -> dict[tuple[int, int], np.ndarray]:
    """Rows each (rank, worker) of ``sp`` yields from the state on (its whole share when it starts a
    segment)."""
    return {key: share_rows(s, state.order, state.epoch) for key, s in resumed_shares(state, sp).items()}


def simulate(rows: dict[tuple[int, int], np.ndarray], sp: Split, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The job under ``sp`` consuming ``k`` batches per rank: (the rows it consumed, the remaining
    sequence: each consumer's rows it would still have yielded, consumer after consumer), by
    replaying each rank's DataLoader batch by batch."""
    seen, rest = [], []
    for r in range(sp.world):
        per_worker = [batches(rows[(r, w)], sp) for w in range(sp.per_rank)]
        tagged = rank_batches([[(w, b) for b in bs] for w, bs in enumerate(per_worker)])  # type: ignore[misc]
        taken = Counter(w for w, _ in tagged[:k])
        seen += [b for _, b in tagged[:k]]
        rest += [np.concatenate(per_worker[w][taken[w]:] or [np.zeros(0, np.int64)]) for w in range(sp.per_rank)]
    return (np.concatenate(seen) if seen else np.zeros(0, np.int64)), np.concatenate(rest)


def expected_after(rest: np.ndarray, sp: Split) -> dict[tuple[int, int], np.ndarray]:
    """The rule: consumer c of the new split yields the span consumer_span(R, C, c) of the
    remaining sequence (positions wrap under "pad")."""
    out = {}
    for r, w in itertools.product(range(sp.world), range(sp.per_rank)):
        start, stop = consumer_span(len(rest), sp.consumers, r * sp.per_rank + w, sp.partition)
        out[(r, w)] = rest[np.arange(start, stop) % len(rest)] if len(rest) else rest[:0]
    return out


def flat(rows: dict[tuple[int, int], np.ndarray], sp: Split) -> list[int]:
    """Every row the consumers yield, batches cut as the reader cuts them (drop_last drops)."""
    return [int(i) for v in rows.values() for b in batches(v, sp) for i in b]


def order_of(layout: UniformShards, seed: int = 0, shuffle: bool = True, window: int = 20) -> EpochOrder:
    return EpochOrder(layout, seed, shuffle, window)


# -- segment 0 is what the reader reads today ------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world,workers", SPLITS)
@pytest.mark.parametrize("partition", ["even", "pad", "drop"])
def test_an_uninterrupted_share_is_the_readers_plan(layout, world, workers, partition):
    """epoch_share's rows are consumer_plan's windows, each in window_permutation's order."""
    order, sp = order_of(LAYOUTS[layout]), split(world, workers, partition)
    spp = order.source.per_shard
    for cid in range(sp.consumers):
        plan = consumer_plan(order.source, seed=0, epoch=3, shuffle=True, consumers=sp.consumers, cid=cid,
                             partition=partition, window=20)
        want = [np.concatenate([np.arange(p.shard * spp + p.lo, p.shard * spp + p.hi) for p in w])[
            window_permutation(0, 3, cid, wi, sum(p.size for p in w))] for wi, w in enumerate(plan.windows)]
        got = share_rows(epoch_share(order, 3, sp, cid), order, 3)
        assert got.tolist() == (np.concatenate(want).tolist() if want else [])


def yielded_shares(state: ResumeState) -> list[list[Share]]:
    """What every consumer of every segment yielded (per segment, per consumer): the samples the
    job has seen. O(the whole epoch's windows)."""
    done = progress(state.order, state.segments)
    memo: dict[tuple[int, int], Share] = {}
    out: list[list[Share]] = []
    for i, p in enumerate(done):
        for c in range(p.split.consumers):
            if (i, c) not in memo:
                memo[(i, c)] = segment_share(state.order, state.epoch, done[:i], p.split, c, memo)
        out.append([memo[(i, c)].rows(0, int(p.yielded[c])) for c in range(p.split.consumers)])
    return out


# -- one resume: every old split x every new split ------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("old", SPLITS)
def test_resume_under_any_split_reads_the_rest_exactly_once(layout, old):
    """Before + after = every sample once, for every new split and several stopping points; the
    after part is the documented split of the remaining sequence; the same again gives the same."""
    order = order_of(LAYOUTS[layout])
    before = split(*old)
    start = ResumeState(0, order)
    rows = consumer_rows(start, before)
    per_rank = int(rank_totals(order, before).max())
    for k in sorted({0, 1, per_rank // 2, max(per_rank - 1, 0), per_rank}):
        seen, rest = simulate(rows, before, k)
        state = start.advanced(before, k)
        told = [i for seg in yielded_shares(state) for sh in seg for i in share_rows(sh, order, 0)]
        assert sorted(told) == sorted(seen)
        assert remaining_samples(state) == len(rest)
        for new in SPLITS:
            after = split(*new)
            got = consumer_rows(state, after)
            if k and not after.continues(before):  # (k = 0: nothing read, the new split plans afresh)
                want = expected_after(rest, after)
                assert {k_: v.tolist() for k_, v in got.items()} == {k_: v.tolist() for k_, v in want.items()}
            assert Counter(seen.tolist()) + Counter(flat(got, after)) == every_row(order), (k, new)
            assert {k_: v.tolist() for k_, v in consumer_rows(state, after).items()} == \
                {k_: v.tolist() for k_, v in got.items()}  # deterministic


@pytest.mark.parametrize("world,workers,again", [(w, k, k) for w, k in SPLITS] + [(2, 0, 1), (1, 1, 0)])
def test_resuming_under_the_same_split_continues_the_original_order(world, workers, again):
    """Each rank's batches after the resume are the uninterrupted run's, in order (the roles
    rotate: the DataLoader restarts its round robin at worker 0); 0 and 1 workers are one split."""
    order, sp, resumed_sp = order_of(LAYOUTS["ragged-tail"]), split(world, workers), split(world, again)
    start = ResumeState(0, order)
    rows = consumer_rows(start, sp)
    for k in range(0, 6):
        state = start.advanced(sp, k)
        resumed = consumer_rows(state, resumed_sp)
        for r in range(world):
            whole = rank_batches([batches(rows[(r, w)], sp) for w in range(sp.per_rank)])
            again_ = rank_batches([batches(resumed[(r, w)], sp) for w in range(sp.per_rank)])
            assert [b.tolist() for b in again_] == [b.tolist() for b in whole[k:]]


@pytest.mark.parametrize("partition,drop_last", [("pad", False), ("pad", True), ("drop", False), ("drop", True)])
@pytest.mark.parametrize("old", SPLITS)
def test_every_rank_steps_the_same_number_of_times_after_a_resume(partition, drop_last, old):
    """DDP: under "pad"/"drop" every rank of every new split has the same number of batches, and
    under "drop" without drop_last none of them repeats a row."""
    order = order_of(LAYOUTS["ragged-tail"])
    before = split(*old, partition, drop_last)
    k = int(rank_totals(order, before).min()) // 3
    state = ResumeState(0, order).advanced(before, k)
    for new in SPLITS:
        after = split(*new, partition, drop_last)
        rows = consumer_rows(state, after)
        steps = {len(rank_batches([batches(rows[(r, w)], after) for w in range(after.per_rank)]))
                 for r in range(after.world)}
        assert len(steps) == 1, (new, steps)
        if partition == "drop" and not drop_last:
            read = flat(rows, after)
            assert len(read) == len(set(read))


# -- pad, drop, drop_last: the documented rule -----------------------------------------------------
split_strategy = st.builds(
    lambda world, workers, partition, drop_last: split(world, workers, partition, drop_last, g=12),
    st.sampled_from([1, 2, 3, 4, 6]), st.integers(0, 3), st.sampled_from(["even", "pad", "drop"]), st.booleans())


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 160), spp=st.integers(1, 40), seed=st.integers(0, 5), shuffle=st.booleans(),
       window=st.integers(1, 50), splits=st.lists(split_strategy, min_size=2, max_size=3),
       stops=st.lists(st.floats(0, 1), min_size=3, max_size=3))
def test_chained_resumes_follow_the_rule(n, spp, seed, shuffle, window, splits, stops):
    """Segment after segment (grow, shrink, other workers, other partitions): each new split
    yields exactly the documented spans of the previous remaining sequence, nothing yielded is
    read again, each rank has the same number of batches under "pad"/"drop", and the whole job
    read every sample once (even, no drop_last) or as the policies say."""
    assume(not any(a.continues(b) for a, b in zip(splits, splits[1:], strict=False)))  # the same: tested above
    order = EpochOrder(UniformShards(n, spp), seed, shuffle, window)
    state = ResumeState(1, order)
    rows = consumer_rows(state, splits[0])
    seen_all: Counter = Counter()
    for i, (sp, stop) in enumerate(zip(splits, stops, strict=False)):
        per_rank = [rank_batches([batches(rows[(r, w)], sp) for w in range(sp.per_rank)]) for r in range(sp.world)]
        if sp.partition != "even":
            assert len({len(b) for b in per_rank}) == 1  # DDP: every rank steps the same number of times
        k = int(stop * min(len(b) for b in per_rank))
        seen, rest = simulate(rows, sp, k)
        seen_all += Counter(seen.tolist())
        state = state.advanced(sp, k)
        if k:  # (k = 0 records nothing: the remaining rows are the previous segment's)
            assert remaining_samples(state) == len(rest)
        if i + 1 == len(splits):
            break
        nxt = splits[i + 1]
        rows = consumer_rows(state, nxt)
        if k:  # (k = 0: the split read nothing, and the next splits what it was given)
            want = expected_after(rest, nxt)
            assert {c: v.tolist() for c, v in rows.items()} == {c: v.tolist() for c, v in want.items()}
        if all(s.partition == "even" and not s.drop_last for s in splits[:i + 2]):
            assert seen_all + Counter(flat(rows, nxt)) == every_row(order)
        if not any(s.partition == "pad" for s in splits[:i + 1]):  # padding repeats by design
            assert not set(seen_all) & set(flat(rows, nxt))


def test_the_state_is_a_few_integers_and_round_trips_through_json():
    """The state is a few integers per segment, and round trips through plain JSON types."""
    import json

    state = ResumeState(4, order_of(LAYOUTS["many-small"])).advanced(split(2, 2), 3).advanced(split(3, 0), 2)
    assert len(state.segments) == 2
    again = ResumeState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again == state
    assert state.advanced(split(3, 0), 0) == state  # a split that read nothing changes nothing
    assert state.advanced(split(3, 0), 1).segments[-1].batches == 3  # the same split counts on
    assert state.advanced(split(3, 1), 1).segments[-1] == Segment(split(3, 0), 3)  # 0 or 1 worker: the same
    assert len(state.advanced(split(1, 0), 1).segments) == 3


def test_resume_cost_does_not_grow_with_the_position(monkeypatch):
    """Pieces planned to resume at 90% of an epoch are no more than at 10% (counted, not timed),
    and fewer than planning the interrupted epoch whole."""
    built = count_pieces(monkeypatch, _assignment)
    order = EpochOrder(UniformShards(200_000, 100), 0, True, 400)
    old, new = Split(8, 4, 16, "pad"), Split(4, 2, 32, "pad")
    total = int(rank_totals(order, old)[0])
    cost = {}
    for fraction in (0.1, 0.5, 0.9):
        built.clear()
        state = ResumeState(0, order).advanced(old, int(fraction * total))
        resume(state, new, 1, 1)
        cost[fraction] = sum(built)
    built.clear()
    for cid in range(old.consumers):
        epoch_share(order, 0, old, cid)
    whole_epoch = sum(built)
    assert cost[0.9] <= cost[0.1] and cost[0.5] <= cost[0.1]
    assert cost[0.1] * 4 < whole_epoch


# -- errors ------------------------------------------------------------------------------------------
def test_a_global_batch_that_does_not_divide_says_so():
    state = ResumeState(0, order_of(LAYOUTS["ragged-tail"])).advanced(Split(2, 0, 6), 1)  # global 12
    with pytest.raises(InvalidInput, match="does not divide over 5 ranks.*1, 2, 3, 4, 6, 12"):
        resume(state, Split(5, 0, 2), 0, 0)
    with pytest.raises(InvalidInput, match="batch_size=3 to keep it"):
        resume(state, Split(4, 0, 6), 0, 0)
    check_global_batch(Split(2, 0, 6), Split(3, 4, 4))  # 12 = 3 x 4: fine


def test_a_state_of_another_plan_or_schema_is_refused():
    order = order_of(LAYOUTS["ragged-tail"])
    state = ResumeState(0, order).advanced(split(2, 0), 1)
    with pytest.raises(InvalidInput, match="seed=0 \\(now 1\\)"):
        check_same_order(order, order_of(LAYOUTS["ragged-tail"], seed=1))
    with pytest.raises(InvalidInput, match="at most"):
        resume(ResumeState(0, order).advanced(split(2, 0), 10_000), split(1, 0), 0, 0)
    newer = {**state.to_dict(), "schema_version": 99}
    with pytest.raises(InvalidInput, match="upgrade featstore"):
        ResumeState.from_dict(newer)
    with pytest.raises(InvalidInput, match="damaged"):
        ResumeState.from_dict({k: v for k, v in state.to_dict().items() if k != "segments"})
    with pytest.raises(InvalidInput, match="not a featstore epoch state"):
        ResumeState.from_dict({"epoch": 0})
    with pytest.raises(InvalidInput, match="world must be"):
        Split(0, 0, 4)
    with pytest.raises(InvalidInput, match="partition"):
        Split(1, 0, 4, "sideways")  # type: ignore[arg-type]


def test_the_end_of_an_epoch_leaves_nothing():
    order = order_of(LAYOUTS["ragged-tail"])
    sp = split(2, 2)
    state = ResumeState(0, order).advanced(sp, int(rank_totals(order, sp).max()))
    assert remaining_samples(state) == 0
    assert all(s.n_samples == 0 for s in resumed_shares(state, split(3, 1)).values())


# -- reading a slice ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_slice_reads_its_rows_and_unshuffled_only_those(shuffle):
    order = EpochOrder(UniformShards(300, 16), 2, shuffle, 50)
    state = ResumeState(0, order).advanced(Split(2, 1, 7), 3)
    for share in resumed_shares(state, Split(1, 3, 14)).values():
        for s in share.slices:
            rows = slice_rows(s, 2, 0, shuffle)
            ids = np.concatenate([np.arange(p.shard * 16 + p.lo, p.shard * 16 + p.hi)
                                  for run in rows.reads for p in run])
            assert ids[rows.order].tolist() == share_rows(type(share)((s,)), order, 0).tolist()
            if not shuffle:
                assert sum(p.size for run in rows.reads for p in run) == len(s.rows)


@settings(max_examples=300, deadline=None)
@given(counts=st.lists(st.integers(0, 9), max_size=8), data=st.data())
def test_round_robin_is_counted_as_the_dataloader_replays_it(counts, data):
    k = data.draw(st.integers(0, sum(counts)))
    done, left = [0] * len(counts), k
    while left:
        for w, total in enumerate(counts):
            if left and done[w] < total:
                done[w] += 1
                left -= 1
    assert round_robin_consumed(k, counts) == done
