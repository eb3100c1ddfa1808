"""Edges users hit: changed Model A code, a Dask worker killed mid-compute, gc during a live
compute, delete while reading, a full or read-only disk, tag vs delete, resuming with another
number of DataLoader workers, storing a subset of A's outputs."""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import signal
import sys
import threading
import time
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

import featstore
from featstore import (ComputeFailed, ComputeOptions, InvalidInput, OutputMismatch, StoreFull,
                       StorePermissionDenied, VersionNotFound)
from featstore.versions._fingerprints import class_code, code_digest
from featstore.versions import stored

from . import tmpfs
from .helpers import QUIET, DoubleLin, ReluLin, SlowData, TinyA, VectorData, write_version

OUT = {"features": "float32", "logits": "float32"}


def receipts_of(store, name: str) -> set[int]:
    return {int(k.rsplit("/", 1)[1].split(".")[0]) for k in store.storage.find(name)
            if "/_receipts/" in k and k.endswith(".json")}


# -- Model A's code is part of the fingerprint ------------------------------------------------
def test_changed_forward_same_weights_is_a_new_version(local_store, dask_client):
    a, b = ReluLin(), DoubleLin()
    assert {k: v.tolist() for k, v in a.state_dict().items()} == {k: v.tolist() for k, v in b.state_dict().items()}
    data = VectorData(40)
    va = local_store.compute("code/set", model=a, dataset=data, outputs={"out": "float32"}, client=dask_client,
                             options=QUIET)
    vb = local_store.compute("code/set", model=b, dataset=data, outputs={"out": "float32"}, client=dask_client,
                             options=QUIET)
    assert va.id != vb.id and [v.id for v in local_store.versions("code/set")] == [va.id, vb.id]
    with torch.inference_mode():  # exact by construction (tests/models.py): compared bit for bit
        assert torch.equal(vb.load()["out"], b(data.x)) and torch.equal(va.load()["out"], a(data.x))
    # An explicit model_id is the user's word for A's identity: then neither weights nor code count.
    opts = ComputeOptions(progress=False, model_id="lin-v1")
    vc = local_store.compute("code/id", model=a, dataset=data, outputs={"out": "float32"}, client=dask_client,
                             options=opts)
    vd = local_store.compute("code/id", model=b, dataset=data, outputs={"out": "float32"}, client=dask_client,
                             options=opts)
    assert vc.id == vd.id and vc.manifest.fingerprint_parts["model_code"] is None


def _module_from(path, source: str, monkeypatch):
    """Import ``source`` as a module file (registered, as an import registers it: inspect finds a
    class's source through ``sys.modules``)."""
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"fs_edge_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    return mod


SRC = '''
import torch
class A(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
    def forward(self, x):
        return {body}
'''


def test_code_digest_sees_source_and_config_not_comments(tmp_path, monkeypatch):
    relu = _module_from(tmp_path / "m1.py", SRC.format(body="torch.relu(self.lin(x))"), monkeypatch)
    commented = _module_from(tmp_path / "m2.py", "# a comment\n" + SRC.format(
        body="torch.relu(  self.lin(x) )  # same"), monkeypatch)
    doubled = _module_from(tmp_path / "m3.py", SRC.format(body="self.lin(x) * 2"), monkeypatch)
    assert class_code(relu.A) == class_code(commented.A) != class_code(doubled.A)
    assert class_code(relu.A).startswith("source:")
    ns: dict = {}
    exec(compile(SRC.format(body="x + 1"), "<no file>", "exec"), ns)  # no source on disk: bytecode
    assert class_code(ns["A"]).startswith("bytecode:")
    c, d = torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(3, 4, 3, stride=2)
    d.load_state_dict(c.state_dict())
    assert code_digest(c) != code_digest(d)  # same weights, other stride: another computation
    assert code_digest(torch.nn.Linear(3, 2)) == code_digest(torch.nn.Linear(3, 2))  # weights are not code


# -- a Dask worker process dies mid-compute ----------------------------------------------------
N, SPP = 512, 32


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    store = featstore.open_store(tmp_path_factory.mktemp("ref") / "store")
    return write_version(store, "edge/ref", n=N, outputs=OUT, batch_size=16, samples_per_shard=SPP,
                         options=QUIET).load()


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _busy_task(client, store, name):
    """(worker address, its shard task's shards) for a worker whose task has finished some but
    not all of its shards, or None."""
    done = receipts_of(store, name)
    for addr, keys in client.processing().items():
        for key in keys:
            parts = str(key).split("-")  # featstore-shards-<vid>-<run>-<first>[-<last>][-retry<n>]
            if str(key).startswith("featstore-shards-"):
                first = int(parts[4])
                last = int(parts[5]) if len(parts) > 5 and parts[5].isdigit() else first
                mine = set(range(first, last + 1))
                if mine & done and not mine <= done:
                    return addr, mine
    return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, or a process reaped while we look, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.timeout(480)
def test_sigkill_a_dask_worker_mid_compute(tmp_path, reference):
    from distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                           silence_logs=logging.CRITICAL)
    client = Client(cluster)
    try:
        store = featstore.open_store(tmp_path / "store")
        log = tmp_path / "reads.log"
        thread, out = _in_thread(lambda: store.compute(
            "edge/kill", model=TinyA(), dataset=SlowData(N, 0.01, log=str(log)), keep=["target"], outputs=OUT,
            batch_size=16, samples_per_shard=SPP, client=client,
            # Tasks of 4 shards: a task killed after finishing some of its shards is rerun whole
            # by Dask, and must skip those (one-shard tasks lose only the shard they run).
            options=ComputeOptions(progress=False, shards_per_task=4)))
        deadline = time.monotonic() + 300  # a hang guard on a loaded machine
        while (victim := _busy_task(client, store, "edge/kill")) is None:
            assert time.monotonic() < deadline and thread.is_alive(), out
            time.sleep(0.005)
        addr, shards = victim
        pid = client.run(os.getpid, workers=[addr])[addr]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the worker process went away between the lookup and the kill: the same fault
        while _alive(pid):
            time.sleep(0.01)
        finished_at_kill = receipts_of(store, "edge/kill")
        thread.join(180)
        assert "error" not in out, out
        v = out["value"]
    finally:
        client.close()
        cluster.close()
    assert v.verify() == []
    got = v.load()
    for k in reference:
        assert torch.equal(got[k], reference[k]), k  # exact by construction (tests/models.py)
    me = str(os.getpid())
    reads = Counter(int(i) for pid_, i in (ln.split() for ln in log.read_text().splitlines()) if pid_ != me)
    probe = set(range(16))
    victims_done = shards & finished_at_kill
    assert victims_done  # the killed worker had finished some of its task's shards
    for s in finished_at_kill:  # a finished shard is never recomputed, not even by the rerun task
        assert all(reads[r] == 1 for r in range(s * SPP, (s + 1) * SPP) if r not in probe), s
    assert set(reads) == set(range(N))  # every sample was computed
    assert v.manifest.timings["shards_computed"] == N // SPP - v.manifest.timings["shards_reused"]
    assert v.manifest.timings["shards_reused"] >= len(victims_done)
    print(f"\n[worker-kill] killed worker pid {pid} with shards {sorted(shards)}, of which "
          f"{sorted(victims_done)} were finished; {len(finished_at_kill)} shards finished at the kill, "
          f"{v.manifest.timings['shards_reused']} reused by the rescheduled task, "
          f"{sum(1 for n in reads.values() if n > 1)} samples read twice")


# -- gc during a live compute ------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_gc_during_a_live_compute_never_commits_missing_data(tmp_path, dask_client, reference):
    store = featstore.open_store(tmp_path / "store")
    kw = dict(model=TinyA(), keep=["target"], outputs=OUT, batch_size=16, samples_per_shard=SPP,
              client=dask_client, options=QUIET)
    thread, out = _in_thread(lambda: store.compute("edge/gc", dataset=SlowData(N, 0.003), **kw))
    deadline = time.monotonic() + 120
    while len(receipts_of(store, "edge/gc")) < 3:
        assert time.monotonic() < deadline and thread.is_alive(), out
        time.sleep(0.005)
    deleted = store.gc(older_than=0)  # the user's "delete everything uncommitted", mid-compute
    thread.join(180)
    assert deleted and all("/_versions/" in k for k in deleted)
    # Either the run noticed and refused to commit, or it committed a whole version.
    if "error" in out:
        assert isinstance(out["error"], ComputeFailed), out
        assert "deleted" in str(out["error"]) and "Rerun compute" in str(out["error"])
        assert str(out["error"]).count("ComputeFailed") == 0  # the typed error itself, not a wrapped repr
        assert store.versions("edge/gc") == []
    v = store.compute("edge/gc", dataset=VectorData(N), **kw)  # the rerun (or the committed one)
    assert [x.id for x in store.versions("edge/gc")] == [v.id]
    assert v.verify() == []
    got = v.load()
    assert all(torch.equal(got[k], reference[k]) for k in reference)
    print(f"\n[gc-live] gc deleted {len(deleted)} objects mid-compute; the run "
          f"{'refused to commit: ' + str(out['error'])[:120] if 'error' in out else 'committed a whole version'}")


def test_commit_and_gc_handshake(local_store, dask_client):
    """The interleavings a thread test cannot force: gc marks a folder before the commit's
    manifest (the commit withdraws), and a commit before gc looks (gc leaves it alone)."""
    from featstore.versions._keys import GC_MARK

    kw = dict(model=TinyA(), outputs=OUT, batch_size=16, samples_per_shard=SPP, client=dask_client, options=QUIET)
    v = local_store.compute("edge/hs", dataset=VectorData(64), **kw)
    assert local_store.gc(older_than=0) == []  # committed: untouched
    manifest = v.manifest
    local_store.storage.delete(f"{stored(v).key}/manifest.json")  # back to "all shards done, not committed"
    local_store.storage.write_bytes(f"{stored(v).key}/{GC_MARK}", b"{}")  # a gc is deleting this folder
    with pytest.raises(ComputeFailed, match="gc"):
        local_store.catalog.commits.commit(manifest)
    assert local_store.versions("edge/hs") == []
    local_store.storage.delete(f"{stored(v).key}/{GC_MARK}")
    local_store.storage.delete(f"{stored(v).key}/logits/c/1/0")  # a gc that finished before the commit
    with pytest.raises(ComputeFailed, match="logits/c/1/0"):
        local_store.catalog.commits.commit(manifest)
    assert local_store.versions("edge/hs") == []
    v2 = local_store.compute("edge/hs", dataset=VectorData(64), **kw)  # recomputes shard 1 only
    assert v2.manifest.timings["shards_computed"] == 1 and v2.verify() == []


# -- delete while a DataLoader epoch reads -----------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_delete_while_reading_says_deleted(tmp_path, dask_client, workers):
    store = featstore.open_store(tmp_path / "store")
    v = store.compute("edge/del", model=TinyA(), dataset=VectorData(640), outputs=OUT, batch_size=64,
                      samples_per_shard=16, client=dask_client, options=ComputeOptions(progress=False, chunk_rows=16))
    ds = store.dataset("edge/del", batch_size=16, shuffle=False, prefetch=1)
    loader = DataLoader(ds, batch_size=None, num_workers=workers, timeout=60 if workers else 0)
    it = iter(loader)
    next(it)
    store.delete(v)
    with pytest.raises(VersionNotFound, match="deleted") as err:
        for _ in it:
            pass
    assert v.ref in str(err.value)
    with pytest.raises(VersionNotFound, match="deleted"):
        v.load()  # the zarr path says the same


# -- a full disk, a read-only store ------------------------------------------------------------
# Real where a tmpfs can be had (tests/tmpfs.py: a mount namespace, as root or any user; the id
# says "tmpfs"); elsewhere the id says what is simulated instead.
DISK = "tmpfs" if tmpfs.available() else "simulated-ENOSPC"
READ_ONLY = "tmpfs" if tmpfs.available() else "file-modes" if os.geteuid() != 0 else "simulated-EROFS"


@pytest.fixture(params=[DISK])
def small_disk(request, tmp_path, monkeypatch):
    """A store root on a 192 KiB tmpfs; without one, a LocalStore whose chunk writes raise
    ENOSPC after the first few (a mock: the id says so)."""
    if request.param == "tmpfs":
        with tmpfs.mounted(tmp_path / "mnt", "size=192k") as root:
            yield root / "store", None
        return
    import zarr.storage

    real, calls = zarr.storage.LocalStore.set, Counter()

    async def full(self, key, value):
        calls["n"] += 1
        if "/c/" in key and calls["n"] > 8:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return await real(self, key, value)

    monkeypatch.setattr(zarr.storage.LocalStore, "set", full)
    yield tmp_path / "mnt" / "store", "in-process"


def test_disk_full_is_store_full_and_commits_nothing(small_disk, dask_client):
    root, mode = small_disk
    store = featstore.open_store(root)
    with pytest.raises(StoreFull) as err:  # 4096 x 13 float32 + int64: ~250 KiB of shards
        store.compute("edge/full", model=TinyA(), dataset=VectorData(4096), keep=["target"], outputs=OUT,
                      samples_per_shard=256, client=None if mode else dask_client, options=QUIET)
    msg = str(err.value)
    assert isinstance(err.value, OSError) and "No space left on device" in msg and str(root) in msg
    assert "free" in msg.lower() and "rerun" in msg
    assert store.versions("edge/full") == [] and store.names() == []
    assert not [k for k in store.storage.find("") if k.endswith("manifest.json")]


@pytest.fixture(params=[READ_ONLY])
def read_only_root(request, tmp_path, monkeypatch):
    """A store root this process cannot write: a read-only tmpfs; without one, a folder without
    write permission (real, for a user other than root), or for root (who ignores file modes)
    a folder whose writes raise EROFS (a mock: the id says so)."""
    if request.param == "tmpfs":
        with tmpfs.mounted(tmp_path / "ro", "size=64k,ro") as root:
            yield root
        return
    root = tmp_path / "ro"
    root.mkdir()
    if request.param == "simulated-EROFS":  # featstore's local writes (folders, temp files) refused
        import featstore.storage._local

        real_makedirs = os.makedirs

        def refuse(path, *args, **kw):
            if str(path).startswith(str(root)) and not os.path.isdir(path):  # as mkdir on a read-only fs
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_makedirs(path, *args, **kw)

        def refuse_open(path, mode="r", *args, **kw):
            if str(path).startswith(str(root)) and set(mode) & set("wax+"):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return open(path, mode, *args, **kw)

        monkeypatch.setattr(os, "makedirs", refuse)
        monkeypatch.setattr(featstore.storage._local, "open", refuse_open, raising=False)
        yield root
        return
    root.chmod(0o555)
    yield root
    root.chmod(0o755)


def test_permission_denied_is_typed_and_names_the_path(read_only_root, dask_client):
    store = featstore.open_store(read_only_root)  # reading an empty store works
    assert store.names() == []
    with pytest.raises(StorePermissionDenied) as err:
        store.compute("edge/ro", model=TinyA(), dataset=VectorData(32), outputs=OUT, client=dask_client,
                      options=QUIET)
    msg = str(err.value)
    assert isinstance(err.value, PermissionError) and str(read_only_root) in msg
    assert "Read-only file system" in msg or "Permission denied" in msg
    assert "credentials" not in msg.split("(")[0]  # a local store: no talk of credentials first
    assert list(read_only_root.iterdir()) == []


# -- tag vs delete -----------------------------------------------------------------------------
@pytest.fixture
def two_versions(local_store, dask_client):
    kw = dict(dataset=VectorData(32), outputs=OUT, samples_per_shard=16, client=dask_client, options=QUIET)
    return (local_store, local_store.compute("edge/tag", model=TinyA(), **kw),
            local_store.compute("edge/tag", model=TinyA(seed=1), **kw))


def test_tag_racing_delete_never_dangles(two_versions, monkeypatch):
    store, v1, v2 = two_versions
    from featstore.versions import _catalog as versions

    # Interleaving 1: delete runs between tag's check of the version and its write of the tag.
    real_open = versions.Catalog.open

    def open_then_delete(self, ref):
        found = real_open(self, ref)
        if ref == v1:
            monkeypatch.setattr(versions.Catalog, "open", real_open)
            store.delete(v1)
        return found

    monkeypatch.setattr(versions.Catalog, "open", open_then_delete)
    with pytest.raises(VersionNotFound, match="deleted"):
        store.tag(v1, "best")
    assert store.tags("edge/tag") == {}
    # Interleaving 2: a tag written after delete's first sweep, before the manifest goes: delete
    # sweeps again after the manifest is gone.
    real_delete = store.storage.delete

    def delete_then_tag(key, **kw):
        real_delete(key, **kw)
        if key.endswith("manifest.json"):
            store.storage.write_json(versions.tag_key("edge/tag", "late"), versions.tag_json(v2.id))
    monkeypatch.setattr(store.storage, "delete", delete_then_tag)
    store.delete(v2)
    monkeypatch.setattr(store.storage, "delete", real_delete)
    assert store.tags("edge/tag") == {}
    # A tag left by an older featstore (or written by hand) to a deleted version says so.
    store.storage.write_json(versions.tag_key("edge/tag", "old"), versions.tag_json(v2.id))
    with pytest.raises(VersionNotFound, match=f"tag 'old' points at version {v2.id}, which was deleted"):
        store.open("edge/tag@old")


def test_tag_and_delete_threads(local_store, dask_client):
    """Real threads: after every round, every tag resolves to a committed version."""
    kw = dict(dataset=VectorData(16), outputs=OUT, samples_per_shard=16, client=dask_client, options=QUIET)
    for round_ in range(12):
        v = local_store.compute("edge/race", model=TinyA(seed=100 + round_), **kw)
        errors: list[Exception] = []

        def tag(name, v=v, errors=errors):
            try:
                local_store.tag(v, name)
            except VersionNotFound as exc:
                errors.append(exc)

        threads = [threading.Thread(target=tag, args=(f"t{i}",)) for i in range(3)]
        threads.append(threading.Thread(target=local_store.delete, args=(v,)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for name, vid in local_store.tags("edge/race").items():
            assert local_store.open(f"edge/race@{name}").id == vid
        assert all("deleted" in str(e) for e in errors)


# -- resuming with another DataLoader worker count or world size -------------------------------
def test_resume_under_other_workers_reads_the_rest_once_and_another_global_batch_is_refused(two_versions):
    store, v1, _ = two_versions
    ds = v1.dataset(batch_size=4, seed=1)
    it = iter(DataLoader(ds, batch_size=None, num_workers=2, timeout=60))
    seen = [int(i) for _ in range(3) for i in next(it)["index"]]
    state = ds.state_dict(batches_seen=3)
    assert state["num_workers"] == 2  # recorded by the workers themselves
    for workers in (3, 0, 2):  # another split (elastic resume), no workers at all, the same split
        again = v1.dataset(batch_size=4, seed=1)
        again.load_state_dict(state)
        loader = DataLoader(again, batch_size=None, num_workers=workers, timeout=60) if workers else again
        rest = [int(i) for b in loader for i in b["index"]]
        assert sorted(seen + rest) == list(range(len(v1))), workers  # every sample once, none again
    with pytest.raises(InvalidInput, match="global batch is 4.*batch_size=2"):
        v1.dataset(batch_size=4, seed=1, rank=0, world_size=2).load_state_dict(state)


# -- storing a subset of A's outputs -----------------------------------------------------------
def test_outputs_may_name_a_subset_of_what_a_returns(local_store, dask_client):
    data = VectorData(40)
    v = local_store.compute("edge/subset", model=TinyA(), dataset=data, outputs={"logits": "float16"},
                            client=dask_client, options=QUIET)
    assert set(v.manifest.arrays) == {"logits", "item_digest"}  # the input digests are featstore's own
    with torch.inference_mode():
        assert torch.equal(v.load()["logits"], TinyA()(data.x)["logits"].half())
    with pytest.raises(OutputMismatch, match=r"'emb'.*returns \['features', 'logits'\]"):
        local_store.compute("edge/subset", model=TinyA(), dataset=data, outputs={"logits": "float16", "emb": "float32"},
                            client=dask_client, options=QUIET)
