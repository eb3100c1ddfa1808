"""Fill as you train: the shards an online reader computes become the version store.compute makes
(same id, same shard digests, same values), committed once complete, locally and on S3, under
0 and 2 DataLoader workers, 2 gloo ranks, a real SIGKILL and resume, two racing runs, and views."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

import featstore
from featstore import ComputeOptions, FeatureDataset
from featstore.versions import stored

from .. import fill_child
from ..fill_child import N, fill_teacher
from ..helpers import TinyA, VectorData, noisy_flip, write_version

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """What store.compute commits for the fill's teacher."""
    t = fill_teacher()
    store = featstore.open_store(tmp_path_factory.mktemp("ref") / "store")
    return write_version(store, "fill/ref", model=t.model, dataset=t.dataset, keep=t.keep, outputs=t.outputs,
                         samples_per_shard=t.samples_per_shard, batch_size=t.batch_size, options=t.options)


def epoch(ds, workers):
    return list(DataLoader(ds, batch_size=None, num_workers=workers, timeout=120 if workers else 0))


def assert_same_batches(got, want):
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        assert sorted(g) == sorted(w) and all(torch.equal(g[k], w[k]) for k in w)


def assert_is_reference(version, reference):
    """The filled version is compute's: id, fingerprint, layout, arrays, every shard's digests, values."""
    assert (version.id, version.fingerprint) == (reference.id, reference.fingerprint)
    assert version.manifest.layout == reference.manifest.layout
    # "auto" compression is chosen per store kind (docs: ComputeOptions.compression): compute on an
    # object store would choose as the fill did; the values and their digests do not depend on it
    same_kind = stored(version).storage.is_local == stored(reference).storage.is_local
    plain = lambda arrays: {n: a if same_kind else dataclasses.replace(a, compression="") for n, a in arrays.items()}
    assert plain(version.manifest.arrays) == plain(reference.manifest.arrays)
    digests = [[r.digests for r in stored(x).shard_receipts()] for x in (version, reference)]
    assert digests[0] == digests[1]
    got, want = version.load(), reference.load()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert version.verify() == []


def receipt_files(store, name):
    root = Path(store.storage.root)
    return {k: (root / k).stat().st_mtime_ns for k in store.storage.find(name) if "/_receipts/" in k}


@pytest.mark.parametrize(("kind", "workers"), [("local", 0), ("local", 2), ("moto", 2)])
def test_fill_commits_what_compute_commits_then_reads_it(kind, workers, reference, request, tmp_path):
    if kind == "local":
        store = featstore.open_store(tmp_path / "store")
    else:
        from ..servers import new_bucket

        endpoint = request.getfixturevalue("moto_endpoint")
        store = featstore.open_store(f"s3://{new_bucket(endpoint)}/feats", {"endpoint_url": endpoint})
    ds = store.dataset("fill/a", batch_size=20, seed=1, teacher=fill_teacher())
    assert ds.online and ds.committed() is None
    assert_same_batches(epoch(ds, workers), epoch(reference.dataset(batch_size=20, seed=1), workers))
    committed = ds.committed()
    assert committed is not None
    assert_is_reference(committed, reference)
    ds.set_epoch(1)  # later epochs read the stored version: the same batches as the reference's
    assert_same_batches(epoch(ds, workers), epoch(_at(reference.dataset(batch_size=20, seed=1), 1), workers))
    later = store.dataset("fill/a", batch_size=20, seed=1, teacher=fill_teacher())  # a later run, a second student
    assert type(later) is FeatureDataset and later.version == committed


def _at(ds, e):
    ds.set_epoch(e)
    return ds


def test_fill_under_two_gloo_ranks_commits_one_version(reference, tmp_path):
    store = featstore.open_store(tmp_path / "store")
    mp.spawn(fill_child.rank, args=(2, str(tmp_path / "init"), str(tmp_path / "store"), str(tmp_path)), nprocs=2,
             join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert set(ranks[0]["indices"]) | set(ranks[1]["indices"]) == set(range(N))
    assert [v.id for v in store.versions("fill/ddp")] == [reference.id]
    assert_is_reference(store.open("fill/ddp"), reference)


def child(url, name, pause, seed=1):
    return subprocess.Popen([sys.executable, "-m", "tests.fill_child", url, name, str(seed), str(pause)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_fill_killed_mid_epoch_resumes_reading_what_it_stored(reference, tmp_path):
    url = str(tmp_path / "store")
    proc = child(url, "fill/kill", pause=4)
    try:
        line = proc.stdout.readline()  # after 4 batches: the first window (4 shards) is computed, 2+ of them written
        assert line.startswith("paused"), line
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    state = json.loads(line.split(" ", 1)[1])
    store = featstore.open_store(url)
    before = receipt_files(store, "fill/kill")
    n_shards = reference.manifest.layout.n_shards
    assert 0 < len(before) < n_shards and store.versions("fill/kill") == []
    ds = store.dataset("fill/kill", batch_size=20, seed=1, teacher=fill_teacher())
    ds.load_state_dict(state)
    full = epoch(reference.dataset(batch_size=20, seed=1), 0)
    assert_same_batches(list(ds), full[4:])  # the rest of the epoch, as if never killed
    after = receipt_files(store, "fill/kill")
    assert all(after[k] == mtime for k, mtime in before.items())  # finished shards were read, not rewritten
    assert_is_reference(store.open("fill/kill"), reference)


def test_two_runs_filling_one_fingerprint_commit_one_version(reference, tmp_path):
    url = str(tmp_path / "store")
    procs = [child(url, "fill/race", pause=0, seed=s) for s in (1, 2)]  # two orders, the same version
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs) and all("done 10" in o for o in outs), outs
    store = featstore.open_store(url)
    assert [v.id for v in store.versions("fill/race")] == [reference.id]
    assert_is_reference(store.open("fill/race"), reference)


def test_fill_with_views_fills_one_view_per_epoch(tmp_path):
    store = featstore.open_store(tmp_path / "store")
    t = dataclasses.replace(fill_teacher(), views=featstore.Views(k=2, augment=noisy_flip))
    ds = store.dataset("fill/views", batch_size=50, seed=3, teacher=t)
    seen = {}
    for e in (0, 1):
        assert ds.committed() is None  # a view is still missing
        ds.set_epoch(e)
        for b in epoch(ds, 0):
            seen.update({(int(v), int(i)): row for v, i, row in zip(b["view"], b["index"], b["logits"], strict=True)})
    version = ds.committed()
    assert version is not None and version.views == 2 and version.verify() == []
    assert len(seen) == 2 * N
    for v in range(2):  # what training read is what is stored, and what A gives on the replayed view
        stored = version.view(v).load()["logits"]
        assert all(torch.equal(seen[(v, i)], stored[i]) for i in range(N))
        x = torch.stack([noisy_flip(VectorData(N)[i], torch.Generator().manual_seed(version.view_seed(i, v)))["input"]
                         for i in range(0, N, 37)])
        torch.testing.assert_close(TinyA()(x)["logits"], stored[0:N:37], rtol=1e-5, atol=1e-6)


def test_compute_after_a_fill_returns_the_filled_version(reference, tmp_path):
    store = featstore.open_store(tmp_path / "store")
    ds = store.dataset("fill/b", batch_size=64, seed=0, teacher=fill_teacher())
    epoch(ds, 0)
    t = fill_teacher()
    v = store.compute("fill/b", model=t.model, dataset=t.dataset, keep=t.keep, outputs=t.outputs,
                      samples_per_shard=t.samples_per_shard, batch_size=t.batch_size,
                      options=ComputeOptions(progress=False, chunk_rows=16))
    assert v == ds.committed() and v.manifest.timings == {"filled": 1.0}  # nothing recomputed


def test_a_failed_shard_write_fails_the_epoch_and_commits_nothing(reference, tmp_path, monkeypatch):
    # the writes run on the consumer's writer thread: a write's error must reach the training
    # loop, not be lost with the thread (a disk full or a denied PUT cannot be made on demand here)
    from featstore.online import _reading

    real = _reading.write_shard

    def fails_on_shard_3(spec, arrays, index, buffers, stats):
        if index == 3:
            raise OSError(28, "No space left on device")
        return real(spec, arrays, index, buffers, stats)

    monkeypatch.setattr(_reading, "write_shard", fails_on_shard_3)
    store = featstore.open_store(tmp_path / "store")
    ds = store.dataset("fill/err", batch_size=20, seed=1, teacher=fill_teacher())
    with pytest.raises(OSError, match="No space left"):
        epoch(ds, 0)
    assert store.versions("fill/err") == [] and ds.committed() is None
    monkeypatch.setattr(_reading, "write_shard", real)
    again = store.dataset("fill/err", batch_size=20, seed=1, teacher=fill_teacher())
    assert_same_batches(epoch(again, 0), epoch(reference.dataset(batch_size=20, seed=1), 0))
    assert_is_reference(again.committed(), reference)


def test_an_abandoned_fill_epoch_stores_the_shards_it_computed(reference, tmp_path):
    store = featstore.open_store(tmp_path / "store")
    ds = store.dataset("fill/abandon", batch_size=20, seed=1, teacher=fill_teacher())
    it = iter(ds)
    for _ in range(4):  # the first window's shards are computed and handed to the writer thread
        next(it)
    it.close()  # no write is left pending, and each one written is recorded
    [state] = ds.process_sources()  # the online reader's source: what it computed and wrote
    assert not state.writes._pending
    receipts = receipt_files(store, "fill/abandon")
    n_shards = reference.manifest.layout.n_shards
    assert 0 < len(receipts) == len(state.fill.done[None]) < n_shards and store.versions("fill/abandon") == []
    ds.set_epoch(1)  # the next epoch reads those and computes the rest, then commits
    assert_same_batches(list(ds), epoch(_at(reference.dataset(batch_size=20, seed=1), 1), 0))
    assert_is_reference(ds.committed(), reference)


@pytest.mark.parametrize(("world", "workers"), [(12, 0), (4, 3)])
def test_fill_with_partition_drop_and_no_shuffle_commits_in_the_first_epoch(reference, tmp_path, world, workers):
    # "drop" leaves the last n % consumers positions out of every epoch, and without shuffle the
    # same ones: with 12 consumers, 200 % 12 = 8 rows, the whole of shard 6 (rows 192-199), which
    # no consumer reads. The last consumer stores it, so the fill completes in the first epoch.
    store = featstore.open_store(tmp_path / "store")
    ranks = [store.dataset("fill/drop", batch_size=16, shuffle=False, partition="drop", world_size=world, rank=r,
                           teacher=fill_teacher()) for r in range(world)]
    seen = []
    for d in ranks:
        seen += [b["index"] for b in epoch(d, workers)]
    idx = torch.cat(seen)
    assert len(idx) == len(set(idx.tolist())) == 192 and int(idx.max()) < 192  # shard 6 is dropped
    committed = ranks[-1].committed()
    assert committed is not None
    assert_is_reference(committed, reference)
