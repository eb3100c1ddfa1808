"""SIGKILL a real computing process at random points, resume, and compare with a clean run.

CI runs 4 kills on local disk, 2 on moto and 1 on SeaweedFS; FEATSTORE_KILLS_LOCAL /
FEATSTORE_KILLS_S3 / FEATSTORE_KILLS_SEAWEEDFS raise them for a longer run.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import featstore
from featstore.compute._shard_task import PROBE_ROWS
from featstore.versions import stored

from tests.helpers import QUIET, TinyA, VectorData, write_version
from tests.servers import ALL_STORES, new_bucket

ROOT = Path(__file__).resolve().parents[2]
N, SPP = 512, 32
SHARDS = N // SPP
OUT = {"features": "float16", "logits": "float32"}
# Kill/resume cycles per backend (each ~5-10 s); raise them for a soak run, e.g.
# FEATSTORE_KILLS_LOCAL=50. The defaults keep CI's whole suite under its time budget.
KILLS = {"local": int(os.environ.get("FEATSTORE_KILLS_LOCAL", 4)),
         "moto": int(os.environ.get("FEATSTORE_KILLS_S3", 2)),
         "seaweedfs": int(os.environ.get("FEATSTORE_KILLS_SEAWEEDFS", 1))}


def compute(store, client, data, seed=0):
    return write_version(store, "kill/me", model=TinyA(seed=seed), dataset=data, outputs=OUT, batch_size=16,
                         samples_per_shard=SPP, client=client, options=QUIET)


def spawn_child(url: str, endpoint: str | None, seed: int = 0) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.compute_child", url, str(N), str(SPP), "0.002", endpoint or "-", str(seed)],
        cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def kill_when(proc: subprocess.Popen, done: callable, at_least: int, extra_delay: float) -> None:
    deadline = time.monotonic() + 180
    try:
        while len(done()) < at_least and proc.poll() is None:
            assert time.monotonic() < deadline, "the child never got that far"
            time.sleep(0.02)
        time.sleep(extra_delay)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and its Dask worker processes
        proc.wait()


@pytest.fixture(scope="module")
def clean_digests(tmp_path_factory):
    v = compute(featstore.open_store(tmp_path_factory.mktemp("clean") / "s"), None, VectorData(N))
    return v.id, [s.digests for s in stored(v).shard_receipts()], v.load()


def receipts_of(store) -> set[int]:
    return {int(k.rsplit("/", 1)[1].split(".")[0]) for k in store.storage.find("kill/me")
            if "/_receipts/" in k and k.endswith(".json")}


@pytest.mark.timeout(900)  # a hang guard: 10 or 5 kill/resume cycles take minutes on a loaded 2-core machine
@pytest.mark.parametrize("backend", ALL_STORES)
def test_sigkill_at_random_points_then_resume(backend, tmp_path, dask_client, clean_digests, request):
    clean_id, clean_shards, clean_values = clean_digests
    rng = random.Random(f"kill-{backend}")
    figures = []
    for attempt in range(KILLS[backend]):
        if backend == "local":
            url, endpoint = str(tmp_path / f"store{attempt}"), None
        else:
            endpoint = request.getfixturevalue(f"{backend}_endpoint")
            url = f"s3://{new_bucket(endpoint)}/feats"
        store = featstore.open_store(url, {"endpoint_url": endpoint} if endpoint else None)
        kill_when(spawn_child(url, endpoint), lambda s=store: receipts_of(s),
                  at_least=rng.randrange(0, SHARDS - 2), extra_delay=rng.uniform(0, 0.3))
        committed = [v.id for v in store.versions("kill/me")]
        finished = receipts_of(store)
        if committed:  # the kill came after the commit: the version must be whole
            assert committed == [clean_id] and finished == set(range(SHARDS))
        log = tmp_path / f"reads{attempt}.log"
        v = compute(store, dask_client, VectorData(N, log=str(log)))
        recomputed = v.manifest.timings.get("shards_computed", 0) if not committed else 0
        assert recomputed == SHARDS - len(finished) or committed
        me = str(os.getpid())
        read = [int(i) for pid, i in (ln.split() for ln in (log.read_text().splitlines() if log.exists() else []))
                if pid != me]
        finished_rows = {r for s in finished for r in range(s * SPP, (s + 1) * SPP)}
        # only the probe's first batch (shapes and compression) may be re-read
        assert set(read) & finished_rows <= set(range(min(16, PROBE_ROWS)))
        assert v.id == clean_id
        assert [s.digests for s in stored(v).shard_receipts()] == clean_shards  # bit-identical per shard
        assert v.verify() == []  # and the stored bytes match those digests
        if attempt == 0:
            got = v.load()
            for k in got:
                np.testing.assert_array_equal(got[k].numpy(), clean_values[k].numpy())
        if attempt == 0:  # a killed writer's temp file, as zarr or featstore leaves one (S3 has none of its own)
            store.storage.write_bytes(f"{stored(v).key}/features/c/0/0.{os.getpid()}.partial", b"torn")
        partials = sorted(k for k in store.storage.find("") if ".partial" in k)
        assert partials or attempt > 0
        leftovers = store.gc(older_than=0)
        assert sorted(leftovers) == partials  # every temp file, and nothing else of a committed version
        assert not any(".partial" in k for k in store.storage.find("")) and v.verify() == []
        figures.append((len(finished), recomputed))
    print(f"\n{backend}: (finished at kill, recomputed) per kill: {figures}")


def test_gc_removes_an_abandoned_uncommitted_version(tmp_path, dask_client):
    url = str(tmp_path / "store")
    store = featstore.open_store(url)
    kill_when(spawn_child(url, None, seed=7), lambda: receipts_of(store), at_least=2, extra_delay=0)
    assert store.versions("kill/me") == [] and receipts_of(store)
    kept = compute(store, dask_client, VectorData(N))  # another fingerprint, committed
    assert store.gc(older_than=3600) == []  # too young: may still be resumed
    deleted = store.gc(older_than=0)
    assert deleted and all(k.startswith("kill/me/_versions/") and kept.id not in k for k in deleted)
    assert [k for k in store.storage.find("") if kept.id not in k] == []
    assert store.open("kill/me") == kept and kept.verify() == []
