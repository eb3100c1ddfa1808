"""featstore's page in the Dask dashboard, its scheduler plugin and its Prometheus metrics.

A Dask scheduler preload: importing this module adds the page
``/individual-featstore`` to the dashboard (listed under "More..." and in
``/individual-plots.json``, so JupyterLab's Dask extension lists it too), and ``dask_setup``
installs the :class:`FeatstorePlugin`, which folds the events computes send (see
:mod:`featstore.monitor`) into a :class:`~featstore.monitor.Monitor`, and a collector that adds
featstore's numbers to the scheduler's ``/metrics``. On a cluster of your own::

    dask scheduler --preload featstore.dashboard

The embedded cluster of :func:`featstore.FeatureStore.compute` preloads it itself. The writer
never imports this module: it only sends events.
"""

from __future__ import annotations

import html
import math
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Literal

from distributed.diagnostics.plugin import SchedulerPlugin

from featstore.monitor._events import PAGE, PLUGIN, TOPIC
from featstore.monitor._run_state import DONE, RUNNING, Monitor, RunSnapshot, RunState

if TYPE_CHECKING:
    from bokeh.document import Document
    from distributed import Scheduler
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

REFRESH_MS = 500


class FeatstorePlugin(SchedulerPlugin):
    """Keeps a :class:`Monitor` of the computes whose events reach this scheduler."""

    name = PLUGIN

    def __init__(self) -> None:
        self.monitor = Monitor()

    def log_event(self, topic: str, msg: object) -> None:
        if topic == TOPIC:
            self.monitor.apply(msg)


def plugin_of(scheduler: Scheduler) -> FeatstorePlugin | None:
    """The scheduler's featstore plugin, if it has one."""
    plugin = getattr(scheduler, "plugins", {}).get(PLUGIN)
    return plugin if isinstance(plugin, FeatstorePlugin) else None


def install(scheduler: Scheduler) -> FeatstorePlugin:
    """Add the plugin to ``scheduler`` (once) and its numbers to ``/metrics``."""
    plugin = plugin_of(scheduler)
    if plugin is None:
        plugin = FeatstorePlugin()
        scheduler.add_plugin(plugin, name=PLUGIN)
    _MONITORS[scheduler] = plugin.monitor
    _register_collector()
    return plugin


def dask_setup(scheduler: Scheduler) -> None:
    """The preload hook Dask calls when the scheduler starts."""
    install(scheduler)


# ---------------------------------------------------------------------------------------------
# The page.
# ---------------------------------------------------------------------------------------------
def _fmt_eta(s: float) -> str:
    if not math.isfinite(s):
        return "unknown"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _cell(field: str, value: object, text: str | None = None) -> str:
    """A table cell that carries its raw value, so a browser test reads numbers, not text."""
    raw = html.escape(str(value), quote=True)
    return f'<td data-field="{field}" data-value="{raw}">{html.escape(text if text is not None else str(value))}</td>'


def _device(info: Mapping[str, object]) -> str:
    name = str(info.get("device_name") or info.get("device") or "?")
    mem, total = info.get("gpu_mem"), info.get("gpu_mem_total")
    if isinstance(mem, (int, float)) and isinstance(total, (int, float)) and total:
        name += f", {_fmt_bytes(mem)} / {_fmt_bytes(total)}"
    if info.get("gpu_util") is not None:
        name += f", {info['gpu_util']}% busy"
    return name


_RUN_COLUMNS = ("compute", "status", "samples done / total", "samples/s", "ETA", "written (before compression)",
                "shards done / in flight / to do", "non-finite", "max codec error")


def runs_html(snaps: list[RunSnapshot]) -> str:
    """The runs table (and each run's workers) as HTML."""
    if not snaps:
        return ("<p data-field='empty'>No featstore compute has reported to this scheduler yet. "
                "Computes send their progress here while they run.</p>")
    head = "".join(f"<th>{c}</th>" for c in _RUN_COLUMNS)
    rows = []
    for s in snaps:
        pct = 100.0 * s["samples_done"] / max(s["samples"], 1)
        rows.append(
            f"<tr data-run='{html.escape(s['run'])}'>"
            + _cell("ref", f"{s['name']}@{s['version']}")
            + _cell("status", s["status"], s["status"] + (f": {s['error']}" if s["error"] else ""))
            + _cell("samples_done", s["samples_done"], f"{s['samples_done']:,} / {s['samples']:,} ({pct:.1f}%)")
            + _cell("rate", round(s["rate"], 1), f"{s['rate']:,.0f}")
            + _cell("eta_s", round(s["eta_s"], 1) if math.isfinite(s["eta_s"]) else "inf", _fmt_eta(s["eta_s"]))
            + _cell("bytes_written", s["bytes_written"], _fmt_bytes(s["bytes_written"]))
            + _cell("shards", s["shards_done"], f"{s['shards_done']} / {s['shards_running']} / {s['shards_todo']}")
            + _cell("nonfinite", s["nonfinite"])
            + _cell("max_abs_error", s["max_abs_error"], f"{s['max_abs_error']:.3g}")
            + "</tr>")
    return (f"<h3>featstore computes</h3><table class='featstore-runs'><tr>{head}</tr>{''.join(rows)}</table>"
            + "".join(_workers_html(s) for s in snaps[:1]))


def _number(value: object) -> float:
    """A worker's number as its snapshot holds it (0 where it holds none)."""
    return value if isinstance(value, (int, float)) else 0.0


def _workers_html(s: RunSnapshot) -> str:
    rows = "".join(
        f"<tr data-worker='{html.escape(a)}'>" + _cell("worker", a) + _cell("device", _device(w))
        + _cell("worker_samples", w["samples"], f"{_number(w['samples']):,}")
        + _cell("worker_rate", round(_number(w["rate"]), 1), f"{_number(w['rate']):,.0f}") + "</tr>"
        for a, w in sorted(s["workers"].items()))
    return (f"<h4>Workers of {html.escape(s['name'])}@{html.escape(s['version'])}</h4>"
            "<table class='featstore-workers'><tr><th>worker</th><th>device</th><th>samples</th>"
            f"<th>samples/s</th></tr>{rows}</table>")


_STYLE = """<style>
table { border-collapse: collapse; font: 13px sans-serif; margin: 4px 0 12px 0; }
th, td { border-bottom: 1px solid #ddd; padding: 3px 10px; text-align: right; }
th { background: #f2f2f2; }
td:first-child, th:first-child { text-align: left; }
</style>"""

_COLORS = {DONE: "#2ca02c", RUNNING: "#ff7f0e"}
_TODO_COLOR = "#d9d9d9"


def _shard_map(state: RunState) -> dict[str, list[int] | list[str]]:
    n = len(state.shard_state)
    cols = max(1, math.ceil(math.sqrt(n * 4)))
    return {"x": [i % cols for i in range(n)], "y": [-(i // cols) for i in range(n)],
            "shard": list(range(n)), "state": list(state.shard_state),
            "color": [_COLORS.get(s, _TODO_COLOR) for s in state.shard_state]}


def featstore_doc(scheduler: Scheduler, extra: dict[str, object], doc: Document) -> None:
    """The Bokeh document of the page (Dask calls it once per browser session)."""
    from bokeh.layouts import column
    from bokeh.models import ColumnDataSource, HoverTool
    from bokeh.models.widgets.markups import Div  # where bokeh's stubs declare it
    from bokeh.plotting import figure

    plugin = plugin_of(scheduler)
    summary = Div(text=_STYLE, name="featstore-summary", sizing_mode="stretch_width")
    source = ColumnDataSource({"x": [], "y": [], "shard": [], "state": [], "color": []})
    fig = figure(title="Shard map of the newest compute (green done, orange in flight, grey to do)",
                 height=260, sizing_mode="stretch_width", tools="", toolbar_location=None,
                 x_axis_type=None, y_axis_type=None, name="featstore-shards")
    fig.rect("x", "y", 0.9, 0.9, source=source, color="color")
    fig.add_tools(HoverTool(tooltips=[("shard", "@shard"), ("state", "@state")]))
    fig.grid.visible = False

    def update() -> None:
        if plugin is None:
            summary.text = ("<p>The featstore scheduler plugin is not installed: start the scheduler "
                            "with <code>dask scheduler --preload featstore.dashboard</code>.</p>")
            return
        now = time.time()
        summary.text = _STYLE + runs_html(plugin.monitor.snapshots(now))
        newest = next(reversed(plugin.monitor.runs.values()), None)
        if newest is not None:
            source.data = _shard_map(newest)

    update()
    doc.add_periodic_callback(update, REFRESH_MS)
    doc.add_root(column(summary, fig, sizing_mode="stretch_width"))
    doc.title = "Dask: featstore"


# ---------------------------------------------------------------------------------------------
# /metrics: Prometheus reads the monitors of this process's schedulers.
# ---------------------------------------------------------------------------------------------
_MONITORS: weakref.WeakKeyDictionary[Scheduler, Monitor] = weakref.WeakKeyDictionary()
_COLLECTOR: list[_Collector] = []
#: The snapshot's numbers ``/metrics`` serves, one family each.
_Number = Literal["samples_done", "samples", "rate", "eta_s", "bytes_written", "nonfinite"]


class _Collector:
    """featstore's counters and gauges, one series per compute (labels name, version)."""

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["name", "version"]
        fams: dict[_Number, GaugeMetricFamily | CounterMetricFamily] = {
            "samples_done": GaugeMetricFamily("featstore_samples_done", "Samples computed and stored", labels=labels),
            "samples": GaugeMetricFamily("featstore_samples_total", "Samples in the compute", labels=labels),
            "rate": GaugeMetricFamily("featstore_samples_per_second", "Recent samples per second", labels=labels),
            "eta_s": GaugeMetricFamily("featstore_eta_seconds", "Seconds left at the recent rate", labels=labels),
            "bytes_written": CounterMetricFamily("featstore_bytes_written", "Bytes of shards written", labels=labels),
            "nonfinite": CounterMetricFamily("featstore_nonfinite_samples", "Samples with NaN/Inf", labels=labels),
        }
        shards = GaugeMetricFamily("featstore_shards", "Shards by state", labels=[*labels, "state"])
        running = GaugeMetricFamily("featstore_running", "1 while the compute runs", labels=labels)
        failed = CounterMetricFamily("featstore_errors", "Computes that failed", labels=labels)
        now = time.time()
        for scheduler, monitor in list(_MONITORS.items()):
            if str(getattr(scheduler, "status", "")).endswith(("closed", "closing")):
                continue  # an earlier embedded cluster of this process
            for s in monitor.snapshots(now):
                lv = [s["name"], s["version"]]
                for key, fam in fams.items():
                    fam.add_metric(lv, s[key])
                for state, n in (("done", s["shards_done"]), ("running", s["shards_running"]),
                                 ("todo", s["shards_todo"])):
                    shards.add_metric([*lv, state], n)
                running.add_metric(lv, 1.0 if s["status"] == "running" else 0.0)
                failed.add_metric(lv, 1.0 if s["status"] == "failed" else 0.0)
        yield from (*fams.values(), shards, running, failed)


def _register_collector() -> None:
    """Register once per process: Dask's ``/metrics`` serves the global registry."""
    if _COLLECTOR:
        return
    try:
        from prometheus_client import REGISTRY
    except ImportError:  # Dask then serves a "not available" note on /metrics
        return
    _COLLECTOR.append(_Collector())
    REGISTRY.register(_COLLECTOR[0])


def _register_page() -> None:
    from distributed.dashboard.scheduler import applications

    applications.setdefault(PAGE, featstore_doc)


_register_page()
