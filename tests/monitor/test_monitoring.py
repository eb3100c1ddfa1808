"""What an operator watches: the embedded cluster's featstore page, Dask's standard pages (one
task per shard, Fine Performance Metrics), and a failed task's console output."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from featstore.compute._cluster import connect
from featstore.compute._dask_logs import TaskFailureFilter

from tests import daskprocs
from tests.helpers import QUIET
from tests.models import TinyA, VectorData



def test_embedded_cluster_serves_the_featstore_page_without_set_up():
    cluster = connect(None)  # the embedded default: preloads featstore.dashboard by name
    try:
        page = cluster.page_link()
        assert page is not None and page.endswith("/individual-featstore")
        base = cluster.dashboard_base
        plots = json.loads(urllib.request.urlopen(base + "/individual-plots.json", timeout=30).read())
        assert plots["Individual Featstore"] == "/individual-featstore"
        html = urllib.request.urlopen(page, timeout=30).read().decode()
        assert "bokeh" in html.lower()
        status = urllib.request.urlopen(base + "/status", timeout=30).read().decode()
        assert "individual-featstore" in status  # listed in the dashboard's "More..." menu
    finally:
        cluster.close()


def _worker_metrics(client) -> dict:
    def get(dask_scheduler=None):
        return {"|".join(map(str, k)): v for k, v in dask_scheduler.cumulative_worker_metrics.items()
                if isinstance(k, tuple)}
    return client.run_on_scheduler(get)


def test_one_task_per_shard_and_fine_performance_metrics(local_store, dask_client):
    from distributed import get_task_stream

    with get_task_stream(dask_client) as stream:
        v = local_store.compute("mon/set", model=TinyA(), dataset=VectorData(192), keep=["target"],
                                outputs={"features": "float16", "logits": "float32"}, batch_size=16,
                                samples_per_shard=32, client=dask_client, options=QUIET)
    keys = [t["key"] for t in stream.data if str(t["key"]).startswith("featstore-shards-")]
    assert len(keys) == v.manifest.layout.n_shards == 6  # the task stream and progress bar move per shard
    deadline, labels = time.monotonic() + 60, set()
    while time.monotonic() < deadline and not {"forward", "fetch", "encode", "write"} <= labels:
        time.sleep(0.5)  # workers send their metrics with the heartbeat
        metrics = _worker_metrics(dask_client)
        labels = {k.split("|")[-2] for k in metrics if k.startswith("execute|") and "featstore-shards" in k}
    assert {"forward", "fetch", "encode", "write"} <= labels
    spans = dask_client.run_on_scheduler(
        lambda dask_scheduler=None: [s.name for s in dask_scheduler.extensions["spans"].spans.values()])
    assert ("featstore", f"mon/set@{v.id}") in [tuple(s) for s in spans]


def test_console_filter_drops_only_featstore_compute_failed_records():
    f = TaskFailureFilter()

    def record(msg, *args):
        return logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1, msg, args, None)

    assert not f.filter(record("Compute Failed\nKey:       %s\n", "featstore-shards-0123-000001"))
    assert f.filter(record("Compute Failed\nKey:       %s\n", "other-task-1"))
    assert f.filter(record("Worker stream died"))


def test_a_failing_task_prints_one_clear_error_on_the_console(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "featstore", "compute", str(tmp_path / "store"), "fail/cli",
         "--model", "tests.cli_factories:failing_model", "--dataset", "tests.cli_factories:small_dataset",
         "--outputs", "features=float16,logits=float32", "--batch-size", "100", "--samples-per-shard", "200",
         "--no-progress"],
        env=daskprocs.child_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 5, res.stderr[-3000:]
    err = res.stderr
    assert err.count("featstore: error:") == 1 and "Model A raised ValueError: broken on purpose" in err
    assert "Compute Failed" not in err and "Traceback" not in err, err[-3000:]


@pytest.mark.parametrize("argv, code", [
    (["compute", "{root}", "x/y", "--model", "no_such_module:f", "--dataset", "tests.cli_factories:small_dataset"], 2),
    (["compute", "{root}", "x/y", "--model", "featstore.demo", "--dataset", "tests.cli_factories:small_dataset"], 2),
    (["info", "{root}", "no/such"], 4),
    (["list", "{root}", "--storage-option", "nonsense"], 2),
])
def test_cli_exit_codes(tmp_path, capsys, argv, code):
    from featstore.cli import main

    assert main([a.format(root=tmp_path / "store") for a in argv] + ["--json"]) == code
    out = json.loads(capsys.readouterr().out)
    assert out["exit_code"] == code and out["message"]


def test_warm_heap_lasts_between_shard_tasks_and_ends_after_the_last(monkeypatch):
    from featstore.compute import _malloc as allocator
    from featstore.compute._shard_task import _WarmHeap

    if allocator._glibc() is None:
        pytest.skip("glibc's malloc settings only")
    monkeypatch.setattr(_WarmHeap, "LINGER_S", 0.3)
    fired = threading.Event()  # set once task 1's linger timer has run its release
    real_release = _WarmHeap.release

    def release(self, gen=None):
        real_release(self, gen)
        if gen is not None:
            fired.set()

    monkeypatch.setattr(_WarmHeap, "release", release)
    warm, base = _WarmHeap(), allocator._depth
    warm.hold(True)
    warm.linger()  # task 1 ends
    warm.hold(True)  # task 2 starts within the linger: the heap stays tuned
    assert fired.wait(60)  # task 1's timer has fired (however loaded the machine) ...
    assert allocator._depth == base + 1  # ... and released nothing: a task started since
    fired.clear()
    warm.linger()  # the last task ends
    assert fired.wait(60) and allocator._depth == base  # its timer released the heap
    warm.hold(False)  # tune_allocator=False holds nothing
    assert allocator._depth == base and warm.stack is None
