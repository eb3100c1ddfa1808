"""Several real processes commit the same feature set at once, on local disk and on S3 (moto and
SeaweedFS); and the commit's own checks of the stored layout, for a folder that a second claim
rewrote (possible only on a server that ignores conditional creates, which featstore refuses:
tests/storage/test_s3_servers.py).

Each version id is committed exactly once; the runs of the same fingerprint all return the one
committed version (the losers adopt the winner, even one that asked for another shard size);
a different fingerprint commits its own version; every tag resolves to a committed version.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import boto3
import pytest

import featstore
from featstore import ComputeFailed, ComputeOptions, StoreUnavailable
from featstore.versions._commits import Commits
from featstore.versions._keys import split_version_key, version_key
from featstore.versions._receipts import finished_shards, forget_receipts, read_receipts, write_receipt

from tests.models import TinyA, VectorData
from tests.race_child import N
from tests.servers import both_servers, new_bucket

ROOT = Path(__file__).resolve().parents[2]
# (model seed, samples per shard): three runs of one fingerprint (two shard sizes), one other.
RUNS = [(0, 32), (0, 32), (0, 64), (1, 32)]


def races(targets: list[tuple[str, str]], sync: Path, scheduler: str, *extra: str) -> list[list[dict]]:
    """One race per target (``(url, endpoint)``, endpoint "" for a local store), one after
    another, run by the same len(RUNS) processes (started once: their start-up is paid once, not
    per store): in each race every process starts its compute at the same signal. Returns each
    target's results, one per process in RUNS order."""
    sync.mkdir()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.race_child", json.dumps(targets), str(seed), str(spp),
                               str(sync), str(i), scheduler, *extra], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for i, (seed, spp) in enumerate(RUNS)]
    try:
        results = []
        for k in range(len(targets)):
            _wait_for(procs, [sync / f"ready-{k}-{i}" for i in range(len(RUNS))])
            (sync / f"go-{k}").touch()  # every process starts this store's compute at once
            done = [sync / f"result-{k}-{i}.json" for i in range(len(RUNS))]
            _wait_for(procs, done)
            results.append([json.loads(p.read_text()) for p in done])
        for p in procs:
            p.communicate(timeout=60)
        return results
    finally:
        for p in procs:
            p.kill()


def _wait_for(procs: list[subprocess.Popen], files: list[Path], timeout: float = 240) -> None:
    """Until every file exists (a hang guard: the processes' output if one dies or time runs out)."""
    deadline = time.monotonic() + timeout
    while not all(f.exists() for f in files):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            raise AssertionError("a racing process died or hung:\n" + "\n".join(
                (p.communicate()[0] or "")[-2000:] for p in procs))
        time.sleep(0.05)


def race(url: str, endpoint: str, sync: Path, scheduler: str, *extra: str) -> list[dict]:
    """One race on one store (tests/race_repro.py)."""
    return races([(url, endpoint)], sync, scheduler, *extra)[0]


def check(store: featstore.FeatureStore, results: list[dict], manifest_keys: list[str], label: str) -> None:
    assert all(r["status"] == "ok" for r in results), results
    same = [r for r, (seed, _) in zip(results, RUNS, strict=True) if seed == 0]
    other = [r for r, (seed, _) in zip(results, RUNS, strict=True) if seed == 1]
    assert len({r["id"] for r in same}) == 1 and len({r["created_at"] for r in same}) == 1  # one winner
    assert len({r["spp"] for r in same}) == 1  # the 64-row run adopted the claimed layout (or set it)
    assert other[0]["id"] != same[0]["id"]
    # Exactly one manifest per version id, and both versions are listed.
    assert sorted(manifest_keys) == sorted(f"race/set/_versions/{v}/manifest.json" for v in
                                           {same[0]["id"], other[0]["id"]})
    assert {v.id for v in store.versions("race/set")} == {same[0]["id"], other[0]["id"]}
    tags = store.tags("race/set")
    assert set(tags) == {"race", *(f"by-{i}" for i in range(len(RUNS)))}
    for tag in tags:  # no tag points at a missing version
        assert store.open(f"race/set@{tag}").verify() == []
    computed = sum(r["computed"] for r in same)
    print(f"\n[races] {label}: {len(RUNS)} processes, {len(same)} on one fingerprint -> 1 commit "
          f"(shards computed across them: {computed}, of {N // same[0]['spp']}), 1 other version; "
          f"tags {len(tags)} all resolve")


@pytest.fixture(scope="module")
def raced(tmp_path_factory, dask_client, moto_endpoint, seaweedfs_endpoint):
    """The races on local disk, moto and SeaweedFS, run once by one set of processes:
    {backend: (url, endpoint, results)}."""
    tmp = tmp_path_factory.mktemp("races")
    targets = {"local": (str(tmp / "store"), "")}
    for server, endpoint in (("moto", moto_endpoint), ("seaweedfs", seaweedfs_endpoint)):
        targets[server] = (f"s3://{new_bucket(endpoint, 'race')}/feats", endpoint)
    results = races(list(targets.values()), tmp / "sync", dask_client.scheduler.address)
    return {k: (*target, r) for (k, target), r in zip(targets.items(), results, strict=True)}


@pytest.mark.timeout(600)  # the first of these runs the three races (a hang guard)
def test_concurrent_commits_local(raced):
    url, _, results = raced["local"]
    root = Path(url)
    keys = [str(p.relative_to(root)) for p in root.rglob("manifest.json")]
    check(featstore.open_store(root), results, keys, "local")


@pytest.mark.timeout(600)
@both_servers
def test_concurrent_commits_s3(raced, s3_server):
    url, endpoint, results = raced[s3_server]
    bucket = url.removeprefix("s3://").split("/", 1)[0]
    s3 = boto3.client("s3", endpoint_url=endpoint)
    store = featstore.open_store(url, storage_options={"endpoint_url": endpoint})
    keys = [o["Key"].removeprefix("feats/") for o in s3.list_objects_v2(Bucket=bucket)["Contents"]
            if o["Key"].endswith("manifest.json")]
    check(store, results, keys, s3_server)


def _rewrite_json(path: Path, change) -> None:
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


def test_commit_refuses_arrays_another_writer_laid_out_otherwise(local_store, dask_client, monkeypatch):
    """A second claim of the folder (only possible where creates are not atomic) rewrote an
    array's zarr.json with its own shard size while this run computed: the commit checks the
    stored layout against the manifest first, so nothing unreadable becomes visible."""
    kw = dict(model=TinyA(), dataset=VectorData(128), keep=["target"], outputs={"features": "float16"},
              batch_size=32, samples_per_shard=32, client=dask_client, options=ComputeOptions(progress=False))
    real = Commits.collect_receipts

    def other_writer_first(self, name, vid, layout, *args, **kwargs):
        def sixteen(meta):  # the other claim's layout: 16-row shards and chunks
            meta["chunk_grid"]["configuration"]["chunk_shape"][0] = 16
            meta["codecs"][0]["configuration"]["chunk_shape"][0] = 16
        _rewrite_json(Path(self.storage.path(f"{version_key(name, vid)}/features/zarr.json")), sixteen)
        return real(self, name, vid, layout, *args, **kwargs)

    monkeypatch.setattr(Commits, "collect_receipts", other_writer_first)
    with pytest.raises(ComputeFailed, match="do not match the layout this run computed") as err:
        local_store.compute("layout/set", **kw)
    assert "32 samples per shard" in str(err.value) and "[16, 8]" in str(err.value)
    assert local_store.versions("layout/set") == []
    monkeypatch.setattr(Commits, "collect_receipts", real)
    # What the message says: delete the uncommitted folder (no other compute runs), rerun.
    local_store.storage.delete(split_version_key(local_store.storage.find("layout/set")[0])[0], recursive=True)
    v = local_store.compute("layout/set", **kw)
    assert v.verify() == [] and v.load()["features"].shape == (128, 8)


def test_commit_refuses_receipts_written_under_another_layout(local_store, dask_client, monkeypatch):
    """A receipt for other rows than this layout's shard (written by another claim's run) is
    not committed: it is removed and the rerun recomputes that shard."""
    kw = dict(model=TinyA(), keep=["target"], outputs={"features": "float16"}, batch_size=16,
              samples_per_shard=32, client=dask_client, options=ComputeOptions(progress=False))

    def store_gone(self, manifest):
        raise StoreUnavailable("the store went away before the commit")

    # A run that wrote every shard's receipt and never committed: its commit fails, so which
    # receipts exist does not depend on the order the cluster ran the tasks in.
    monkeypatch.setattr(Commits, "commit", store_gone)
    with pytest.raises(StoreUnavailable):
        local_store.compute("rcpt/set", dataset=VectorData(256), **kw)
    monkeypatch.undo()
    vkey = split_version_key(next(k for k in local_store.storage.find("rcpt/set") if "/_receipts/" in k))[0]
    mine = read_receipts(local_store.storage, vkey)
    assert sorted(mine) == list(range(8))
    forget_receipts(local_store.storage, vkey, [1])  # in its place, a 16-row layout's shard 1
    write_receipt(local_store.storage, vkey, replace(mine[1], start=16, stop=32))
    with pytest.raises(ComputeFailed, match=r"receipts of shards \[1\].*another layout"):
        local_store.compute("rcpt/set", dataset=VectorData(256), **kw)
    assert local_store.versions("rcpt/set") == [] and 1 not in finished_shards(local_store.storage, vkey)
    v = local_store.compute("rcpt/set", dataset=VectorData(256), **kw)
    assert v.verify() == [] and v.manifest.timings["shards_computed"] == 1
