"""Spreading a version's shard objects over several top-level prefixes
(``ComputeOptions(spread_prefixes=N)``), on local disk and S3 (moto): the objects land under N
prefixes, read back exactly like an unspread compute (featstore, the reader, plain Zarr), verify
catches damage, resume, delete, gc, ``extends`` and views all find them."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
import zarr

import featstore
from featstore import ComputeOptions, CorruptChunk, InvalidInput
from featstore.format._keys import SPREAD_FOLDER, logical_key, spread_key, spread_prefix
from featstore.format._manifests import Layout, Manifest
from featstore.versions._keys import receipt_key
from featstore.versions import stored

from tests.augments import noisy_flip
from tests.models import GrowingData, TinyA, VectorData

N, SPP, SPREAD = 96, 16, 4  # 6 shards over 4 prefixes
OUT = {"features": "float16", "logits": "float32"}


def options(spread: int | None = SPREAD, **kw) -> ComputeOptions:
    # One worker thread in this process: fast to start, and the same float bits in every run.
    return ComputeOptions(progress=False, processes=False, n_workers=1, spread_prefixes=spread, **kw)


def compute(store, name="sp/set", spread=SPREAD, data=None, **kw):
    return store.compute(name, model=TinyA(), dataset=data if data is not None else VectorData(N),
                         keep=["target"], outputs=OUT, batch_size=16, samples_per_shard=SPP,
                         options=options(spread), **kw)


def shard_objects(store, version) -> list[str]:
    """Store keys of every shard object of ``version``, wherever it lies."""
    return [k for k in store.storage.find("") if logical_key(k).startswith(f"{stored(version).key}/") and "/c/" in k]


def prefixes(keys) -> Counter:
    return Counter(k.split("/")[1] for k in keys if k.startswith(f"{SPREAD_FOLDER}/"))


# -- pure ---------------------------------------------------------------------------------------
def test_spread_keys_map_only_shard_objects_and_balance_the_prefixes():
    vkey = "a/b/_versions/0123456789abcdef"
    for rel in ("zarr.json", "features/zarr.json", "_receipts/000003.json", "manifest.json", "_views/1/zarr.json"):
        assert spread_key(vkey, rel, 16) == f"{vkey}/{rel}"
    for rel in ("features/c/3/0", "target/c/3", "_views/2/logits/c/7/0/0"):
        key = spread_key(vkey, rel, 16)
        assert key.startswith(f"{SPREAD_FOLDER}/") and logical_key(key) == f"{vkey}/{rel}"
        assert spread_key(vkey, rel, 1) == f"{vkey}/{rel}"
    # every field of a shard in one prefix; the prefixes of a version within one shard of each other
    assert len({spread_key(vkey, f"{f}/c/5/0", 16).split("/")[1] for f in ("features", "logits")}) == 1
    counts = Counter(spread_prefix("0123456789abcdef", None, s, 16) for s in range(100))
    assert len(counts) == 16 and max(counts.values()) - min(counts.values()) <= 1


def test_layout_json_omits_spread_1_and_old_manifests_read_as_unspread():
    assert "spread" not in Layout(10, 5, 5).to_json() and Layout(10, 5, 5, 8).to_json()["spread"] == 8
    assert Layout.from_json({"n_samples": 10, "samples_per_shard": 5, "chunk_rows": 5}).spread == 1
    with pytest.raises(ValueError):
        Layout.from_json({"n_samples": 10, "samples_per_shard": 5, "chunk_rows": 5, "spread": 300})
    for bad in (0, 257, True, 2.0):
        with pytest.raises(InvalidInput, match="spread_prefixes"):
            ComputeOptions(spread_prefixes=bad)


# -- end to end, local and S3 ------------------------------------------------------------------
def test_spread_objects_land_under_several_prefixes_and_read_like_unspread(store, tmp_path):
    v = compute(store)
    plain = compute(featstore.open_store(tmp_path / "plain"), spread=None)
    assert v.id == plain.id and stored(v).spread == SPREAD and stored(plain).spread == 1  # same fingerprint, same id
    objects = shard_objects(store, v)
    n_shards = v.manifest.layout.n_shards
    arrays = len(v.manifest.arrays)  # 3 and the input digests
    assert len(objects) == arrays * n_shards and all(k.startswith(f"{SPREAD_FOLDER}/") for k in objects)
    # 6 shards on 4 prefixes
    assert sorted(prefixes(objects).values()) == [arrays * 1, arrays * 1, arrays * 2, arrays * 2]
    assert {k for k in store.storage.find(stored(v).key) if "/c/" in k} == set()  # none left in the folder
    assert store.storage.read_json(f"{stored(v).key}/manifest.json")["layout"]["spread"] == SPREAD
    got, want = v.load(), plain.load()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(v[10:40]["features"], want["features"][10:40])
    assert torch.equal(v[[95, 0, 17]]["logits"], want["logits"][[95, 0, 17]])
    assert v.verify() == []
    batches = list(store.open(v.ref).dataset(batch_size=10, shuffle=False))
    assert torch.equal(torch.cat([b["features"] for b in batches]), want["features"])
    group = zarr.open_group(v.zarr_store(), mode="r")  # plain Zarr, through the mapping store
    np.testing.assert_array_equal(group["logits"][:], stored(plain).read_rows("logits", 0, N))
    assert sorted(group.array_keys()) == ["features", "item_digest", "logits", "target"]
    # Zarr opening the version's folder itself never reads the shards as fill values (zeros):
    # the arrays declare a chunk key encoding only featstore's mapping store understands
    folder = zarr.open_group(stored(v).storage.zarr_store(stored(v).key, read_only=True), mode="r")
    with pytest.raises(ValueError, match="chunk key encoding"):
        folder["logits"][:]
    meta = store.storage.read_json(f"{stored(v).key}/logits/zarr.json")
    assert meta["chunk_key_encoding"]["name"] == "featstore.mapped"
    meta = stored(plain).storage.read_json(f"{stored(plain).key}/logits/zarr.json")
    assert meta["chunk_key_encoding"]["name"] == "default"


def test_a_flipped_byte_in_a_spread_shard_is_detected(store):
    v = compute(store)
    key = stored(v).object_key("logits", 2)
    assert key.startswith(f"{SPREAD_FOLDER}/") and key in shard_objects(store, v)
    data = bytearray(store.storage.read_bytes(key))
    data[len(data) // 3] ^= 0x20
    store.storage.write_bytes(key, bytes(data))
    problems = v.verify()
    assert len(problems) == 1 and "logits/c/2" in problems[0]
    with pytest.raises(CorruptChunk):
        v[2 * SPP:3 * SPP]
    with pytest.raises(CorruptChunk):
        list(store.open(v.ref).dataset(batch_size=8, shuffle=False))


def test_resume_skips_finished_spread_shards_and_adopts_the_claimed_spread(store):
    v = compute(store)
    want = v.load()
    st = store.storage
    st.delete(f"{stored(v).key}/manifest.json")  # killed before the commit...
    for shard in (4, 5):  # ...with shards 4 and 5 unfinished
        st.delete(receipt_key(stored(v).key, shard))
        for field in ("features", "logits", "target"):
            st.delete(stored(v).object_key(field, shard))
    st.delete(stored(v).object_key("features", 1))  # and shard 1's object gone (gc) though its receipt is there
    again = compute(store, spread=2)  # a resume adopts the claim's spread
    assert stored(again).spread == SPREAD and again.manifest.timings["shards_computed"] == 3
    assert again.verify() == [] and len(shard_objects(store, again)) == 4 * 6  # 3 arrays and the input digests
    got = again.load()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_delete_and_gc_remove_spread_objects_and_never_a_live_versions(store):
    live = compute(store, name="sp/live")
    doomed = compute(store, name="sp/doomed", data=VectorData(48))
    abandoned = compute(store, name="sp/abandoned", data=VectorData(48))
    store.storage.delete(f"{stored(abandoned).key}/manifest.json")  # an interrupted compute, never committed
    assert store.gc(older_than=3600) == []  # too young: may still be resumed
    deleted = store.gc(older_than=0)
    assert any(k.startswith(f"{SPREAD_FOLDER}/") for k in deleted)
    assert all(stored(abandoned).key in logical_key(k) for k in deleted)
    assert shard_objects(store, abandoned) == []
    store.delete(doomed)
    assert shard_objects(store, doomed) == [] and store.storage.find(stored(doomed).key) == []
    assert len(shard_objects(store, live)) == 4 * 6 and store.open(live.ref).verify() == []
    assert store.gc(older_than=0) == []


def test_extends_a_spread_parent(store):
    parent = store.compute("sp/grow", model=TinyA(), dataset=GrowingData(64), keep=["target"], outputs=OUT,
                           batch_size=16, samples_per_shard=SPP, options=options())
    with pytest.raises(InvalidInput, match="spread"):
        store.compute("sp/grow", model=TinyA(), dataset=GrowingData(96), keep=["target"], outputs=OUT,
                      batch_size=16, options=options(spread=2), extends=parent)
    child = store.compute("sp/grow", model=TinyA(), dataset=GrowingData(96), keep=["target"], outputs=OUT,
                          batch_size=16, options=options(spread=None), extends=parent)
    assert stored(child).spread == SPREAD and [b.id for b in child.manifest.bases] == [parent.id]
    # read in the parent's place
    assert stored(child).object_key("features", 0) == stored(parent).object_key("features", 0)
    assert prefixes(shard_objects(store, child)) and child.verify() == []
    want = parent.load()
    store.delete(parent)  # the child keeps the parent's spread shards alive
    got = store.open(child.ref).load()
    assert all(torch.equal(got[k][:64], want[k]) for k in want) and len(got["index"]) == 96
    assert shard_objects(store, parent)
    store.delete(child)  # the last reference: the parent's spread shards go too
    assert [k for k in store.storage.find("") if "/c/" in k] == []


def test_views_of_a_spread_version(local_store, tmp_path):
    kw = dict(model=TinyA(), dataset=VectorData(64), keep=["target"], outputs=OUT, batch_size=16,
              samples_per_shard=SPP, views=featstore.Views(k=2, augment=noisy_flip, seed=3))
    v = local_store.compute("sp/views", options=options(), **kw)
    plain = featstore.open_store(tmp_path / "plain").compute("sp/views", options=options(None), **kw)
    objects = shard_objects(local_store, v)
    assert objects and all(k.startswith(f"{SPREAD_FOLDER}/") and "/_views/" in k for k in objects)
    for view in (0, 1):
        got, want = v.view(view).load(), plain.view(view).load()
        assert all(torch.equal(got[k], want[k]) for k in want)
        group = zarr.open_group(v.view(view).zarr_store(), mode="r")
        np.testing.assert_array_equal(group["features"][:], stored(plain.view(view)).read_rows("features", 0, 64))
    assert v.verify() == []
    local_store.delete(v)
    assert shard_objects(local_store, v) == []


def test_an_unspread_manifest_keeps_its_bytes(local_store):
    v = compute(local_store, spread=1)
    written = local_store.storage.read_json(f"{stored(v).key}/manifest.json")
    assert "spread" not in written["layout"] and "spread" not in local_store.storage.read_json(
        f"{stored(v).key}/_pending.json")["layout"]
    assert Manifest.from_json(written).layout.spread == 1
    assert not any(k.startswith(f"{SPREAD_FOLDER}/") for k in local_store.storage.find(""))
