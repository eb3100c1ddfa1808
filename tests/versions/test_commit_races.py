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
from featstore import ComputeFailed, ComputeOptions
from featstore.versions._commits import Commits
from featstore.versions._keys import split_version_key, version_key
from featstore.versions._receipts import finished_shards, forget_receipts, read_receipts, write_receipt

from tests.models import FailsAt, TinyA, VectorData
from tests.servers import both_servers, new_bucket

ROOT = Path(__file__).resolve().parents[2]
# (model seed, samples per shard): three runs of one fingerprint (two shard sizes), one other.
RUNS = [(0, 32), (0, 32), (0, 64), (1, 32)]


def race(url: str, endpoint: str, sync: Path, scheduler: str, *extra: str) -> list[dict]:
    sync.mkdir()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.race_child", url, endpoint, str(seed), str(spp),
                               str(sync), str(i), scheduler, *extra], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for i, (seed, spp) in enumerate(RUNS)]
    deadline = time.monotonic() + 120  # hang guard
    while len(list(sync.glob("ready-*"))) < len(RUNS):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)
    (sync / "go").touch()  # every child starts its compute at once
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=240)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert lines, out[-3000:]
        results.append(json.loads(lines[-1][7:]))
    return results


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
          f"(shards computed across them: {computed}, of {192 // same[0]['spp']}), 1 other version; "
          f"tags {len(tags)} all resolve")


@pytest.mark.timeout(300)
def test_concurrent_commits_local(tmp_path, dask_client):
    root = tmp_path / "store"
    results = race(str(root), "", tmp_path / "sync", dask_client.scheduler.address)
    store = featstore.open_store(root)
    keys = [str(p.relative_to(root)) for p in root.rglob("manifest.json")]
    check(store, results, keys, "local")


@pytest.mark.timeout(300)
@both_servers
def test_concurrent_commits_s3(tmp_path, dask_client, s3_endpoint, s3_server):
    bucket = new_bucket(s3_endpoint, "race")
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    url = f"s3://{bucket}/feats"
    results = race(url, s3_endpoint, tmp_path / "sync", dask_client.scheduler.address)
    store = featstore.open_store(url, storage_options={"endpoint_url": s3_endpoint})
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


def test_commit_refuses_receipts_written_under_another_layout(local_store, dask_client):
    """A receipt for other rows than this layout's shard (written by another claim's run) is
    not committed: it is removed and the rerun recomputes that shard."""
    kw = dict(model=TinyA(), keep=["target"], outputs={"features": "float16"}, batch_size=16,
              samples_per_shard=32, client=dask_client, options=ComputeOptions(progress=False))
    with pytest.raises(ComputeFailed):
        local_store.compute("rcpt/set", dataset=FailsAt(256, 200), **kw)
    wait_quiet(dask_client)
    vkey = split_version_key(next(k for k in local_store.storage.find("rcpt/set") if "/_receipts/" in k))[0]
    mine = read_receipts(local_store.storage, vkey)
    assert 1 in mine
    forget_receipts(local_store.storage, vkey, [1])  # in its place, a 16-row layout's shard 1
    write_receipt(local_store.storage, vkey, replace(mine[1], start=16, stop=32))
    with pytest.raises(ComputeFailed, match=r"receipts of shards \[1\].*another layout"):
        local_store.compute("rcpt/set", dataset=VectorData(256), **kw)
    assert local_store.versions("rcpt/set") == [] and 1 not in finished_shards(local_store.storage, vkey)
    v = local_store.compute("rcpt/set", dataset=VectorData(256), **kw)
    assert v.verify() == [] and v.manifest.timings["shards_computed"] >= 1


def wait_quiet(client, timeout: float = 120.0) -> None:
    """Until the cluster runs no task (a failed compute's other tasks finish their shards)."""
    deadline = time.monotonic() + timeout
    while any(client.processing().values()) and time.monotonic() < deadline:
        time.sleep(0.2)
