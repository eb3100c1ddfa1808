"""Per-token outputs (tokens=) with the teacher in the loop: online batches are the stored
version's, key for key (flat and padded, shuffled or not, 0 and 2 DataLoader workers, resumed
mid-epoch), and a fill commits the version store.compute commits (manifest, receipts and every
stored object), which a later store.dataset(name) reads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import featstore
from featstore import ComputeOptions, FeatureDataset, Teacher, Tokens
from featstore.ragged import attention_mask, pad_sequences
from featstore.versions import stored

from ..models import X_MAX, TinyLM, TokenSeqs, check_exact, drop_a_token, on_grid

N, MAX_TOKENS = 100, 12
ARGS = dict(keep=["target"], outputs={"logits": "topk:5", "hidden": "float16", "last": "float32"}, batch_size=8,
            samples_per_shard=16, options=ComputeOptions(progress=False, collate=pad_sequences),
            tokens=Tokens(mask=attention_mask, max_tokens=MAX_TOKENS, outputs=["logits", "hidden"]))


class GridLM(torch.nn.Module):
    """TinyLM's embedding and head, computed exactly (on-grid weights, a plain cumulative sum):
    per-token logits (sparse ``topk:5``) and hidden states (dense), and a per-sample head (the
    last real token's logits), the same bits in every process (tests/models.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TinyLM()
        with torch.no_grad():
            for p in self.lm.parameters():
                p.copy_(on_grid(p.clamp(-X_MAX, X_MAX)))
        check_exact([self.lm.head], X_MAX * MAX_TOKENS)  # |hidden| <= MAX_TOKENS * X_MAX

    def forward(self, x):
        hidden = self.lm.emb(x["ids"]).cumsum(1)  # causal: padding never changes a real token's rows
        logits = self.lm.head(hidden)
        last = x["attention_mask"].sum(1) - 1
        return {"logits": logits, "hidden": hidden, "last": logits[torch.arange(len(logits)), last]}


def teacher(**kw) -> Teacher:
    return Teacher(model=GridLM(), dataset=TokenSeqs(N, hi=MAX_TOKENS), **{**ARGS, **kw})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """What store.compute commits for the teacher's arguments."""
    store = featstore.open_store(tmp_path_factory.mktemp("tokens") / "store")
    t = teacher()
    return store, store.compute("lm/ref", model=t.model, dataset=t.dataset, client="in-process", **ARGS)


def epoch(ds, workers):
    return list(DataLoader(ds, batch_size=None, num_workers=workers, timeout=120 if workers else 0))


def assert_same_batches(got, want):
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        assert sorted(g) == sorted(w)
        for k in w:  # GridLM computes exactly: the same bits in any process
            assert g[k].dtype == w[k].dtype and torch.equal(g[k], w[k]), k


def files(store):
    return sorted(Path(store.storage.root).rglob("*"))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("ragged", ["flat", "padded"])
def test_online_token_batches_equal_stored_batches(reference, ragged, shuffle, workers):
    store, version = reference
    before = files(store)
    kw = dict(batch_size=10, seed=1, shuffle=shuffle, ragged=ragged)
    online = store.dataset("lm/ref", teacher=teacher(), **kw)
    assert online.online and online.version.id == version.id
    plain = version.dataset(**kw)
    for e in (0, 1):  # another epoch: another order (with shuffle), the same batches
        online.set_epoch(e)
        plain.set_epoch(e)
        got = epoch(online, workers)
        assert_same_batches(got, epoch(plain, workers))
        per_token = ("offsets", "offsets") if ragged == "flat" else ("lengths", "lengths")
        assert {"logits.ids", "logits.values", f"logits.{per_token[0]}", "hidden", f"hidden.{per_token[1]}",
                "last", "target", "index"} == set(got[0])
        assert sorted(torch.cat([b["index"] for b in got]).tolist()) == list(range(N))
    b = got[0]
    if ragged == "flat":  # each sample's real tokens, sample after sample
        assert len(b["hidden"]) == int(b["hidden.offsets"][-1]) > len(b["index"])
    else:
        assert b["hidden"].shape[:2] == (len(b["index"]), int(b["hidden.lengths"].max()))
    assert files(store) == before  # online mode writes nothing


@pytest.mark.parametrize("workers", [0, 2])
def test_online_tokens_resume_mid_epoch_from_state_dict(reference, workers):
    store, version = reference
    kw = dict(batch_size=10, seed=7, ragged="padded")
    full = epoch(version.dataset(**kw), workers)
    state = store.dataset("lm/ref", teacher=teacher(), **kw).state_dict(batches_seen=4, num_workers=workers)
    resumed = store.dataset("lm/ref", teacher=teacher(), **kw)
    resumed.load_state_dict(state)
    assert_same_batches(epoch(resumed, workers), full[4:])  # the rest of the stored version's epoch


# -- fill -----------------------------------------------------------------------------------------
def stored_objects(version) -> dict[str, bytes]:
    """Every object of a committed version but its manifest, by its key under the version."""
    v = stored(version)
    return {k.removeprefix(v.key): v.storage.read_bytes(k) for k in v.storage.find(v.key)
            if not k.endswith("manifest.json")}


def receipt_files(store):
    root = Path(store.storage.root)
    return {k: (root / k).stat().st_mtime_ns for k in store.storage.find("lm/ref") if "/_receipts/" in k}


def assert_is_reference(version, reference):
    """The filled version is compute's: its manifest (but how long it took), its receipts (digests
    and statistics), every object it stored, and its values."""
    got, want = stored(version).manifest, stored(reference).manifest
    assert dataclasses.replace(got, timings={}, created_at="") == dataclasses.replace(want, timings={}, created_at="")
    assert stored(version).shard_receipts() == stored(reference).shard_receipts()
    objects, expected = stored_objects(version), stored_objects(reference)
    assert all(any(k.endswith(f"/{a}/zarr.json") for k in expected) for a in want.arrays)  # (of each view)
    assert sorted(objects) == sorted(expected) and objects == expected
    assert version.verify() == []


def open_store(kind, request, path):
    """A fresh store on local disk, or in a fresh bucket of the moto S3 server."""
    if kind == "local":
        return featstore.open_store(path)
    from ..servers import new_bucket

    endpoint = request.getfixturevalue("moto_endpoint")
    return featstore.open_store(f"s3://{new_bucket(endpoint)}/feats", {"endpoint_url": endpoint})


@pytest.mark.parametrize(("kind", "workers"), [("local", 0), ("local", 2), ("moto", 0)])
def test_fill_with_tokens_commits_what_compute_commits_then_reads_it(reference, kind, workers, request, tmp_path):
    store = open_store(kind, request, tmp_path / "store")
    if kind == "local":
        ref = reference[1]
    else:  # "auto" compression is chosen per store kind: compute's objects on the same kind
        t = teacher()
        ref = open_store(kind, request, tmp_path / "ref").compute("lm/ref", model=t.model, dataset=t.dataset,
                                                                   client="in-process", **ARGS)
    kw = dict(batch_size=10, seed=1, ragged="padded")
    ds = store.dataset("lm/ref", teacher=teacher(fill=True), **kw)
    assert ds.online and ds.committed() is None
    assert_same_batches(epoch(ds, workers), epoch(ref.dataset(**kw), workers))
    committed = ds.committed()
    assert committed is not None
    assert_is_reference(committed, ref)
    ds.set_epoch(1)  # later epochs read what is stored: still the reference's batches
    plain = ref.dataset(**kw)
    plain.set_epoch(1)
    assert_same_batches(epoch(ds, workers), epoch(plain, workers))
    later = store.dataset("lm/ref", **kw)  # a later run reads it by name
    assert type(later) is FeatureDataset and later.version == committed
    assert_same_batches(epoch(later, 0), epoch(ref.dataset(**kw), 0))


def test_fill_with_tokens_resumed_mid_epoch_reads_the_shards_it_stored(reference, tmp_path):
    _, ref = reference
    store = featstore.open_store(tmp_path / "store")
    full = epoch(ref.dataset(batch_size=10, seed=3), 0)
    ds = store.dataset("lm/ref", batch_size=10, seed=3, teacher=teacher(fill=True))
    it = iter(ds)
    for _ in range(3):  # the first window's shards are computed and written
        next(it)
    state = ds.state_dict()
    it.close()
    before = receipt_files(store)
    assert 0 < len(before) < ref.manifest.layout.n_shards and store.versions("lm/ref") == []
    resumed = store.dataset("lm/ref", batch_size=10, seed=3, teacher=teacher(fill=True))
    resumed.load_state_dict(state)
    assert_same_batches(list(resumed), full[3:])  # the stored shards' token rows read, the rest computed
    after = receipt_files(store)
    assert all(after[k] == mtime for k, mtime in before.items())  # the stored shards were read, not rewritten
    assert_is_reference(resumed.committed(), ref)


def test_fill_with_tokens_and_views_fills_one_view_per_epoch(tmp_path):
    # a view changes a sample's length (one token dropped): its token rows, starts and lengths
    views = featstore.Views(k=2, augment=drop_a_token, seed=5)
    t = teacher(views=views)
    ref = featstore.open_store(tmp_path / "ref").compute("lm/views", model=t.model, dataset=t.dataset, views=views,
                                                         client="in-process", **ARGS)
    store = featstore.open_store(tmp_path / "store")
    ds = store.dataset("lm/views", batch_size=10, seed=2, teacher=teacher(views=views, fill=True))
    plain = ref.dataset(batch_size=10, seed=2)
    seen = set()
    for e in (0, 1):  # one view per epoch
        assert ds.committed() is None
        ds.set_epoch(e)
        plain.set_epoch(e)
        got = epoch(ds, 0)
        assert_same_batches(got, epoch(plain, 0))
        seen |= {int(v) for b in got for v in b["view"]}
    assert seen == {0, 1}
    assert_is_reference(ds.committed(), ref)


def test_advise_measures_a_per_token_teacher_and_leaves_nothing(tmp_path):
    """The advisor's compute measurement carries every keyword of the teacher's request: before,
    it dropped ``tokens=`` and ``store.compute`` refused the per-token outputs (OutputMismatch)."""
    store = featstore.open_store(tmp_path / "store")
    advice = featstore.advise(store, teacher(), featstore.Workload(N, epochs=3), samples=32, batch_size=8)
    c = advice.costs
    assert c.teacher_s > 0 and c.write_s > 0 and c.read_s > 0 and c.compute_fixed_s >= 0
    assert c.bytes_per_sample > 0 and advice.mode in ("online", "compute-then-read", "fill")
    assert store.names() == [] and store.storage.find("") == []  # the scratch versions are gone
