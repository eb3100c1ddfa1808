"""Incremental versions: a grown dataset computes only its new samples and references the
parent's shards; reading, verify, resume, tags, DataLoader sharding and delete/gc work across
the boundary, on local disk and S3."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import zarr
from torch.utils.data import DataLoader

from featstore.versions import stored
from featstore import DatasetMismatch, InvalidInput

from tests.helpers import QUIET
from tests.models import GrowingData, Tile, TinyA
from tests.servers import ALL_STORES

SPP = 32
OUT = {"features": "float32", "logits": "float16"}


def run(store, n, client, extends=None, name="grow/set", model=None, seed=0, **kw):
    return store.compute(name, model=model or TinyA(), dataset=GrowingData(n, seed=seed), keep=["target"],
                         outputs=OUT, batch_size=16, samples_per_shard=SPP, client=client, options=QUIET,
                         extends=extends, **kw)


def objects_under(store, key):
    return [k for k in store.storage.find(key)]


#: A shard object's key below its version folder: ``<array>/c/<shard>`` (1-D arrays) or
#: ``<array>/c/<shard>/0...`` (one more index per further dimension).
SHARD_KEY = re.compile(r"(?P<array>.+)/c/(?P<shard>\d+)(?:/\d+)*")


def shards_in(store, vkey) -> dict[str, set[int]]:
    """The shard indices whose objects lie in the version folder ``vkey``, by array."""
    out: dict[str, set[int]] = {}
    for k in objects_under(store, vkey):
        m = SHARD_KEY.fullmatch(k[len(vkey) + 1:])
        if m:
            out.setdefault(m["array"], set()).add(int(m["shard"]))
    return out


def test_extends_computes_only_new_samples_and_shares_the_parent_shards(store, dask_client):
    parent = run(store, 100, dask_client)  # shards 0-2 full, shard 3 partial (4 rows)
    store.tag(parent, "v1")
    child = run(store, 170, dask_client, extends=f"{parent.name}@v1")
    m = child.manifest
    assert [(b.id, b.first, b.stop) for b in m.bases] == [(parent.id, 0, 3)]
    # Only the parent's partial shard and the new ones were computed; no parent shard was copied:
    # every array's folder holds exactly shards 3-5 (1-D arrays too, whose keys end in /c/N).
    assert m.timings["shards_computed"] == 6 - 3 and child.id != parent.id
    assert shards_in(store, stored(child).key) == {a: {3, 4, 5} for a in m.arrays}
    got, want = child.load(), parent.load()
    for k in want:  # the shared range is the parent's stored bytes
        torch.testing.assert_close(got[k][:96], want[k][:96], rtol=0, atol=0)
    fresh = run(store, 170, dask_client, name="grow/fresh").load()
    for k in fresh:  # the rest equals a from-scratch compute (floats across processes: a tolerance)
        torch.testing.assert_close(got[k].float(), fresh[k].float(), rtol=1e-3, atol=1e-3)
    assert child.verify() == [] and child[95]["index"] == 95 and child[90:100]["features"].shape == (10, 8)
    assert m.stats["features"]["count"] == 170 * 8  # statistics of the whole child
    store.tag(child, "latest")
    seen = torch.cat([b["index"] for b in DataLoader(store.open("grow/set@latest").dataset(batch_size=7, seed=1),
                                                       batch_size=None, num_workers=2)])
    assert sorted(seen.tolist()) == list(range(170))
    per_rank = [child.dataset(batch_size=8, seed=2, rank=r, world_size=3).plan(w, 2).n_samples
                for r in range(3) for w in range(2)]
    assert len(set(per_rank)) == 1 and sum(per_rank) >= 170


@pytest.mark.parametrize("store", ALL_STORES, indirect=True)
def test_deleting_or_gcing_the_parent_never_breaks_the_child(store, dask_client):
    parent = run(store, 96, dask_client)
    child = run(store, 140, dask_client, extends=parent)
    grandchild = run(store, 200, dask_client, extends=child)
    assert [(b.id, b.first, b.stop) for b in grandchild.manifest.bases] == [(parent.id, 0, 3), (child.id, 3, 4)]
    before = grandchild.load()
    store.delete(parent)
    # A leftover of a killed writer beside a committed version: the one thing gc may remove (and
    # must: so its answer cannot be right by being empty). The parent's shards the others read stay.
    leftover = f"{stored(grandchild).key}/features/c/0/.0.partial"
    store.storage.write_bytes(leftover, b"half a shard")
    assert store.gc(older_than=0) == [leftover]
    assert [v.id for v in store.versions("grow/set")] == [child.id, grandchild.id]
    assert store.open(child.ref).verify() == [] and store.open(grandchild.ref).verify() == []
    store.delete(child)
    store.gc(older_than=0)
    g = store.open(grandchild.ref)
    assert g.verify() == []
    for k, t in g.load().items():
        torch.testing.assert_close(t, before[k], rtol=0, atol=0)
    store.delete(grandchild)  # the last reference: the shared shards go with it
    assert objects_under(store, "grow/set/_versions") == []


def test_plain_zarr_never_reads_a_childs_inherited_shards_as_zeros(local_store, dask_client):
    import zarr

    from featstore import InvalidInput

    parent = run(local_store, 100, dask_client)
    child = run(local_store, 170, dask_client, extends=parent.ref)
    # the parent is a whole Zarr group; the child's folder lacks the inherited shards, so its
    # arrays declare a chunk key encoding plain Zarr refuses, instead of reading those as zeros
    plain = zarr.open_group(stored(parent).storage.zarr_store(stored(parent).key, read_only=True), mode="r")
    np.testing.assert_array_equal(plain["features"][:], stored(parent).read_rows("features", 0, 100))
    folder = zarr.open_group(stored(child).storage.zarr_store(stored(child).key, read_only=True), mode="r")
    with pytest.raises(ValueError, match="chunk key encoding"):
        folder["features"][:]
    with pytest.raises(InvalidInput, match="extends"):
        child.zarr_store()
    torch.testing.assert_close(child[:100]["features"], parent[:]["features"], rtol=0, atol=0)


def test_deleting_the_child_keeps_a_committed_parent_whole(local_store, dask_client):
    parent = run(local_store, 96, dask_client)
    child = run(local_store, 130, dask_client, extends=parent.ref)
    local_store.delete(child)
    assert local_store.open(parent.ref).verify() == []
    assert objects_under(local_store, stored(child).key) == []


def test_extends_refuses_a_dataset_that_does_not_start_with_the_parent(local_store, dask_client):
    parent = run(local_store, 64, dask_client)
    with pytest.raises(DatasetMismatch, match="first 64 samples"):
        run(local_store, 100, dask_client, extends=parent.ref, seed=1)
    with pytest.raises(DatasetMismatch, match="model"):
        run(local_store, 100, dask_client, extends=parent.ref, model=TinyA(seed=3))
    with pytest.raises(ValueError, match="nothing to add"):
        run(local_store, 64, dask_client, extends=parent.ref)
    assert [v.id for v in local_store.versions("grow/set")] == [parent.id]


def test_a_child_resumes_without_recomputing_the_parent(local_store, dask_client):
    parent = run(local_store, 96, dask_client)
    child = run(local_store, 160, dask_client, extends=parent.ref)
    local_store.storage.delete(f"{stored(child).key}/manifest.json")  # as if killed right before the commit
    again = run(local_store, 160, dask_client, extends=parent.ref)
    assert again.id == child.id and again.manifest.timings["shards_computed"] == 0
    assert again.verify() == [] and np.array_equal(again.load()["features"], child.load()["features"])


def test_samples_per_shard_is_kept_as_given_and_extends_accepts_the_parents_value(local_store, dask_client):
    """500 rows per shard of ~4 KiB rows: the inner chunk (~1 MiB: 256 rows) does not divide 500,
    so featstore picks 250-row chunks instead of storing 512-row shards (issue 20)."""
    wide = dict(model=Tile(85), keep=["target"], outputs={"features": "float32"}, batch_size=100,
                samples_per_shard=500, client=dask_client, options=QUIET)
    parent = local_store.compute("wide/set", dataset=GrowingData(1000), **wide)
    assert (parent.manifest.layout.samples_per_shard, parent.manifest.layout.chunk_rows) == (500, 250)
    stored = zarr.open_array(parent.zarr_store(), path="features", mode="r")
    assert stored.shards == (500, 1020) and stored.chunks == (250, 1020)
    child = local_store.compute("wide/set", dataset=GrowingData(1200), extends=parent, **wide)
    assert child.manifest.layout.samples_per_shard == 500
    assert [(b.id, b.first, b.stop) for b in child.manifest.bases] == [(parent.id, 0, 2)]
    assert child.manifest.timings["shards_computed"] == 1 and child.verify() == []
    torch.testing.assert_close(child.load()["features"][:1000], parent.load()["features"], rtol=0, atol=0)
    with pytest.raises(InvalidInput, match="keeps the parent's 500 samples per shard"):
        local_store.compute("wide/set", dataset=GrowingData(1200), extends=parent, **{**wide, "samples_per_shard": 512})
