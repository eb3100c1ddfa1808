"""What the one reader composes (issue 43): several teachers inside a mixture, mixtures of versions
with views, the refusals that remain (each saying why), len() = the batches each rank yields, and
the mixture defects fixed (epoch_size=0, an infinite weight, a version listed twice, planning a
small stream's thousands of passes)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import featstore
from featstore import FeatureDataset, InvalidInput, Stream
from featstore.read.plans import Mixture, MixStream, UniformShards
from featstore.read.plans import _mixture, _shuffle

from ..helpers import TinyA, VectorData, noisy_flip, write_version


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return featstore.open_store(tmp_path_factory.mktemp("compose"))


@pytest.fixture(scope="module")
def teams(store):
    """Two corpora, each with two aligned teachers ("a": TinyA, "b": another A on a's rows)."""
    out = []
    for i, n in enumerate((96, 64)):
        a = write_version(store, f"a{i}/x", dataset=VectorData(n, seed=i), n=n)
        b = write_version(store, f"b{i}/x", model=TinyA(seed=5), dataset=VectorData(n, seed=i), keep=(),
                          outputs={"logits": "topk:3"}, samples_per_shard=None, views_of=a.ref)
        out.append((a, b))
    return out


def read(ds, workers=0):
    return list(DataLoader(ds, batch_size=None, num_workers=workers, timeout=120 if workers else 0))


def test_several_teachers_inside_a_mixture_hold_each_teachers_rows(teams):
    ds = featstore.mix([Stream({"a": a, "b": b}, proportion=w) for (a, b), w in zip(teams, (0.6, 0.4), strict=True)],
                       epoch_size=120, batch_size=32, seed=4)
    loaded = [(a.load(), b.load()) for a, b in teams]
    seen = Counter()
    for batch in read(ds, 2):
        assert {"a/features", "a/logits", "a/target", "b/logits.ids", "b/logits.values", "source",
                "index"} <= set(batch)
        for k in (0, 1):
            at = batch["source"] == k
            idx = batch["index"][at].numpy()
            seen[k] += len(idx)
            assert torch.equal(batch["a/features"][at], loaded[k][0]["features"][idx])
            assert torch.equal(batch["b/logits.ids"][at], loaded[k][1]["logits.ids"][idx])
    assert seen == {0: 72, 1: 48}


def test_a_mixture_of_versions_with_views_reads_each_streams_epoch_view(store):
    v1 = write_version(store, "views1/x", n=48, views=featstore.Views(k=2, augment=noisy_flip, seed=1))
    v2 = write_version(store, "views2/x", n=40, dataset=VectorData(40, seed=3),
                       views=featstore.Views(k=3, augment=noisy_flip, seed=2))
    ds = featstore.mix([(v1, 0.5), (v2, 0.5)], epoch_size=64, batch_size=16, seed=0)
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        for batch in read(ds):
            for k, v in enumerate((v1, v2)):
                at = batch["source"] == k
                (view,) = set(batch["view"][at].tolist())
                want = v.view(view)[batch["index"][at].numpy()]
                assert torch.equal(batch["features"][at], want["features"])


def test_what_a_mixture_still_refuses_says_why(teams, store):
    (a0, b0), (a1, _) = teams
    with pytest.raises(InvalidInput, match="teachers differ"):
        featstore.mix([Stream({"a": a0, "b": b0}), Stream({"a": a1})])
    with pytest.raises(InvalidInput, match="source= joins one version's dataset"):
        featstore.mix([(a0, 0.5), (a1, 0.5)], source=VectorData(96))


# -- the defects of the mixture check ----------------------------------------------------------
def test_epoch_size_zero_an_infinite_weight_and_a_repeated_version_are_refused_naming_the_fix(teams):
    (a0, _), (a1, _) = teams
    with pytest.raises(InvalidInput, match="epoch_size=0 reads nothing"):
        featstore.mix([(a0, 0.5), (a1, 0.5)], epoch_size=0)
    for weight in ("proportion", "repeat"):
        with pytest.raises(InvalidInput, match=f"{weight}=inf is not a finite weight"):
            featstore.mix([Stream(a0, **{weight: math.inf}), Stream(a1, **{weight: 1.0})])
    with pytest.raises(InvalidInput, match="streams 0 and 1 of this mixture.*Give it once"):
        featstore.mix([(a0, 0.5), (a0, 0.5)], epoch_size=96)


def test_planning_a_small_streams_passes_draws_no_permutation_per_pass(monkeypatch):
    """30 samples (one shard) at 0.5 of an epoch of 400,000: 6,667 passes of the small stream.
    Its passes are planned without a permutation each (the big stream's few passes draw theirs):
    planning costs what the epoch's windows cost, whatever the laps."""
    drawn = []
    original = _shuffle.ShardPermutation.__init__

    def counting(self, n, seed, epoch, shuffle=True):
        drawn.append(n)
        original(self, n, seed, epoch, shuffle)

    monkeypatch.setattr(_shuffle.ShardPermutation, "__init__", counting)
    _mixture._pass_order.cache_clear()
    mix = Mixture((MixStream(UniformShards(30, 32), proportion=0.5),
                   MixStream(UniformShards(200_000, 1024), proportion=0.5)), 400_000)
    share = _mixture.mixture_share(mix, seed=0, epoch=0, shuffle=True, consumers=1, cid=0, partition="even",
                                   window=4096)
    assert share.n_samples == 400_000
    assert drawn and all(n == 196 for n in drawn) and len(drawn) <= 2  # the big stream's pass (and the next)
    small = [p for sl in share.slices for p in sl.window.runs[0]]
    assert sum(p.size for p in small) == 200_000 and all(p.shard == 0 for p in small)


# -- len(): the batches this rank yields -----------------------------------------------------------
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("partition", [None, "even", "drop"])
def test_len_is_the_batches_every_rank_yields(teams, drop_last, partition):
    (a0, _), (a1, _) = teams
    makers = {"one": lambda r, w: a0.dataset(batch_size=10, seed=1, drop_last=drop_last, partition=partition,
                                             rank=r, world_size=w),
              "mixture": lambda r, w: featstore.mix([(a0, 0.7), (a1, 0.3)], epoch_size=150, batch_size=10, seed=1,
                                                    drop_last=drop_last, partition=partition, rank=r, world_size=w)}
    for kind, make in makers.items():
        for world in (1, 3):
            for workers in (0, 2):
                counts = set()
                for rank in range(world):
                    ds = make(rank, world)
                    loader = DataLoader(ds, batch_size=None, num_workers=workers, timeout=120 if workers else 0)
                    n = len(loader)
                    got = list(loader)
                    assert n == len(got), (kind, world, rank, workers)
                    assert len(ds) == len(got)  # the last iteration's workers, asked directly
                    counts.add(len(got))
                if partition != "even":  # "pad"/"drop" (the default for several ranks): every rank the same
                    assert len(counts) == 1, (kind, world, workers, counts)


def test_len_counts_with_the_workers_the_reader_was_told(teams):
    (a0, _), _ = teams
    told = a0.dataset(batch_size=10, seed=1, num_workers=2)
    assert len(told) == 10 == len(read(told, 2))  # 2 workers of 48: 5 batches each
    assert len(a0.dataset(batch_size=10, seed=1)) == 10  # 96 in the process: 10
    assert len(a0.dataset(batch_size=9, seed=1, num_workers=2)) == 12 != len(a0.dataset(batch_size=9, seed=1)) == 11


def test_the_deprecated_reader_names_are_the_one_class(teams):
    (a0, b0), (a1, _) = teams
    with pytest.warns(DeprecationWarning, match="one reader"):
        from featstore.read import MixtureDataset
    with pytest.warns(DeprecationWarning, match="one reader"):
        from featstore.read import MultiTeacherDataset
    with pytest.warns(DeprecationWarning, match="FeatureDataset"):
        from featstore.online import OnlineDataset
    assert MixtureDataset is MultiTeacherDataset is OnlineDataset is FeatureDataset
    mixed = MixtureDataset([Stream(a0, repeat=1), Stream(a1, choose=10)], batch_size=50)
    assert mixed.counts == (96, 10) and "source" in read(mixed)[0]
    assert sorted(read(MultiTeacherDataset({"a": a0, "b": b0}, batch_size=96))[0]) == [
        "a/features", "a/logits", "a/target", "b/logits.ids", "b/logits.values", "index"]


def test_the_one_readers_streams_and_samples(teams):
    (a0, _), (a1, _) = teams
    ds = featstore.mix([(a0, 0.75), (a1, 0.25)], epoch_size=200, batch_size=25, seed=2)
    first, second = ds.samples(0)
    assert (len(first), len(second)) == ds.counts == (150, 50)
    assert sorted(Counter(first.tolist()).values()) == [1] * 42 + [2] * 54  # 96 once, then 54 again
    rows = Counter((int(s), int(i)) for b in read(ds) for s, i in zip(b["source"], b["index"], strict=True))
    assert rows == Counter([(0, int(i)) for i in first] + [(1, int(i)) for i in second])
    assert ds.versions == [a0, a1] and isinstance(ds.versions[0], featstore.Version)
    assert isinstance(a0.dataset().version, featstore.Version) and np.array_equal(a0.dataset().samples()[0],
                                                                                   np.arange(96))
