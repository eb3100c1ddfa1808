"""Several teachers on the same rows: store.dataset({"a": ..., "b": ...}) over a version and one
computed with views_of= it, locally and on S3 (moto), with 0 and 2 real DataLoader workers: each
batch equals each teacher read alone (same rows, same view), an epoch reads each teacher's bytes
of one view and no more, resume mid-epoch (per rank and torchdata's per worker), DDP ranks,
caches, and misaligned teachers refused before any batch."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

import featstore
from featstore import InvalidInput, VersionsMisaligned, kd
from featstore.read import FeatureDataset
from featstore.format._keys import view_path
from featstore.versions import stored

from ..aligned import K, N, copy_to_s3, teacher_a, teacher_b
from ..augments import noisy_flip
from ..models import VectorData
from ..versions.test_views import epochs as read  # each epoch's batches through a real DataLoader

BS = 16


@pytest.fixture(scope="module")
def teams(tmp_path_factory, moto_endpoint):
    """(store, a, b) on local disk and the same objects on S3 (moto), b computed on a's views."""
    store = featstore.open_store(tmp_path_factory.mktemp("multi") / "store")
    a = teacher_a(store)
    b = teacher_b(store, a)
    s3 = copy_to_s3(store, moto_endpoint)
    return {"local": (store, a, b), "s3": (s3, s3.open(a.ref), s3.open(b.ref))}


def assert_same_rows(multi, alone, label):
    """Every batch of the multi-teacher read holds, under ``label/``, exactly teacher ``label``'s
    batch read alone (stored bytes, so bit for bit)."""
    assert len(multi) == len(alone)
    for m, one in zip(multi, alone, strict=True):
        assert torch.equal(m["index"], one["index"]) and torch.equal(m["view"], one["view"])
        for k, t in one.items():
            if k not in ("index", "view"):
                assert torch.equal(m[f"{label}/{k}"], t), (label, k)


def by_index(batches, label=None):
    """``{index: {key: row}}`` of an epoch's batches (keys of teacher ``label`` unprefixed)."""
    out = {}
    for m in batches:
        for r, i in enumerate(m["index"].tolist()):
            out[i] = {(k.split("/", 1)[1] if label else k): t[r] for k, t in m.items()
                      if k != "index" and (label is None or k.startswith(f"{label}/"))} | {"view": m["view"][r]}
    return out


@pytest.mark.parametrize("kind,workers", [("local", 0), ("local", 2), ("s3", 0)])
def test_batches_equal_each_teacher_read_alone(teams, kind, workers):
    store, a, b = teams[kind]
    opts = dict(batch_size=BS, seed=3, shuffle=True)
    ds = store.dataset({"a": a.ref, "b": b.ref}, **opts)
    assert isinstance(ds, FeatureDataset) and ds.batches_per_rank(workers) == a.dataset(**opts).batches_per_rank(
        workers)
    epochs = [0, 1]
    multi = read(ds, workers, epochs)
    for label, v in (("a", a), ("b", b)):
        for e, alone in zip(epochs, read(v.dataset(**opts), workers, epochs), strict=True):
            assert_same_rows(multi[e], alone, label)
    for batches in multi:
        rows = Counter(i for m in batches for i in m["index"].tolist())
        assert set(rows) == set(range(N)) and set(rows.values()) == {1}  # every sample once per epoch
        assert len({int(x) for m in batches for x in m["view"]}) == 1  # one view per epoch, the same for both
        assert sorted(batches[0]) == sorted(["index", "view", "a/features", "a/logits", "a/target", "a/seen",
                                             "b/logits.ids", "b/logits.values", "b/seen"])
    assert {int(multi[e][0]["view"][0]) for e in epochs} != {int(multi[0][0]["view"][0])} or K == 1


def test_two_workers_on_s3_read_the_rows_each_teacher_holds(teams):
    """On S3 with 2 DataLoader workers, every row of the epoch, under each label, is that
    teacher's row of that (index, view), as read alone."""
    store, a, b = teams["s3"]
    (multi,) = read(store.dataset({"a": a, "b": b}, batch_size=BS, seed=3), 2, [1])
    assert sorted(by_index(multi)) == list(range(N))
    for label, v in (("a", a), ("b", b)):
        alone = by_index(read(v.dataset(batch_size=BS, seed=3), 0, [1])[0])
        for i, row in by_index(multi, label).items():
            assert row.keys() == alone[i].keys() and all(torch.equal(row[k], alone[i][k]) for k in row), (label, i)


@pytest.mark.parametrize("s3_server", ["seaweedfs"])  # moto: the other S3 tests here
def test_on_seaweedfs_through_the_disk_cache_an_epoch_equals_each_teacher_alone(teams, s3_endpoint, tmp_path):
    """The same objects put on SeaweedFS (a real S3-compatible server), read through the disk
    cache (each teacher's objects in its own scope)."""
    local, a, b = teams["local"]
    store = copy_to_s3(local, s3_endpoint)
    a, b = store.open(a.ref), store.open(b.ref)
    opts = dict(batch_size=BS, seed=6)
    (multi,) = read(store.dataset({"a": a, "b": b}, cache="disk", cache_dir=str(tmp_path), **opts), 0, [2])
    for label, v in (("a", a), ("b", b)):
        assert_same_rows(multi, read(v.dataset(**opts), 0, [2])[0], label)


def test_a_list_of_teachers_and_fields_per_teacher(teams):
    store, a, b = teams["local"]
    ds = store.dataset([a.ref, b], batch_size=N, shuffle=False, fields={"t0": ["logits"]})
    (batch,) = read(ds, 0, [0])[0]
    assert sorted(batch) == ["index", "t0/logits", "t1/logits.ids", "t1/logits.values", "t1/seen", "view"]
    with pytest.raises(InvalidInput, match="teachers"):
        store.dataset([a, b], fields={"c": ["logits"]})


def test_the_source_is_joined_once_and_the_ensemble_distils(teams):
    store, a, b = teams["local"]
    ds = store.dataset({"a": a, "b": b}, batch_size=BS, seed=1, source=VectorData(N), augment=noisy_flip,
                       source_fields={"input": "input"})
    for batch in read(ds, 2, [K + 1])[0]:
        assert "a/input" not in batch and "b/input" not in batch
        # the student's input is the view both teachers saw, bit for bit
        assert torch.equal(batch["input"], batch["a/seen"]) and torch.equal(batch["input"], batch["b/seen"])
        ens = kd.ensemble(batch, ["a/logits", "b/logits"])
        mix = 0.5 * torch.softmax(batch["a/logits"], -1) + 0.5 * kd.densify(batch, "b/logits", 5)
        torch.testing.assert_close(kd.densify(ens, num_classes=5), mix, rtol=0, atol=1e-6)
        student = torch.zeros(len(batch["index"]), 5, requires_grad=True)
        loss = kd.kd_loss(student, ens)
        want = (mix * (mix.log() - torch.log_softmax(student, -1))).sum(-1).mean()
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)


def test_an_epoch_reads_each_teachers_bytes_of_one_view_no_more(teams, monkeypatch):
    store, a, b = teams["s3"]
    reads: Counter = Counter()
    backend = type(stored(a).storage)  # the S3 backend's own reads (Storage is the interface)
    read_bytes, read_range = backend.read_bytes, backend.read_range

    def counted(got, key):  # the bytes of every shard object read, by object
        if "/c/" in key and got is not None:
            reads[key] += len(got)
        return got

    monkeypatch.setattr(backend, "read_bytes", lambda self, key, **kw: counted(read_bytes(self, key, **kw), key))
    monkeypatch.setattr(backend, "read_range", lambda self, key, *args: counted(read_range(self, key, *args), key))
    epoch = 2

    def epoch_reads(ds):
        reads.clear()
        batches = read(ds, 0, [epoch])[0]
        return dict(reads), int(batches[0]["view"][0])

    multi, view = epoch_reads(store.dataset({"a": a, "b": b}, batch_size=BS, seed=4))
    alone = {}
    for v in (a, b):
        got, v_view = epoch_reads(v.dataset(batch_size=BS, seed=4))
        assert v_view == view
        alone.update(got)
    assert multi == alone  # the same objects, the same bytes: each teacher's one view, once
    assert {k for k in multi if stored(a).key in k} and {k for k in multi if stored(b).key in k}
    assert all(f"/{view_path(view)}/" in k for k in multi), sorted(multi)[:3]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch(teams, workers):
    store, a, b = teams["local"]
    epoch, opts = K + 1, dict(batch_size=8, seed=2, source=VectorData(N), augment=noisy_flip)
    full = read(store.dataset({"a": a, "b": b}, **opts), workers, [epoch])[0]
    ds = store.dataset({"a": a, "b": b}, **opts)
    ds.set_epoch(epoch)
    state = ds.state_dict(batches_seen=3)
    again = store.dataset({"a": a, "b": b}, **opts)
    again.load_state_dict(state)
    rest = list(DataLoader(again, batch_size=None, num_workers=workers, timeout=120 if workers else 0))
    assert len(rest) == len(full) - 3
    for x, y in zip(full[3:], rest, strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    with pytest.raises(InvalidInput, match="same teachers"):
        store.dataset({"a": a, "c": b}, **opts).load_state_dict(state)
    with pytest.raises(InvalidInput, match="multi-teacher"):
        store.dataset({"a": a, "b": b}, **opts).load_state_dict(a.dataset(**opts).state_dict())


def test_torchdata_resumes_per_worker(teams):
    from torchdata.stateful_dataloader import StatefulDataLoader

    store, a, b = teams["local"]
    kw = dict(batch_size=None, num_workers=2, timeout=120)
    loader = StatefulDataLoader(store.dataset({"a": a, "b": b}, batch_size=8, seed=2), **kw)
    seen, state, k = [], None, 4
    for i, batch in enumerate(loader):
        seen.append(batch["index"].tolist())
        if i + 1 == k:
            state = loader.state_dict()
    resumed = StatefulDataLoader(store.dataset({"a": a, "b": b}, batch_size=8, seed=2), **kw)
    resumed.load_state_dict(state)
    rest = [batch["index"].tolist() for batch in resumed]
    assert rest == seen[k:]


def test_ddp_ranks_and_the_memory_cache(teams):
    store, a, b = teams["s3"]
    got = []
    for rank in (0, 1):
        opts = dict(batch_size=BS, seed=5, rank=rank, world_size=2)
        multi = read(store.dataset({"a": a, "b": b}, cache="memory", cache_bytes=2**24, **opts), 0, [0, 0])
        assert_same_rows(multi[0], read(b.dataset(**opts), 0, [0])[0], "b")
        assert all(torch.equal(x["b/logits.ids"], y["b/logits.ids"]) for x, y in zip(*multi, strict=True))
        got.append(Counter(i for m in multi[0] for i in m["index"].tolist()))
    assert sum(len(c) for c in got) == N and set(got[0]) | set(got[1]) == set(range(N))  # pad: even here
    FeatureDataset({"a": a, "b": b}, cache="memory", cache_bytes=2**24).clear_cache()


def test_misaligned_teachers_are_refused_before_any_batch(teams):
    store, a, b = teams["local"]
    plain = teacher_a(store, views=None, name="teacher-c/plain")
    with pytest.raises(VersionsMisaligned, match=r"views \(K=3 vs none\)") as err:
        store.dataset({"a": a, "c": plain})
    assert err.value.differs == ("views",) and "views_of=" in str(err.value)
    with pytest.raises(VersionsMisaligned, match="dataset length") as err:
        store.dataset({"c": plain, "d": teacher_a(store, views=None, name="teacher-d/more",
                                                  data=VectorData(N + 16))})
    assert err.value.differs == ("dataset length", "dataset content")
    with pytest.raises(featstore.InvalidName):
        store.dataset({"a/x": a, "b": b})
