"""SIGKILL a real computing process part-way, rerun, and check only unfinished shards ran."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import featstore
from featstore import ComputeOptions

from .models import TinyA, VectorData

ROOT = Path(__file__).resolve().parents[1]
N, SPP = 1024, 64
OUT = {"features": "float16", "logits": "float32"}


def receipts(store_dir: Path) -> list[Path]:
    return sorted(store_dir.glob("kill/me/_versions/*/_receipts/*.json"))


def kill_part_way(store_dir: Path, at_least: int) -> int:
    proc = subprocess.Popen([sys.executable, "-m", "tests.compute_child", str(store_dir), str(N), str(SPP), "0.004"],
                            cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    try:
        while len(receipts(store_dir)) < at_least:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the child never finished a shard"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and its Dask worker processes
        proc.wait()
    return proc.returncode


def test_sigkill_then_resume_recomputes_only_unfinished_shards(tmp_path, dask_client):
    store_dir = tmp_path / "store"
    assert kill_part_way(store_dir, at_least=3) == -signal.SIGKILL
    store = featstore.open_store(store_dir)
    assert store.versions("kill/me") == []  # killed before the commit: invisible
    finished = {int(p.stem) for p in receipts(store_dir)}
    assert 3 <= len(finished) < N // SPP

    log = tmp_path / "reads.log"
    v = store.compute("kill/me", model=TinyA(), dataset=VectorData(N, log=str(log)), keep=["target"],
                      outputs=OUT, batch_size=16, samples_per_shard=SPP, client=dask_client,
                      options=ComputeOptions(progress=False))
    assert v.manifest.timings["shards_computed"] == N // SPP - len(finished)
    me = str(os.getpid())
    read = [int(i) for pid, i in (line.split() for line in log.read_text().splitlines()) if pid != me]
    finished_rows = {r for s in finished for r in range(s * SPP, (s + 1) * SPP)}
    # Only the probe (sample 0, once) may touch a finished shard.
    assert set(read) & finished_rows <= {0} and read.count(0) <= 1 + (0 not in finished_rows)

    clean = featstore.open_store(tmp_path / "clean").compute(
        "kill/me", model=TinyA(), dataset=VectorData(N), keep=["target"], outputs=OUT, batch_size=16,
        samples_per_shard=SPP, client=dask_client, options=ComputeOptions(progress=False))
    assert clean.id == v.id
    assert [s.digests for s in clean.manifest.shards] == [s.digests for s in v.manifest.shards]
    a, b = v.load(), clean.load()
    for k in a:
        np.testing.assert_array_equal(a[k].numpy(), b[k].numpy())
    assert v.verify() == []
