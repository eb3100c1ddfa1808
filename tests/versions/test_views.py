"""Augmented views end to end: compute K views with Dask, replay them, read one per epoch, join
the student's input; on local disk and S3 (moto), with 0 and 2 DataLoader worker processes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

import featstore
from featstore import ComputeOptions, InvalidInput, NondeterministicAugment, SourceMismatch
from featstore.format._keys import view_path
from featstore.versions._keys import receipt_key, view_key
from featstore.versions._receipts import forget_receipts
from featstore.versions._views import view_seed
from featstore.versions import stored

from tests.helpers import (CountingA, CountingAugment, TinyA, VectorData, global_noise, noisy_flip, s3_store,
                           write_version)

N, SPP, K = 80, 32, 3
OUT = {"features": "float16", "logits": "float32"}
# fp16 features: half an ulp at |x| < 4; float32 logits across processes: last bits may differ.
TOL = {"features": 2e-3, "logits": 1e-5}


def compute(store, client, data=None, model=None, augment=noisy_flip, views=K, model_id=None, shards_per_task=1,
            old_keywords=False, **kw):
    if views is None or old_keywords:  # the keywords of before featstore.Views (deprecated, one release)
        kw.update(views=views, augment=augment, augment_seed=7)
    else:
        kw.update(views=featstore.Views(k=views, augment=augment, seed=7))
    return write_version(store, "tiny/views", model=model or TinyA(), dataset=data or VectorData(N),
                         keep={"target": "target", "seen": "input", "flip": "flip"}, outputs=OUT,
                         samples_per_shard=SPP, batch_size=16, client=client,
                         options=ComputeOptions(progress=False, chunk_rows=16, model_id=model_id,
                                                shards_per_task=shards_per_task), **kw)


@pytest.fixture(scope="module")
def versions(tmp_path_factory, moto_endpoint):
    """One K-view version on local disk and one on S3 (written by the tests' runner)."""
    stores = {"local": featstore.open_store(tmp_path_factory.mktemp("views") / "store"),
              "s3": s3_store(moto_endpoint, bucket="views")}
    return {kind: compute(store, None) for kind, store in stores.items()}


def epochs(ds, workers, epochs_, resume=None):
    loader = DataLoader(ds, batch_size=None, num_workers=workers, timeout=120 if workers else 0)
    out = []
    for e in epochs_:
        ds.set_epoch(e)
        out.append(list(loader))
    return out


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_replay_reproduces_the_input_and_output_a_saw(versions, kind, workers):
    v = versions[kind]
    assert v.views == K and len(stored(v).shard_receipts()) == K * v.manifest.layout.n_shards
    data, model = VectorData(N), TinyA()
    # the join rebuilds, in DataLoader workers, the exact input Model A saw in a Dask worker
    ds = v.dataset(batch_size=16, seed=3, source=data, augment=noisy_flip, source_fields={"input": "input"})
    for batch in epochs(ds, workers, range(2))[1]:
        assert torch.equal(batch["input"], batch["seen"])  # bit for bit
        with torch.no_grad():
            out = model(batch["input"])
        for name, tol in TOL.items():
            assert torch.allclose(batch[name].float(), out[name], atol=tol, rtol=0), name
    # version.view_seed(i, v) replays any single view, and the stored seeds are the same numbers
    for i, view in [(0, 0), (N - 1, K - 1), (40, 1)]:
        seed = v.view_seed(i, view)
        again = noisy_flip(data[i], torch.Generator().manual_seed(seed))
        row = v[view, i]
        assert int(row["view_seed"]) == seed and int(row["view"]) == view
        assert torch.equal(again["input"], row["seen"]) and bool(again["flip"]) == bool(row["flip"])
        with torch.no_grad():
            assert torch.allclose(model(again["input"][None])["logits"][0], row["logits"], atol=TOL["logits"])


def test_views_differ_and_plain_zarr_reads_them(versions):
    import zarr

    v = versions["local"]
    seen = torch.stack([v.view(k).load()["seen"] for k in range(K)])
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])
    group = zarr.open_group(v.url, mode="r")
    assert group[f"{view_path(2)}/logits"].shape == (N, 5)
    assert group[f"{view_path(2)}/view_seed"][5] == v.view_seed(5, 2)
    with pytest.raises(InvalidInput, match="pick one"):
        v[0:3]
    assert v.verify() == []


@pytest.mark.parametrize("workers", [0, 2])
def test_every_view_of_every_sample_once_over_k_epochs(versions, workers):
    v = versions["s3" if workers else "local"]
    ds = v.dataset(batch_size=16, seed=5)
    runs = epochs(ds, workers, range(K, 2 * K))  # the second cycle of K epochs
    pairs = Counter()
    for batches in runs:
        views = {int(x) for b in batches for x in b["view"]}
        assert len(views) == 1  # one view per epoch: an epoch reads the bytes of one view
        for b in batches:
            pairs.update(zip(b["index"].tolist(), b["view"].tolist(), strict=True))
            assert "view_seed" not in b  # seeds are read only when asked for
    assert set(pairs) == {(i, k) for i in range(N) for k in range(K)} and set(pairs.values()) == {1}


def test_pinned_and_random_views(versions):
    v = versions["local"]
    pinned = epochs(v.dataset(batch_size=40, view=2), 0, range(3))
    assert {int(x) for run in pinned for b in run for x in b["view"]} == {2}
    with pytest.raises(InvalidInput, match="out of range"):
        v.dataset(view=K)
    drawn = {int(run[0]["view"][0]) for run in epochs(v.dataset(batch_size=80, view="random"), 0, range(12))}
    assert drawn <= set(range(K)) and len(drawn) > 1


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_inside_a_view_cycle(versions, workers):
    v = versions["local"]
    epoch = K + 1  # the second epoch of the second cycle
    full = epochs(v.dataset(batch_size=8, seed=2, source=VectorData(N), augment=noisy_flip), workers, [epoch])[0]
    ds = v.dataset(batch_size=8, seed=2, source=VectorData(N), augment=noisy_flip)
    ds.set_epoch(epoch)
    state = ds.state_dict(batches_seen=3)
    again = v.dataset(batch_size=8, seed=2, source=VectorData(N), augment=noisy_flip)
    again.load_state_dict(state)
    rest = list(DataLoader(again, batch_size=None, num_workers=workers, timeout=120 if workers else 0))
    assert len(rest) == len(full) - 3
    for a, b in zip(full[3:], rest, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_mismatched_source_is_refused(versions):
    v = versions["local"]
    with pytest.raises(SourceMismatch, match="digest"):
        v.dataset(source=VectorData(N, seed=1), augment=noisy_flip)
    with pytest.raises(SourceMismatch, match="items"):
        v.dataset(source=VectorData(N + 1), augment=noisy_flip)
    with pytest.raises(SourceMismatch, match="augment"):
        v.dataset(source=VectorData(N), augment=global_noise)
    with pytest.raises(InvalidInput, match="augment="):
        v.dataset(source=VectorData(N))


def test_an_augment_using_global_randomness_is_detected(local_store, dask_client):
    with pytest.raises(NondeterministicAugment, match="generator"):
        compute(local_store, dask_client, augment=global_noise)
    assert local_store.names() == []


def test_the_old_views_keywords_still_work_with_a_deprecation_warning(local_store, dask_client):
    with pytest.warns(DeprecationWarning, match="featstore.Views"):
        old = compute(local_store, dask_client, old_keywords=True)
    new = compute(local_store, dask_client)  # the same version: same fingerprint, so the same id
    assert new.id == old.id and new.manifest.views == old.manifest.views and new.manifest.views.count == K
    with pytest.raises(InvalidInput, match="inside views="):
        local_store.compute("tiny/views", model=TinyA(), dataset=VectorData(N), outputs=OUT,
                            views=featstore.Views(k=K, augment=noisy_flip), augment=noisy_flip)


def test_views_arguments_are_checked(local_store, dask_client):
    with pytest.raises(InvalidInput, match="augment"):
        compute(local_store, dask_client, augment=None)
    with pytest.raises(InvalidInput, match="views"):
        compute(local_store, dask_client, views=None)
    with pytest.raises(InvalidInput, match="positive"):
        compute(local_store, dask_client, views=0)


def test_resume_recomputes_only_missing_view_shard_units(tmp_path, dask_client):
    store = featstore.open_store(tmp_path / "store")
    first = compute(store, dask_client, model_id="tiny-a")  # the fingerprint covers A's code otherwise
    vkey = stored(first).key
    # an interrupted run: no manifest, and two (view, shard) units without their receipts
    store.storage.delete(f"{vkey}/manifest.json")
    for view, shard in [(1, 2), (2, 0)]:
        forget_receipts(store.storage, view_key(vkey, view), [shard])
    log = tmp_path / "forwards.log"
    again = compute(store, dask_client, model=CountingA(str(log)), model_id="tiny-a")
    rows = [int(x) for x in log.read_text().split()]
    assert sum(rows) - rows[0] == (N - 2 * SPP) + SPP  # shard 2 holds N - 2*SPP rows, shard 0 SPP
    assert again.id == first.id and again.verify() == []
    assert [(s.view, s.digests) for s in stored(again).shard_receipts()] == [
        (s.view, s.digests) for s in stored(first).shard_receipts()]


def test_no_views_keeps_ids_and_batches(local_store, dask_client):
    data = VectorData(N)
    v = local_store.compute("tiny/plain", model=TinyA(), dataset=data, keep=["target"], outputs=OUT,
                            samples_per_shard=SPP, client=dask_client, options=ComputeOptions(progress=False))
    assert v.views is None and "views" not in v.manifest.fingerprint_parts
    assert "views" not in v.manifest.to_json() and all(r.view is None for r in stored(v).shard_receipts())
    assert "view" not in local_store.storage.read_json(receipt_key(stored(v).key, 0))  # receipts as before views
    with pytest.raises(InvalidInput, match="no views"):
        v.dataset(view=0)
    # the join without views: the item as it is, or freshly augmented per (seed, epoch, index)
    plain = epochs(v.dataset(batch_size=20, source=data, source_fields=["input"]), 0, range(1))[0]
    assert all(torch.equal(b["input"], data.x[b["index"]]) and "view" not in b for b in plain)
    aug = epochs(v.dataset(batch_size=N, shuffle=False, source=data, augment=noisy_flip,
                           source_fields={"x": "input"}), 0, range(2))
    assert not torch.equal(aug[0][0]["x"], aug[1][0]["x"]) and not torch.equal(aug[0][0]["x"], data.x)


def test_augment_calls_count_one_per_view_and_sample(tmp_path, dask_client):
    log = tmp_path / "aug.log"
    store = featstore.open_store(tmp_path / "store")
    compute(store, dask_client, augment=CountingAugment(str(log)), views=2)
    data = VectorData(N)
    index = {data.x[i].numpy().tobytes().hex(): i for i in range(N)}
    calls = Counter()
    for line in log.read_text().splitlines():  # (sample, seed) of every call
        seed, item = line.split()
        calls[index[item], int(seed)] += 1

    def seed(i, view):
        return view_seed(7, i, view)

    # one call per (view, sample), plus the replay check (samples 0 and N // 2 of view 0, twice
    # each), the validation item (sample 0, view 0) and the probe batch (samples 0-15 of view 0)
    want = Counter({(i, seed(i, v)): 1 for i in range(N) for v in range(2)})
    want += Counter({(0, seed(0, 0)): 2 + 1, (N // 2, seed(N // 2, 0)): 2})
    want += Counter({(i, seed(i, 0)): 1 for i in range(16)})
    assert calls == want


def test_verify_and_the_reader_name_a_damaged_view_shard(tmp_path, dask_client):
    store = featstore.open_store(tmp_path / "store")
    v = compute(store, dask_client)
    bad = f"{view_path(1)}/{stored(v).chunk_key('logits', 1)}"
    path = tmp_path / "store" / stored(v).key / bad
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    problems = v.verify()
    assert len(problems) == 1 and problems[0].startswith(bad)
    assert v.view(0).load()["logits"].shape == (N, 5)  # the other views are intact
    with pytest.raises(featstore.CorruptChunk) as info:
        epochs(v.dataset(batch_size=16, view=1), 0, range(1))
    assert info.value.chunk == bad


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_each_view_reads_its_own_objects_through_the_memory_cache(versions, kind):
    # one shared cache per version: entries are per (view, shard), so view 1 never gets view 0's
    v = versions[kind]
    try:
        for view in (0, 1, 0):
            ds = v.dataset(batch_size=N, shuffle=False, view=view, cache="memory", cache_bytes=2**24)
            (batch,) = epochs(ds, 0, range(1))[0]
            want = v.view(view).load()
            assert torch.equal(batch["index"], want["index"]) and set(batch["view"].tolist()) == {view}
            for name in ("logits", "features", "seen"):
                assert torch.equal(batch[name], want[name]), (view, name)
        assert not torch.equal(v.view(0).load()["seen"], v.view(1).load()["seen"])
    finally:
        ds.clear_cache()


def test_views_and_extends_are_refused_together(tmp_path, dask_client):
    store = featstore.open_store(tmp_path / "store")
    plain = store.compute("tiny/views", model=TinyA(), dataset=VectorData(2 * SPP), keep=["target"],
                          outputs=OUT, samples_per_shard=SPP, client=dask_client,
                          options=ComputeOptions(progress=False))
    with pytest.raises(InvalidInput, match="not supported yet"):
        compute(store, dask_client, extends=plain.ref)
    with_views = compute(store, dask_client, data=VectorData(2 * SPP))
    with pytest.raises(InvalidInput, match="not supported yet"):
        store.compute("tiny/views", model=TinyA(), dataset=VectorData(N), keep=["target"], outputs=OUT,
                      client=dask_client, extends=with_views.ref, options=ComputeOptions(progress=False))
    assert {v.id for v in store.versions("tiny/views")} == {plain.id, with_views.id}  # nothing else committed


def test_view_receipts_compact_into_runs_and_a_resume_reads_them(tmp_path, dask_client, monkeypatch):
    import featstore.versions._receipts

    monkeypatch.setattr(featstore.versions._receipts, "RUN_EVERY", 2)  # the driver folds receipts as tasks finish
    store = featstore.open_store(tmp_path / "store")
    first = compute(store, dask_client, model_id="tiny-a", shards_per_task=3)
    runs = {view: [n for n in store.storage.list_dirs(f"{view_key(stored(first).key, view)}/_receipts")
                   if n.startswith("run-")] for view in range(K)}
    assert all(names == ["run-000000-000002.json"] for names in runs.values()), runs  # one task per view
    view = next(v for v, names in runs.items() if names)
    shard = int(runs[view][0].split("-")[1])
    store.storage.delete(f"{stored(first).key}/manifest.json")
    forget_receipts(store.storage, view_key(stored(first).key, view), [shard])  # the run keeps the others
    log = tmp_path / "forwards.log"
    again = compute(store, dask_client, model=CountingA(str(log)), model_id="tiny-a", shards_per_task=3)
    rows = [int(x) for x in log.read_text().split()]
    assert sum(rows) - rows[0] == min(SPP, N - shard * SPP)  # that one (view, shard) unit, after the probe
    assert again.id == first.id and again.verify() == []
