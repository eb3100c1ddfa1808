"""A version holds exactly what it claims (issue 42): each sample's input digest is stored, a
rerun compares every item with it and recomputes only the shards whose items changed, and a
reader joining the user's items checks each one against the digest of its row."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import featstore
from featstore import ComputeOptions, Tokens
from featstore.compute import _content
from featstore.errors import FingerprintWarning, SourceMismatch
from featstore.ragged import attention_mask, pad_sequences
from featstore.versions import DIGEST_FIELD, item_digest, stored
from featstore.versions._fingerprints import sample_positions

from tests.helpers import QUIET, GrowingData, TinyA, TinyLM, TokenSeqs, VectorData, assert_close_across_processes
from tests.models import EditedAt

N, SPP = 100, 16  # 7 shards; item 50 (shard 3) is not one of the 16 sampled positions
EDITED = 50
TOKENS = Tokens(mask=attention_mask, max_tokens=12)
DATA = Path(__file__).parents[1] / "data"


def hf_vectors(n: int = N) -> object:
    """VectorData(n) as a Hugging Face ``datasets.Dataset`` (torch format)."""
    import datasets

    v = VectorData(n)
    return datasets.Dataset.from_dict({"input": v.x.tolist(), "target": v.y.tolist()}).with_format("torch")


def hf_edited(n: int = N) -> object:
    import datasets

    v = VectorData(n)
    x = v.x.clone()
    x[EDITED] += 0.5
    return datasets.Dataset.from_dict({"input": x.tolist(), "target": v.y.tolist()}).with_format("torch")


#: kind -> (dataset, the same with item EDITED changed, compute keywords)
KINDS = {
    "tensors": (lambda: VectorData(N), lambda: EditedAt(VectorData(N), EDITED),
                dict(model=TinyA(), keep=["target"], outputs={"features": "float16", "logits": "float32"})),
    "token-lists": (lambda: TokenSeqs(N), lambda: EditedAt(TokenSeqs(N), EDITED),
                    dict(model=TinyLM(), keep=["target"], outputs={"logits": "float16"}, tokens=TOKENS,
                         options=ComputeOptions(progress=False, collate=pad_sequences))),
    "hf-datasets": (hf_vectors, hf_edited,
                    dict(model=TinyA(), keep=["target"], outputs={"features": "float16", "logits": "float32"})),
    "opaque": (lambda: GrowingData(N), lambda: EditedAt(GrowingData(N), EDITED),
               dict(model=TinyA(), keep=["target"], outputs={"features": "float16", "logits": "float32"})),
}


def _compute(store, data, client="in-process", **kw):
    kw.setdefault("options", QUIET)
    return store.compute("c/set", dataset=data, samples_per_shard=SPP, batch_size=16, client=client, **kw)


def _same_rows(got, want) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        if want[k].is_floating_point():
            assert_close_across_processes(got[k].float(), want[k].float())
        else:
            assert torch.equal(got[k], want[k]), k


def test_the_edited_item_is_not_a_sampled_one():
    assert EDITED not in sample_positions(N)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_changed_item_recomputes_only_its_shard(kind, tmp_path):
    make, edited, kw = KINDS[kind]
    store = featstore.open_store(tmp_path / "store")
    v = _compute(store, make(), **kw)
    assert DIGEST_FIELD in v.manifest.arrays and v.manifest.content is not None
    assert v.report.computed and v.report.check == "none"

    again = _compute(store, make(), **kw)  # unchanged: the stored version, nothing computed
    assert again.id == v.id and not again.report.computed
    assert again.report.check == ("dataset fingerprint" if kind == "hf-datasets" else "digests")
    assert again.report.items_changed in (0, None)

    new = _compute(store, edited(), **kw)
    assert new.id != v.id and new.report.computed
    assert new.report.items_changed == 1 and new.report.first_changed == (EDITED,)
    assert new.report.shards_computed == 1 == new.manifest.timings["shards_computed"]
    assert new.report.shards_reused == v.manifest.layout.n_shards - 1 and new.report.reused_from == v.ref
    assert new.verify() == []
    fresh = _compute(featstore.open_store(tmp_path / "fresh"), edited(), **kw)
    _same_rows(new.load(), fresh.load())
    assert new.manifest.content == fresh.manifest.content  # the same items, the same content digest
    # the reader's own path through the referenced shards (per-token rows too) gives the same rows
    read = list(store.dataset(new.ref, batch_size=16, shuffle=False))
    assert torch.cat([b["index"] for b in read]).tolist() == list(range(N))
    assert torch.equal(torch.cat([b["logits"] for b in read]), new.load()["logits"])
    assert not torch.equal(new[EDITED:EDITED + 1]["logits"], v[EDITED:EDITED + 1]["logits"])

    rerun = _compute(store, edited(), **kw)  # those very items again: found, nothing computed
    assert rerun.id == new.id and not rerun.report.computed
    back = _compute(store, make(), **kw)  # and the original items give the original version
    assert back.id == v.id and not back.report.computed


def test_the_check_runs_on_the_dask_cluster_when_reading_every_item_here_would_be_slow(tmp_path, dask_client,
                                                                                      monkeypatch):
    from distributed import get_task_stream

    store = featstore.open_store(tmp_path / "store")
    kw = KINDS["opaque"][2]
    v = _compute(store, GrowingData(N), client=dask_client, **kw)
    monkeypatch.setattr(_content, "IN_PROCESS_S", 0.0)  # every dataset counts as slow to read here
    with get_task_stream(dask_client) as stream:
        again = _compute(store, GrowingData(N), client=dask_client, **kw)
    assert again.id == v.id and not again.report.computed and again.report.items_checked == N
    checks = [t["key"] for t in stream.data if "featstore-check" in str(t["key"])]
    assert len(checks) == v.manifest.layout.n_shards  # one task per shard, none of them Model A's
    assert not [t for t in stream.data if "featstore-shards" in str(t["key"])]
    new = _compute(store, EditedAt(GrowingData(N), EDITED), client=dask_client, **kw)
    assert new.report.shards_computed == 1 and new.report.first_changed == (EDITED,)
    _same_rows(new.load(), _compute(featstore.open_store(tmp_path / "fresh"),
                                    EditedAt(GrowingData(N), EDITED), **kw).load())


def test_a_sampled_item_changed_reuses_the_other_shards_of_the_newest_version(tmp_path):
    store = featstore.open_store(tmp_path / "store")
    kw = KINDS["tensors"][2]
    v = _compute(store, VectorData(N), **kw)
    new = _compute(store, EditedAt(VectorData(N), 0), **kw)  # item 0 is sampled: another sampled id
    assert new.id != v.id and new.report.shards_computed == 1 and new.report.first_changed == (0,)
    assert [(b.id, b.first, b.stop) for b in new.manifest.bases] == [(v.id, 1, 7)]
    twice = _compute(store, EditedAt(EditedAt(VectorData(N), 0), EDITED), **kw)  # from the newest donor
    assert twice.report.reused_from == new.ref and twice.report.shards_computed == 1
    # shard 3 from the first version, shard 0 from the second: each where it is stored
    homes = {(b.id, b.first, b.stop) for b in twice.manifest.bases}
    assert homes == {(v.id, 1, 3), (v.id, 4, 7), (new.id, 0, 1)}
    _same_rows(twice.load(), _compute(featstore.open_store(tmp_path / "fresh"),
                                      EditedAt(EditedAt(VectorData(N), 0), EDITED), **kw).load())
    store.delete(v)  # the versions that reuse its shards keep them
    assert store.open(twice.ref).verify() == [] and store.open(new.ref).verify() == []


def test_a_dataset_id_vouches_for_the_content_and_skips_the_check(tmp_path):
    store = featstore.open_store(tmp_path / "store")
    kw = dict(KINDS["tensors"][2], options=ComputeOptions(progress=False, dataset_id="vectors-v1"))
    v = _compute(store, VectorData(N), **kw)
    again = _compute(store, EditedAt(VectorData(N), EDITED), **kw)
    assert again.id == v.id and again.report.check == "dataset_id" and again.report.items_checked == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_a_reader_joining_a_changed_item_names_it(tmp_path, workers):
    store = featstore.open_store(tmp_path / "store")
    v = _compute(store, VectorData(N), **KINDS["tensors"][2])
    ok = store.dataset(v.ref, source=VectorData(N), batch_size=10)
    assert sorted(torch.cat([b["index"] for b in DataLoader(ok, batch_size=None, num_workers=workers)]).tolist()) \
        == list(range(N))
    ds = store.dataset(v.ref, source=EditedAt(VectorData(N), EDITED), batch_size=10)
    with pytest.raises(SourceMismatch, match=f"item {EDITED} of source") as err:
        list(DataLoader(ds, batch_size=None, num_workers=workers))
    assert err.value.index == EDITED


def test_a_changed_sampled_item_is_named_before_any_batch(tmp_path):
    store = featstore.open_store(tmp_path / "store")
    v = _compute(store, VectorData(N), **KINDS["tensors"][2])
    with pytest.raises(SourceMismatch, match="item 7 of source") as err:
        store.dataset(v.ref, source=EditedAt(VectorData(N), 7))
    assert err.value.index == 7


def test_digests_are_of_the_items_as_the_dataset_gives_them(tmp_path):
    store = featstore.open_store(tmp_path / "store")
    data = VectorData(N)
    v = _compute(store, data, **KINDS["tensors"][2])
    got = stored(v).read_rows(DIGEST_FIELD, 0, N)
    assert got.shape == (N, 16) and got.dtype == np.uint8
    assert [bytes(r) for r in got] == [item_digest(data[i]) for i in range(N)]
    assert DIGEST_FIELD not in v[0:3] and DIGEST_FIELD not in next(iter(v.dataset(batch_size=8)))


def test_a_fill_resumed_on_a_changed_dataset_refuses_the_stored_rows(tmp_path):
    store = featstore.open_store(tmp_path / "store")
    teacher = featstore.Teacher(model=TinyA(), dataset=VectorData(N), keep=["target"], samples_per_shard=SPP,
                                batch_size=16, outputs={"features": "float16", "logits": "float32"}, fill=True,
                                options=QUIET)
    ds = store.dataset("c/set", batch_size=10, teacher=teacher)
    assert sorted(torch.cat([b["index"] for b in ds]).tolist()) == list(range(N))
    assert ds.committed() is not None
    edited = featstore.Teacher(model=TinyA(), dataset=EditedAt(VectorData(N), EDITED), keep=["target"],
                               samples_per_shard=SPP, batch_size=16, fill=True, options=QUIET,
                               outputs={"features": "float16", "logits": "float32"})
    with pytest.raises(SourceMismatch, match=f"item {EDITED} of source"):
        list(store.dataset("c/set", batch_size=10, teacher=edited))


# -- a store written before per-sample digests ---------------------------------------------------
@pytest.fixture
def sampled_store(tmp_path):
    shutil.copytree(DATA / "store-sampled", tmp_path / "store")
    return featstore.open_store(tmp_path / "store"), json.loads((DATA / "store-sampled-ids.json").read_text())


def test_a_store_from_before_digests_reads_and_its_reruns_keep_the_sampled_identity(sampled_store):
    store, ids = sampled_store
    v = store.open("sampled/tiny")
    assert v.id == ids["sampled/tiny"] and DIGEST_FIELD not in v.manifest.arrays and v.verify() == []
    with torch.inference_mode():
        want = TinyA()(VectorData(100).x)
    assert_close_across_processes(v.load()["logits"], want["logits"])
    kw = dict(model=TinyA(), keep=["target"], outputs={"features": "float16", "logits": "float32"},
              samples_per_shard=16, options=QUIET, client="in-process")
    with pytest.warns(FingerprintWarning, match="before featstore stored each sample's input digest"):
        again = store.compute("sampled/tiny", dataset=VectorData(100), **kw)
    assert again.id == v.id and not again.report.computed and again.report.check == "sampled"
    with pytest.warns(FingerprintWarning):  # as documented: 16 sampled items identify it, an edit elsewhere is not seen
        edited = store.compute("sampled/tiny", dataset=EditedAt(VectorData(100), EDITED), **kw)
    assert edited.id == v.id and not edited.report.computed
    ds = store.dataset(v.ref, source=EditedAt(VectorData(100), EDITED), batch_size=10)  # sampled check only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(torch.cat([b["index"] for b in ds])) == 100


def test_the_command_line_says_how_many_items_changed(tmp_path, capsys):
    from featstore.cli import main

    argv = ["compute", str(tmp_path / "store"), "c/cli", "--model", "tests.cli_factories:small_model", "--dataset",
            "tests.cli_factories:small_dataset", "--outputs", "features=float16", "--scheduler", "in-process",
            "--no-progress"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert first.startswith("committed c/cli@") and "nothing to compare with;" in first and ", 0 reused" in first
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["report"]
    assert report["computed"] is False and report["check"] == "digests"
    assert (report["items_checked"], report["items_changed"], report["shards_computed"]) == (1200, 0, 0)
    assert main(argv) == 0
    again = capsys.readouterr().out
    assert again.startswith("found c/cli@") and "0 of 1200 items changed; 0 shards computed" in again


def test_a_fill_resumed_on_an_edited_item_refuses_the_shard_stored_before(tmp_path):
    store = featstore.open_store(tmp_path / "store")

    def teacher(data):
        return featstore.Teacher(model=TinyA(), dataset=data, keep=["target"], samples_per_shard=SPP, batch_size=16,
                                 outputs={"features": "float16", "logits": "float32"}, fill=True, options=QUIET)

    ds = store.dataset("c/set", batch_size=10, shuffle=False, teacher=teacher(VectorData(N)))
    for i, _ in enumerate(ds):  # the epoch abandoned after rows 0-59: shards 0-3 computed and stored
        if i == 5:
            break
    assert ds.committed() is None
    resumed = store.dataset("c/set", batch_size=10, shuffle=False, teacher=teacher(EditedAt(VectorData(N), EDITED)))
    with pytest.raises(SourceMismatch, match=f"item {EDITED} of the teacher's dataset") as err:
        list(resumed)
    assert err.value.index == EDITED
