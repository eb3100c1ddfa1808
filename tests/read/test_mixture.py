"""Weighted mixtures: counts as Mosaic defines them, the balanced interleave, realised
proportions in the consumed order, splitting over ranks x workers, and elastic resume."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from featstore.errors import InvalidInput
from featstore.read.plans import _mixture
from featstore.read.plans._assignment import Piece, UniformShards, shard_order
from featstore.read.plans._elastic import EpochOrder, ResumeState, Split, resume
from featstore.read.plans._mixture import MixStream, Mixture, stream_seed
from featstore.read._gather import batch_grouped
from featstore.read.plans._slices import balanced_positions, cut_pieces, interleave, slice_rows, split_pieces
from tests.read.plan_rows import (STREAM, batches, consumed_order, count_pieces, job_order, rank_batches, rank_totals,
                                  resumed_shares, share_rows)

A, B = UniformShards(40_000, 1000), UniformShards(12_000, 500)
SEVEN_THREE = Mixture((MixStream(A, proportion=0.7), MixStream(B, proportion=0.3)), epoch_size=50_000)


def rows_of(order: EpochOrder, sp: Split, state: ResumeState | None = None) -> dict[tuple[int, int], np.ndarray]:
    state = state or ResumeState(0, order)
    return {k: share_rows(s, order, state.epoch) for k, s in resumed_shares(state, sp).items()}


def stream_sequence(layout: UniformShards, seed: int, shuffle: bool, lo: int, hi: int) -> list[int]:
    """The documented endless sequence of a stream: pass p in shard_order(..., seed, p), rows of
    each shard in storage order; positions [lo, hi)."""
    out: list[int] = []
    p = 0
    while len(out) < hi:
        out += [s * layout.per_shard + r for s in shard_order(layout.n_shards, seed, p, shuffle)
                for r in range(min(layout.per_shard, layout.n_samples - s * layout.per_shard))]
        p += 1
    return out[lo:hi]


def epoch_rows(mix: Mixture, seed: int, epoch: int, shuffle: bool) -> Counter:
    """Each stream's rows of one epoch, from the documented rule."""
    out: Counter = Counter()
    for k, (s, c) in enumerate(zip(mix.streams, mix.counts(), strict=True)):
        out.update(k * STREAM + i for i in stream_sequence(s.layout, stream_seed(seed, k), shuffle, epoch * c,
                                                          (epoch + 1) * c))
    return out


def worst_share(seq: np.ndarray, stream: int, want: float, span: int = 10_000) -> float:
    """The largest distance of a stream's share from ``want`` over every ``span`` consecutive rows."""
    if len(seq) < span:
        return 0.0
    c = np.concatenate([[0], np.cumsum(seq // STREAM == stream)])
    return float(np.abs((c[span:] - c[:-span]) / span - want).max())


# -- weights -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("streams,epoch_size,counts", [
    ([MixStream(A, proportion=0.7), MixStream(B, proportion=0.3)], 50_000, (35_000, 15_000)),
    ([MixStream(A, proportion=7), MixStream(B, proportion=3)], None, (36_400, 15_600)),  # sizes summed
    ([MixStream(A, proportion=1), MixStream(B, proportion=1), MixStream(B, proportion=1)], 10, (4, 3, 3)),
    ([MixStream(A, proportion=1), MixStream(B, proportion=0)], 100, (100, 0)),
    ([MixStream(A, repeat=0.5), MixStream(B, repeat=2.5)], None, (20_000, 30_000)),
    ([MixStream(A, choose=123), MixStream(B, repeat=0.29)], None, (123, 3_480)),
    ([MixStream(A), MixStream(B, choose=7)], None, (40_000, 7)),
    ([MixStream(A), MixStream(B)], 1_000, (769, 231)),  # no weights, an epoch size: by the sizes
])
def test_counts_follow_mosaics_weights(streams, epoch_size, counts):
    mix = Mixture(tuple(streams), epoch_size)
    assert mix.counts() == counts and mix.n_samples == sum(counts)


@pytest.mark.parametrize("make,match", [
    (lambda: MixStream(A, proportion=0.5, repeat=1.0), "at most one"),
    (lambda: MixStream(A, choose=1.5), "choose must be an int"),
    (lambda: MixStream(A, repeat=-1), "repeat must be a number >= 0"),
    (lambda: Mixture((MixStream(A, proportion=0.5), MixStream(B, repeat=1.0))), "all-or-none"),
    (lambda: Mixture((MixStream(A, proportion=0), MixStream(B, proportion=0))), "sum to 0"),
    (lambda: Mixture((MixStream(A, repeat=1.0),), epoch_size=10), "epoch_size is for proportions"),
    (lambda: Mixture((MixStream(UniformShards(0, 4), choose=3),)), "no samples"),
    (lambda: Mixture(()), "at least one"),
])
def test_weights_that_cannot_be_read_say_why(make, match):
    with pytest.raises(InvalidInput, match=match):
        make()


@settings(max_examples=300, deadline=None)
@given(counts=st.lists(st.integers(0, 50), min_size=1, max_size=7))
def test_the_balanced_interleave_tracks_every_streams_share(counts):
    total = sum(counts)
    x = np.arange(total + 1)
    f = np.stack(interleave(counts, x))
    assert (f.sum(axis=0) == x).all()
    assert f[:, -1].tolist() == counts and (f[:, 0] == 0).all()
    assert set(np.diff(f, axis=1).ravel().tolist()) <= {0, 1}
    levels = max(1, (len(counts) - 1).bit_length())
    if total:
        assert np.abs(f - np.outer(counts, x) / total).max() <= levels / 2 + 1e-9
    stream, rank = balanced_positions(counts)
    assert Counter(stream.tolist()) == {s: c for s, c in enumerate(counts) if c}


# -- an epoch of a mixture -----------------------------------------------------------------------------
MIXTURES = {
    "0.7/0.3": Mixture((MixStream(UniformShards(90, 8), proportion=0.7),
                        MixStream(UniformShards(37, 5), proportion=0.3))),
    "upsampled": Mixture((MixStream(UniformShards(20, 6), repeat=2.5), MixStream(UniformShards(50, 7), choose=13))),
    "three": Mixture((MixStream(UniformShards(30, 4)), MixStream(UniformShards(11, 11)),
                      MixStream(UniformShards(45, 9), repeat=0.4))),
}


@pytest.mark.parametrize("name", MIXTURES)
@pytest.mark.parametrize("world,workers", [(1, 0), (2, 0), (2, 2), (3, 1), (4, 3)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_an_epoch_reads_each_streams_draw_once_however_split(name, world, workers, shuffle):
    """Under "even" every consumer together reads exactly the documented draw of each stream;
    under "pad" every rank has the same count; each row is labelled with its stream."""
    mix = MIXTURES[name]
    order = EpochOrder(mix, 5, shuffle, 16)
    for epoch in (0, 3):
        state = ResumeState(epoch, order)
        got = rows_of(order, Split(world, workers, 4), state)
        assert Counter(i for v in got.values() for i in v.tolist()) == epoch_rows(mix, 5, epoch, shuffle)
        padded = rows_of(order, Split(world, workers, 4, "pad"), state)
        assert len({sum(len(padded[(r, w)]) for w in range(max(1, workers))) for r in range(world)}) == 1
    for share in resumed_shares(ResumeState(1, order), Split(world, workers, 4)).values():
        for s in share.slices:
            labels = slice_rows(s, 5, 1, shuffle).streams
            assert labels.tolist() == (share_rows(type(share)((s,)), order, 1) // STREAM).tolist()


def test_a_stream_is_drawn_without_replacement_across_epochs_until_exhausted():
    layout = UniformShards(100, 10)
    mix = Mixture((MixStream(layout, choose=30), MixStream(UniformShards(10, 10))))
    order = EpochOrder(mix, 1, True, 8)
    drawn = [sorted(i for v in rows_of(order, Split(1, 0, 5), ResumeState(e, order)).values()
                    for i in v.tolist() if i < STREAM) for e in range(4)]
    assert all(len(d) == 30 for d in drawn)
    assert len(set(drawn[0] + drawn[1] + drawn[2])) == 90  # epochs 0-2 within the first pass
    assert len(set(drawn[3])) == 30  # epoch 3: the last 10 of pass 0, then 20 of pass 1


def test_the_same_seed_and_epoch_give_the_same_order_another_epoch_another():
    order = EpochOrder(MIXTURES["0.7/0.3"], 2, True, 16)
    sp = Split(2, 2, 4)
    a, b = rows_of(order, sp, ResumeState(1, order)), rows_of(order, sp, ResumeState(1, order))
    c = rows_of(order, sp, ResumeState(2, order))
    assert {k: v.tolist() for k, v in a.items()} == {k: v.tolist() for k, v in b.items()}
    assert {k: v.tolist() for k, v in a.items()} != {k: v.tolist() for k, v in c.items()}


# -- realised proportions ------------------------------------------------------------------------------
@pytest.mark.parametrize("world,workers,batch", [(1, 0, 64), (2, 2, 32), (4, 3, 16), (8, 4, 8)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_proportions_hold_within_one_percent_over_every_10000_samples(world, workers, batch, shuffle):
    """0.7/0.3 over 50,000 samples: in the job's consumed order (all ranks' batches, step after
    step), in each consumer's own sequence, and in every window."""
    order = EpochOrder(SEVEN_THREE, 0, shuffle, 4000)
    sp = Split(world, workers, batch, "pad")
    rows = rows_of(order, sp)
    job = job_order(consumed_order(rows, sp))
    assert len(job) >= 50_000
    assert worst_share(job, 1, 0.3) <= 0.01
    assert all(worst_share(v, 1, 0.3) <= 0.01 for v in rows.values())
    for share in resumed_shares(ResumeState(0, order), sp).values():
        for s in share.slices:
            n_b = int((share_rows(type(share)((s,)), order, 0) // STREAM).sum())
            assert abs(n_b - 0.3 * len(s.rows)) <= 2


def test_every_batch_holds_the_proportions_where_a_plain_permutation_would_not():
    """Why the windows are stratified: every batch of 64 holds 0.3 x 64 = 19.2 rows of B to within
    one row; the same windows in one random order each stray by more than 5 rows in some batch."""
    order = EpochOrder(SEVEN_THREE, 0, True, 40_000)
    seq = np.concatenate(list(rows_of(order, Split(1, 0, 64)).values()))

    def worst_batch(rows: np.ndarray) -> float:
        return float(np.abs((rows[:len(rows) // 64 * 64] // STREAM).reshape(-1, 64).sum(axis=1) - 0.3 * 64).max())

    rng = np.random.default_rng(0)
    plain = np.concatenate([rng.permutation(seq[i:i + 40_000]) for i in range(0, len(seq), 40_000)])
    assert worst_batch(seq) <= 1 < 5 < worst_batch(plain)


# -- resume --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("old,new", [((2, 2), (3, 1)), ((4, 3), (1, 0)), ((1, 0), (4, 2)), ((2, 0), (2, 3))])
@pytest.mark.parametrize("at", [0.1, 0.5, 0.9])
def test_a_mixture_resumes_under_another_split_with_nothing_repeated_or_lost(old, new, at):
    order = EpochOrder(SEVEN_THREE, 3, True, 4000)
    g = 96  # divides over every world here
    before, after = Split(old[0], old[1], g // old[0]), Split(new[0], new[1], g // new[0])
    rows = rows_of(order, before)
    per_rank = [rank_batches([batches(rows[(r, w)], before) for w in range(before.per_rank)])
                for r in range(before.world)]
    k = int(at * min(len(b) for b in per_rank))
    seen = [i for b in per_rank for batch in b[:k] for i in batch.tolist()]
    state = ResumeState(0, order).advanced(before, k)
    resumed = rows_of(order, after, state)
    rest = [i for v in resumed.values() for i in v.tolist()]
    assert Counter(seen) + Counter(rest) == epoch_rows(SEVEN_THREE, 3, 0, True)
    later = job_order(consumed_order(resumed, after))
    assert worst_share(later, 1, 0.3) <= 0.01
    # the same split resumed twice: the same order
    assert {k_: v.tolist() for k_, v in rows_of(order, after, state).items()} == \
        {k_: v.tolist() for k_, v in resumed.items()}


def test_resuming_a_mixture_costs_no_more_late_in_the_epoch(monkeypatch):
    """Pieces planned, counted (never timed), at 10% and at 90% of the epoch."""
    built = count_pieces(monkeypatch, _mixture)
    big = Mixture((MixStream(UniformShards(2_000_000, 1000), proportion=0.7),
                   MixStream(UniformShards(500_000, 500), proportion=0.3)))
    order = EpochOrder(big, 0, True, 4000)
    old, new = Split(4, 2, 64, "pad"), Split(2, 1, 128, "pad")
    per_rank = int(rank_totals(order, old)[0])
    cost = {}
    for at in (0.1, 0.9):
        built.clear()
        resume(ResumeState(0, order).advanced(old, int(at * per_rank)), new, 1, 0)
        cost[at] = sum(built)
    assert 0 < cost[0.9] <= cost[0.1]


@pytest.mark.parametrize("world,workers", list(itertools.product([1, 3], [0, 2])))
def test_pad_wraps_a_mixture_to_its_start(world, workers):
    mix = MIXTURES["upsampled"]
    order = EpochOrder(mix, 0, False, 5)
    sp = Split(world, workers, 3, "pad")
    got = rows_of(order, sp)
    c = sp.consumers
    assert {len(v) for v in got.values()} == {-(-mix.n_samples // c)}
    assert set(epoch_rows(mix, 0, 0, False)) == {i for v in got.values() for i in v.tolist()}


@pytest.mark.parametrize("streams", [1, 2, 3])
@pytest.mark.parametrize("batch_size", [1, 7, 64])
@pytest.mark.parametrize("held", [0, 1, 6, 63])
def test_batch_grouped_is_each_batch_stably_sorted_by_version(streams, batch_size, held):
    # what the mixture reader computes once per slice: the order its batches yield the rows in
    held = min(held, batch_size - 1)  # rows of a batch begun in earlier slices: fewer than a batch
    for n in (0, 5, 200, 333):
        labels = np.random.default_rng([streams, n]).integers(0, streams, n).astype(np.uint8)
        batch = (held + np.arange(n)) // batch_size  # the batch of each position (the first completes one)
        want = np.argsort(batch * streams + labels, kind="stable")
        assert np.array_equal(batch_grouped(labels, held, batch_size), want)


@pytest.mark.parametrize("partition", ["even", "pad", "drop"])
@pytest.mark.parametrize("consumers,window", [(1, 1), (3, 16), (8, 4000), (5, 7)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_share_planned_at_once_is_the_windows_planned_one_by_one(partition, consumers, window, shuffle):
    """mixture_share plans each stream's run once and cuts it at the windows' bounds: the same
    windows as planning each window on its own gives."""
    mix = MIXTURES["upsampled"]
    counts, seeds = mix.counts(), [stream_seed(5, s) for s in range(len(mix.streams))]
    for epoch, cid in itertools.product((0, 3), range(consumers)):
        share = _mixture.mixture_share(mix, seed=5, epoch=epoch, shuffle=shuffle, consumers=consumers, cid=cid,
                                       partition=partition, window=window)
        start, stop = _mixture.consumer_span(sum(counts), consumers, cid, partition)
        bounds = [*range(start, stop, window), stop]
        assert [s.window.runs for s in share.slices] == [
            _window_runs(mix, counts, seeds, epoch, shuffle, a, b) for a, b in itertools.pairwise(bounds)]


def _window_runs(mix, counts, seeds, epoch, shuffle, a, b):
    """Each stream's pieces at the epoch's positions ``[a, b)``, planned for this window alone
    (``b`` may pass the epoch's end: positions wrap around, as ``"pad"`` does)."""
    m = sum(counts)
    runs = [[] for _ in counts]
    pos = a
    while pos < b:
        x = pos % m
        y = min(m, x + b - pos)
        first, last = interleave(list(counts), x), interleave(list(counts), y)
        for s, stream in enumerate(mix.streams):
            base = epoch * counts[s]
            runs[s] += _mixture.stream_pieces(stream.layout, seeds[s], shuffle, base + first[s], base + last[s])
        pos += y - x
    return tuple(tuple(r) for r in runs)


@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.data())
@settings(max_examples=200, deadline=None)
def test_split_pieces_is_cut_pieces_for_every_run(sizes, data):
    pieces = [Piece(k, 3, 3 + n) for k, n in enumerate(sizes)]
    total = sum(sizes)
    cuts = sorted(data.draw(st.lists(st.integers(0, total), max_size=5)))
    bounds = [0, *cuts, total]
    runs = [b - a for a, b in itertools.pairwise(bounds)]
    assert split_pieces(pieces, runs) == [_cut(pieces, a, b) for a, b in itertools.pairwise(bounds)]
    assert [cut_pieces(pieces, a, b) for a, b in itertools.pairwise(bounds)] == split_pieces(pieces, runs)


def _cut(pieces, lo, hi):
    """Rows ``[lo, hi)`` of the pieces' rows taken one after another, piece by piece."""
    out, pos = [], 0
    for p in pieces:
        a, b = max(lo - pos, 0), min(hi - pos, p.size)
        if a < b:
            out.append(Piece(p.shard, p.lo + a, p.lo + b))
        pos += p.size
    return tuple(out)
