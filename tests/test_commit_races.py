"""Several real processes commit the same feature set at once, on local disk and on S3 (moto).

Each version id is committed exactly once; the runs of the same fingerprint all return the one
committed version (the losers adopt the winner, even one that asked for another shard size);
a different fingerprint commits its own version; every tag resolves to a committed version.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import pytest

import featstore

ROOT = Path(__file__).resolve().parents[1]
# (model seed, samples per shard): three runs of one fingerprint (two shard sizes), one other.
RUNS = [(0, 32), (0, 32), (0, 64), (1, 32)]


def race(url: str, endpoint: str, sync: Path, scheduler: str) -> list[dict]:
    sync.mkdir()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.race_child", url, endpoint, str(seed), str(spp),
                               str(sync), str(i), scheduler], cwd=ROOT, stdout=subprocess.PIPE,
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
def test_concurrent_commits_s3(tmp_path, dask_client, moto_endpoint):
    bucket = f"race-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    s3.create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/feats"
    results = race(url, moto_endpoint, tmp_path / "sync", dask_client.scheduler.address)
    store = featstore.open_store(url, storage_options={"endpoint_url": moto_endpoint})
    keys = [o["Key"].removeprefix("feats/") for o in s3.list_objects_v2(Bucket=bucket)["Contents"]
            if o["Key"].endswith("manifest.json")]
    check(store, results, keys, "s3")
