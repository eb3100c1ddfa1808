"""Weighted mixtures of versions through the real reader and DataLoader workers: realised
proportions, repeat/choose, determinism, the source column, elastic resume, refusals."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import featstore
from featstore import InvalidInput, Stream
from featstore.read.plans._mixture import mixture_share
from featstore.read.plans._slices import slice_rows
from tests.helpers import noisy_flip, write_version


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    store = featstore.open_store(tmp_path_factory.mktemp("mix"))
    return write_version(store, "a/x", n=600), write_version(store, "b/x", n=400)


def read(ds, workers=0):
    return list(DataLoader(ds, batch_size=None, num_workers=workers, timeout=120 if workers else 0))


def keys(batches):
    """Each row as (source, index)."""
    return [(int(s), int(i)) for b in batches for s, i in zip(b["source"], b["index"], strict=True)]


def test_realised_proportions_within_one_percent_per_10000(two):
    ds = featstore.mix([(two[0], 0.7), (two[1], 0.3)], epoch_size=50_000, batch_size=500, seed=3,
                       fields=("target",))
    rows = keys(read(ds, 2))
    assert len(rows) == 50_000
    src = np.array([s for s, _ in rows])
    for block in src.reshape(-1, 10_000):  # in the order a training loop sees them
        assert abs((block == 0).mean() - 0.7) <= 0.01
    # without replacement until a version is exhausted: each sample of b drawn 15000/400 times, +-1
    per_b = Counter(i for s, i in rows if s == 1)
    assert set(per_b) == set(range(400)) and max(per_b.values()) - min(per_b.values()) <= 1


def test_batches_hold_the_versions_values_grouped_by_source(two):
    ds = featstore.mix([(two[0], 0.5), (two[1], 0.5)], batch_size=64, seed=1)
    full = [v.load() for v in two]
    for b in read(ds, 2):
        s = b["source"]
        assert torch.equal(s, torch.sort(s).values)  # version 0's rows first
        for k in (0, 1):
            idx = b["index"][s == k]
            assert torch.equal(b["features"][s == k], torch.as_tensor(full[k]["features"][idx.numpy()]))


def test_repeat_and_choose_and_deterministic(two):
    ds = featstore.mix([Stream(two[0], repeat=0.5), Stream(two[1], choose=100)], batch_size=40, seed=2)
    assert ds.counts == (300, 100)
    rows = keys(read(ds))
    assert Counter(s for s, _ in rows) == {0: 300, 1: 100}
    assert len(set(rows)) == 400  # none twice within an epoch
    again = featstore.mix([Stream(two[0], repeat=0.5), Stream(two[1], choose=100)], batch_size=40, seed=2)
    assert keys(read(again)) == rows  # same seed, epoch and split: same order
    ds.set_epoch(1)
    assert keys(read(ds)) != rows


def _mixed(two, world, rank):
    return featstore.mix([(two[0], 0.7), (two[1], 0.3)], epoch_size=1000, batch_size=24 // world, seed=5,
                         partition="even", rank=rank, world_size=world)


@pytest.mark.parametrize("before,after", [((2, 2), (3, 0)), ((1, 0), (4, 1))])
def test_resume_mid_epoch_under_another_split_nothing_repeated_or_lost(two, before, after):
    world, workers = before
    seen, state = [], None
    for r in range(world):
        ds = _mixed(two, world, r)
        got = []
        for b in DataLoader(ds, batch_size=None, num_workers=workers, timeout=120 if workers else 0):
            got.append(b)
            if len(got) == 10:
                break
        seen += keys(got)
        if r == 0:
            state = ds.state_dict(batches_seen=10, num_workers=workers)
    rest = []
    for r in range(after[0]):
        ds = _mixed(two, after[0], r)
        ds.load_state_dict(state)
        rest += keys(read(ds, after[1]))
    whole = Counter(keys(read(_mixed(two, 1, 0))))
    assert Counter(seen + rest) == whole and sum(whole.values()) == 1000


def test_refuses_incompatible_versions_and_mixes_views(two, tmp_path):
    store = featstore.open_store(tmp_path)
    other = write_version(store, "c/x", n=100, outputs={"features": "float32", "logits": "float32"})
    with pytest.raises(InvalidInput, match=r"'features' dtype .*fields=\[\.\.\.\].*'logits'"):
        featstore.mix([(two[0], 0.5), (other, 0.5)])
    ds = featstore.mix([(two[0], 0.5), (other, 0.5)], fields=["logits", "target"], batch_size=50)
    assert set(read(ds)[0]) == {"logits", "target", "index", "source"}
    with pytest.warns(DeprecationWarning, match="fields"):  # mix's older name for it
        assert featstore.mix([(two[0], 0.5), (other, 0.5)], arrays=["logits"]).fields == ("logits",)
    # a version with views mixes with one without: its rows carry the epoch's view, the others -1
    viewed = write_version(store, "v/x", n=64, views=featstore.Views(k=2, augment=noisy_flip))
    rows = read(featstore.mix([(two[0], 0.5), (viewed, 0.5)], epoch_size=200, batch_size=50, seed=1))
    views = torch.cat([b["view"] for b in rows])
    sources = torch.cat([b["source"] for b in rows])
    assert set(views[sources == 0].tolist()) == {-1} and len(set(views[sources == 1].tolist())) == 1


def _planned_keys(ds, epoch, batch_size):
    """(source, index) of every row the pure plan yields, in order: each slice's stratified order,
    then each batch grouped by version (stably), batches cut across slices."""
    share = mixture_share(ds.mixture, seed=ds.options.seed, epoch=epoch, shuffle=ds.options.shuffle, consumers=1,
                          cid=0, partition="even", window=ds.order.window)
    flat = []
    for sl in share.slices:
        rows = slice_rows(sl, ds.options.seed, epoch, ds.options.shuffle)
        samples = [np.concatenate([np.arange(p.shard * v.manifest.layout.samples_per_shard + p.lo,
                                             p.shard * v.manifest.layout.samples_per_shard + p.hi) for p in run])
                   if run else np.zeros(0, dtype=np.int64) for run, v in zip(rows.reads, ds.versions, strict=True)]
        starts = np.cumsum([0] + [len(s) for s in samples])
        flat += [(int(k), int(samples[k][i - starts[k]])) for i, k in zip(rows.order, rows.streams, strict=True)]
    return [row for at in range(0, len(flat), batch_size)
            for row in sorted(flat[at:at + batch_size], key=lambda r: r[0])]  # sorted() is stable


@pytest.mark.parametrize("shuffle", [True, False])
def test_batches_across_window_boundaries_hold_every_arrays_values_in_the_plans_order(two, shuffle):
    # 37-row batches of 70-row windows: most batches take rows from two windows, and the target
    # is decoded (zstd) into window buffers that a later window reuses
    ds = featstore.mix([(two[0], 0.7), (two[1], 0.3)], epoch_size=1000, batch_size=37, seed=5, shuffle=shuffle,
                       shuffle_window=70)
    full = [v.load() for v in two]
    batches = read(ds)
    assert keys(batches) == _planned_keys(ds, 0, 37)
    for b in batches:
        for k in (0, 1):
            at = b["source"] == k
            for f in ("features", "logits", "target"):
                assert torch.equal(b[f][at], torch.as_tensor(full[k][f][b["index"][at].numpy()])), f
