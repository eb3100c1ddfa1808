"""views_of=: a second Model A computed on exactly a first version's views (same K, seeds,
augment, dataset, shards), the link recorded in the fingerprint, and every misalignment refused
before anything runs, naming what differs."""

from __future__ import annotations

import pytest
import torch

import featstore
from featstore import InvalidInput, VersionsMisaligned
from featstore.versions._alignment import Alignment, check_aligned

from ..aligned import K, N, SEED, SPP, teacher_a, teacher_b
from ..helpers import QUIET16, TinyA, VectorData, noisy_flip


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import featstore

    store = featstore.open_store(tmp_path_factory.mktemp("views_of") / "store")
    a = teacher_a(store)
    return store, a, teacher_b(store, a)


def nothing_committed(store, name):
    return store.versions(name) == []


def test_b_runs_on_exactly_the_views_of_a(pair):
    store, a, b = pair
    assert (b.views, b.manifest.views) == (K, a.manifest.views)  # K, seed, policy and augment adopted
    assert b.manifest.layout.samples_per_shard == SPP
    assert b.views_of == a.ref and b.manifest.fingerprint_parts["views_of"] == {"name": a.name, "id": a.id}
    assert a.views_of is None
    model_b = TinyA(seed=1)
    for view in range(K):
        va, vb = a.view(view).load(), b.view(view).load()
        # the input each Model A saw, stored by both from their own Dask tasks: the same bits
        assert torch.equal(va["seen"], vb["seen"]) and torch.equal(va["view_seed"], vb["view_seed"])
        with torch.no_grad():
            want = torch.softmax(model_b(vb["seen"])["logits"], -1).topk(3, dim=-1)
        assert torch.equal(vb["logits.ids"].sort(-1).values, want.indices.sort(-1).values)
    assert not torch.equal(a.view(0).load()["seen"], a.view(1).load()["seen"])  # the views do differ
    check_aligned({"a": a, "b": b})  # the reader's check agrees


def test_the_link_is_part_of_the_fingerprint(pair, dask_client):
    store, a, b = pair
    # the same Model A' on the same views, but computed on its own (no link): another version
    alone = store.compute("teacher-b/alone", model=TinyA(seed=1), dataset=VectorData(N), keep={"seen": "input"},
                          outputs={"logits": "topk:3"}, batch_size=16, client=dask_client,
                          options=QUIET16, views=featstore.Views(k=K, augment=noisy_flip, seed=SEED),
                          samples_per_shard=SPP)
    assert alone.views_of is None and "views_of" not in alone.manifest.fingerprint_parts
    assert alone.id != b.id and alone.manifest.views == b.manifest.views
    # ...whose rows are the same: it aligns with both
    check_aligned({"a": a, "alone": alone, "b": b})
    # a rerun of the linked compute finds b committed: nothing is computed again
    assert teacher_b(store, a).id == b.id


def test_a_version_without_views_links_the_same_samples(tmp_path):
    import featstore

    store = featstore.open_store(tmp_path / "store")
    a = teacher_a(store, views=None)
    b = teacher_b(store, a)
    assert b.views is None and b.views_of == a.ref and b.manifest.layout == a.manifest.layout
    assert torch.equal(a.load()["seen"], b.load()["seen"])
    with pytest.raises(VersionsMisaligned, match="has no views") as err:
        teacher_b(store, a, name="bad/views", augment=noisy_flip, views=2)
    assert err.value.differs == ("views",)
    with pytest.raises(VersionsMisaligned, match="dataset content") as err:  # same length, other order
        teacher_b(store, a, name="bad/order", data=Reversed(VectorData(N)))
    assert err.value.differs == ("dataset content",)
    assert nothing_committed(store, "bad/views") and nothing_committed(store, "bad/order")


class Reversed(torch.utils.data.Dataset):
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[len(self.data) - 1 - i]


@pytest.mark.parametrize(("kw", "differs", "match"), [
    ({"data": VectorData(N, seed=1)}, ("dataset content",), "sampled digest"),
    ({"data": VectorData(N + 8)}, ("dataset length", "dataset content"), r"dataset length \(80 vs 88\)"),
    ({"augment": lambda item, gen: {**item, "input": item["input"] * 2}}, ("augment",), "its source differs"),
    ({"views": K - 1}, ("view count",), r"view count \(2 given, 3 in"),
    ({"augment_seed": SEED + 1}, ("view seed",), "augment_seed=8 given"),
    ({"samples_per_shard": 16}, ("samples per shard",), "samples per shard"),
])
def test_misaligned_computes_are_refused_naming_what_differs(pair, kw, differs, match):
    store, a, _ = pair
    with pytest.raises(VersionsMisaligned, match=match) as err:
        teacher_b(store, a, name="bad/b", **kw)  # refused before any task runs
    assert err.value.differs == differs
    assert nothing_committed(store, "bad/b")


def test_views_of_needs_the_augment_and_no_extends(pair):
    store, a, _ = pair
    with pytest.raises(InvalidInput, match="pass augment="):
        teacher_b(store, a, name="bad/b", augment=None)
    with pytest.raises(InvalidInput, match="do not combine"):
        teacher_b(store, a, name="bad/b", augment=None, extends=a.ref)


def test_alignment_of_datasets_named_by_id():
    def al(**kw):
        base = {"length": 80, "digest": None, "dataset_id": None, "views": None, "seed": None, "policy": None,
                "augment": None}
        return Alignment(**{**base, **kw})

    assert al(digest="d1", dataset_id="x").differs(al(digest="d1", dataset_id="y")) == []  # content decides
    assert al(dataset_id="x").differs(al(dataset_id="x")) == []
    assert al(dataset_id="x").differs(al(dataset_id="y")) == ["dataset_id ('x' vs 'y')"]
    assert al(dataset_id="x").differs(al(digest="d1"))[0].startswith("dataset identity")
    got = al(digest="d", views=3, seed=1, policy="p", augment="f").differs(
        al(digest="d", views=2, seed=2, policy="p", augment="g"))
    assert [g.split(" (")[0] for g in got] == ["view count", "view seed", "augment"]
