"""Online mode: store.dataset(name, teacher=Teacher(...)) gives the stored reader's batches (same
plan, keys and values: TinyA computes exactly, so bit for bit) with Model A run in the consuming
process, through real DataLoader workers; views, a fresh augmentation, resume and bad input."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch
from torch.utils.data import DataLoader

import featstore
from featstore import DeviceSetupError, InvalidInput, Teacher
from featstore.online import plan_teacher

from ..helpers import QUIET16, IdData, RaisesFrom, TinyA, VectorData, noisy_flip, write_version

N = 333
OUTPUTS = {"features": "float16", "logits": "float32"}


def teacher(**kw):
    args = dict(model=TinyA(), dataset=VectorData(N), keep=["target"], outputs=OUTPUTS, samples_per_shard=32,
                batch_size=32, options=QUIET16)
    return Teacher(**{**args, **kw})


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """The same teacher computed and committed: plain and with 2 views."""
    store = featstore.open_store(tmp_path_factory.mktemp("online") / "store")
    args = dict(model=TinyA(), dataset=VectorData(N), keep=["target"], outputs=OUTPUTS, samples_per_shard=32,
                batch_size=32, options=QUIET16)
    return store, write_version(store, "tiny/ds", **args), write_version(
        store, "tiny/views", views=featstore.Views(k=2, augment=noisy_flip), **args)


def epoch(ds, workers):
    return list(DataLoader(ds, batch_size=None, num_workers=workers, timeout=120 if workers else 0))


def assert_same_batches(got, want):
    assert len(got) == len(want) and len(got) > 0
    for g, w in zip(got, want, strict=True):
        assert sorted(g) == sorted(w)
        for k in w:  # TinyA on VectorData is exact: the same bits in any process
            assert g[k].dtype == w[k].dtype and torch.equal(g[k], w[k]), k


@pytest.mark.parametrize("workers", [0, 2])
def test_online_batches_equal_stored_batches(stored, workers):
    store, version, _ = stored
    files = lambda: sorted(pathlib.Path(store.storage.root).rglob("*"))
    before = files()
    online = store.dataset("tiny/ds", batch_size=25, seed=1, teacher=teacher())
    assert online.version.id == version.id and online.version.manifest.layout == version.manifest.layout
    assert online.version.manifest.arrays == version.manifest.arrays
    plain = version.dataset(batch_size=25, seed=1)
    for e in (0, 1):  # set_epoch: another shard order, still the same batches
        online.set_epoch(e)
        plain.set_epoch(e)
        assert_same_batches(epoch(online, workers), epoch(plain, workers))
    assert files() == before  # online mode writes nothing


def test_online_ranks_split_like_stored_ranks(stored):
    store, version, _ = stored
    for rank in range(2):
        online = store.dataset("tiny/ds", batch_size=16, seed=3, rank=rank, world_size=2, teacher=teacher())
        plain = version.dataset(batch_size=16, seed=3, rank=rank, world_size=2)
        assert_same_batches(epoch(online, 2), epoch(plain, 2))


def test_online_resumes_mid_epoch_from_state_dict(stored):
    store, _, _ = stored
    full = epoch(store.dataset("tiny/ds", batch_size=20, seed=7, teacher=teacher()), 0)
    ds = store.dataset("tiny/ds", batch_size=20, seed=7, teacher=teacher())
    it = iter(ds)
    for _ in range(5):
        next(it)
    state = ds.state_dict()
    resumed = store.dataset("tiny/ds", batch_size=20, seed=7, teacher=teacher())
    resumed.load_state_dict(state)
    assert_same_batches(epoch(resumed, 0), full[5:])


def test_online_views_and_source_join_equal_stored(stored):
    store, _, views = stored
    data = VectorData(N)
    online = store.dataset("tiny/views", batch_size=50, seed=2, source=data, augment=noisy_flip,
                           teacher=teacher(views=featstore.Views(k=2, augment=noisy_flip)))
    plain = views.dataset(batch_size=50, seed=2, source=data, augment=noisy_flip)
    assert online.version.id == views.id
    for e in (0, 1):  # one view per epoch: both views over two epochs
        online.set_epoch(e)
        plain.set_epoch(e)
        got = epoch(online, 2)
        assert_same_batches(got, epoch(plain, 2))
        assert "input" in got[0] and "view" in got[0]


def test_fresh_augmentation_is_what_the_student_sees_and_never_stored(stored, tmp_path):
    store, version, _ = stored
    data, a = VectorData(N), TinyA()
    fresh = teacher(augment=noisy_flip)
    ds = store.dataset("tiny/ds", batch_size=64, seed=5, source=data, augment=noisy_flip, teacher=fresh)
    assert ds.version.id != version.id  # outputs of one draw: never the stored version's id
    by_epoch = []
    for e in (0, 1):
        ds.set_epoch(e)
        rows = {}
        for b in epoch(ds, 2):
            # the joined input is the augmented input A saw: A on it gives the batch's features
            want = torch.relu(a.f(b["input"])).to(torch.float16)
            torch.testing.assert_close(b["features"], want, rtol=1e-3, atol=1e-3)
            rows.update(zip(b["index"].tolist(), b["features"], strict=True))
        by_epoch.append(rows)
    assert sorted(by_epoch[0]) == list(range(N))
    assert any(not torch.equal(by_epoch[0][i], by_epoch[1][i]) for i in range(N))  # a fresh draw each epoch
    with pytest.raises(InvalidInput, match="fresh augmentation"):
        dataclasses.replace(fresh, fill=True)


def test_teacher_bad_input_is_a_clear_error(stored):
    store, _, _ = stored
    with pytest.raises(InvalidInput, match="device"):
        teacher(device="tpu")
    with pytest.raises(InvalidInput, match="fill"):
        teacher(fill="yes")
    with pytest.raises(InvalidInput, match="feature set"):
        store.dataset("tiny/ds@abc", teacher=teacher())
    with pytest.raises(InvalidInput, match="Teacher"):
        store.dataset("tiny/ds", teacher=TinyA())
    with pytest.raises(InvalidInput, match="inside views=featstore.Views"):
        teacher(views=featstore.Views(k=2, augment=noisy_flip), augment=noisy_flip)
    with pytest.raises(InvalidInput, match="augment_seed= names the seed of views"):
        teacher(augment=noisy_flip, augment_seed=3)
    with pytest.warns(DeprecationWarning, match=r"Teacher\(views=K, augment=fn, augment_seed=S\) is deprecated") \
            as seen:
        old = teacher(views=2, augment=noisy_flip, augment_seed=3)
    assert seen[0].filename == __file__  # the warning names the caller's line
    new = teacher(views=featstore.Views(k=2, augment=noisy_flip, seed=3))
    assert (old.view_count, old.view_augment, old.view_seed) == (new.view_count, new.view_augment, new.view_seed)
    assert plan_teacher(store.catalog, "tiny/v", old).vid == plan_teacher(store.catalog, "tiny/v", new).vid
    if not torch.cuda.is_available():
        with pytest.raises(DeviceSetupError, match="CUDA"):
            store.dataset("tiny/ds", teacher=teacher(device="cuda"))


@pytest.mark.parametrize("workers", [0, 2])
def test_model_a_raising_in_the_loop_reaches_training_as_documented(tmp_path, workers):
    """docs/errors.md: in the training process itself the user's exception is the ComputeFailed's
    ``__cause__``; from a DataLoader worker process PyTorch re-raises the class with a message
    only, so the message carries the user's exception type, text and where it was raised."""
    store = featstore.open_store(tmp_path / "store")
    late = teacher(model=RaisesFrom(100), dataset=IdData(200), keep=[], outputs={"out": "float32"})
    ds = store.dataset("tiny/raises", batch_size=32, seed=0, teacher=late)  # its probe of A passes
    with pytest.raises(featstore.ComputeFailed) as err:
        list(DataLoader(ds, batch_size=None, num_workers=workers, timeout=120 if workers else 0))
    text = str(err.value)
    assert "Model A raised RuntimeError: boom from Model A at sample 100 or later" in text
    assert "Raised at tests/models.py:" in text and " in forward" in text
    if workers:
        assert err.value.__cause__ is None and "in DataLoader worker process" in text
    else:
        assert isinstance(err.value.__cause__, RuntimeError) and "boom from Model A" in str(err.value.__cause__)
