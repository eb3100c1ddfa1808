"""Watching a compute: the progress events tasks send (one Dask topic, plain dicts) and the run
states they fold into (samples, rate, ETA, shard map). The dashboard page that shows them is a
scheduler preload with its own public name, :mod:`featstore.dashboard` (Dask imports it; no
featstore module does).
"""

from typing import TYPE_CHECKING

from featstore._lazy import lazy_exports
from featstore.monitor._events import (PAGE, PLUGIN, TOPIC, DeviceInfo, Event, batch_done, is_event, run_ended,
                                       run_started, shard_started, shard_written)
from featstore.monitor._run_state import Monitor, RunState, WorkerStats

if TYPE_CHECKING:  # the page and plugin import Dask's scheduler and Bokeh: imported when first asked for
    from featstore.monitor._dashboard import (FeatstorePlugin, dask_setup, featstore_doc, install, plugin_of,
                                              runs_html)

__getattr__, __dir__ = lazy_exports(__name__, {name: "_dashboard" for name in (
    "FeatstorePlugin", "dask_setup", "featstore_doc", "install", "plugin_of", "runs_html")})

__all__ = ["PAGE", "PLUGIN", "TOPIC", "DeviceInfo", "Event", "FeatstorePlugin", "Monitor", "RunState", "WorkerStats",
           "batch_done", "dask_setup", "featstore_doc", "install", "is_event", "plugin_of", "run_ended",
           "run_started", "runs_html", "shard_started", "shard_written"]
