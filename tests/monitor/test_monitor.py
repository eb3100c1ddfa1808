"""The dashboard's bookkeeping (featstore.monitor) and page HTML, fed with events by hand."""

from __future__ import annotations

import math

from featstore.monitor import _events as events
from featstore.monitor._run_state import Monitor


def _run(m: Monitor, now: float = 100.0) -> None:
    m.apply(events.run_started("r1", "a/b", "v1", samples=1000, samples_per_shard=300, shards_done=[3],
                               url="/tmp/x"), now)


def test_progress_counts_each_shard_once_even_when_a_shard_starts_again():
    m = Monitor()
    _run(m)
    s = m.snapshots(100.0)[0]
    assert (s["samples"], s["samples_done"], s["shards_todo"], s["shards_done"]) == (1000, 100, 3, 1)
    assert math.isinf(s["eta_s"])
    m.apply(events.shard_started("r1", "w1", 0, {"device": "cpu", "device_name": "CPU"}), 101.0)
    m.apply(events.batch_done("r1", "w1", 0, 200), 102.0)
    m.apply(events.shard_started("r1", "w2", 0, {"device": "cpu"}), 103.0)  # w1 died; Dask reran shard 0
    m.apply(events.batch_done("r1", "w2", 0, 200), 104.0)
    s = m.snapshots(104.0)[0]
    assert s["samples_done"] == 300 and s["shards_running"] == 1
    m.apply(events.batch_done("r1", "w2", 0, 100), 105.0)
    m.apply(events.shard_written("r1", "w2", 0, 4096, nonfinite=2, max_abs_error=1e-3), 105.0)
    s = m.snapshots(105.0)[0]
    assert (s["samples_done"], s["shards_done"], s["bytes_written"], s["nonfinite"]) == (400, 2, 4096, 2)
    assert s["rate"] > 0 and math.isfinite(s["eta_s"]) and s["eta_s"] > 0
    assert s["workers"]["w2"]["samples"] == 300 and s["workers"]["w1"]["device_name"] == "CPU"
    # A late duplicate receipt (a speculative rerun) is not counted twice.
    m.apply(events.shard_written("r1", "w1", 0, 4096, 0, 0.0), 106.0)
    assert m.snapshots(106.0)[0]["bytes_written"] == 4096


def test_end_and_foreign_events():
    m = Monitor(keep_finished=1)
    _run(m)
    m.apply({"kind": "batch"}, 101.0)  # no run id: not ours
    m.apply("hello", 101.0)
    m.apply(events.batch_done("r1", "w", 99, 10), 101.0)  # no such shard
    m.apply(events.run_ended("r1", "failed", "Model A raised ValueError"), 102.0)
    s = m.snapshots(103.0)[0]
    assert s["status"] == "failed" and "ValueError" in s["error"] and s["eta_s"] == 0.0
    m.apply(events.run_started("r2", "a/b", "v2", 10, 10, [], ""), 104.0)
    m.apply(events.run_ended("r2", "committed"), 105.0)
    m.apply(events.run_started("r3", "a/b", "v3", 10, 10, [], ""), 106.0)
    assert list(m.runs) == ["r2", "r3"]  # one finished run kept, the running one always


def test_page_html_marks_raw_values_and_escapes_names():
    from featstore.dashboard import runs_html

    m = Monitor()
    m.apply(events.run_started("r1", "<b>x</b>", "v1", 10, 10, [], ""), 1.0)
    text = runs_html(m.snapshots(2.0))
    assert "<b>x</b>" not in text and "&lt;b&gt;x&lt;/b&gt;" in text
    assert 'data-field="samples_done" data-value="0"' in text and 'data-field="eta_s" data-value="inf"' in text
    assert "No featstore compute" in runs_html([])


def test_views_number_shards_view_major_and_count_every_view():
    m = Monitor()
    # 1000 samples per view in shards of 300 (the last holds 100), 2 views: 8 (view, shard) units
    m.apply(events.run_started("r2", "a/b", "v2", samples=1000, samples_per_shard=300, shards_done=[3, 4],
                               url="/tmp/x", views=2), 100.0)
    s = m.snapshots(100.0)[0]
    assert (s["samples"], s["samples_done"], s["shards_todo"], s["shards_done"]) == (2000, 400, 6, 2)
    m.apply(events.shard_written("r2", "w1", 7, 4096, nonfinite=0, max_abs_error=0.0), 101.0)  # view 1, shard 3
    s = m.snapshots(101.0)[0]
    assert (s["samples_done"], s["shards_done"]) == (500, 3)
