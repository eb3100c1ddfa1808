"""Watching a compute: the progress events tasks send (one Dask topic, plain dicts) and the run
states they fold into (samples, rate, ETA, shard map). The dashboard page that shows them is a
scheduler preload with its own public name, :mod:`featstore.dashboard` (Dask imports it; no
featstore module does).
"""

from featstore.monitor._events import TOPIC, is_event
from featstore.monitor._run_state import Monitor, RunState, WorkerStats

__all__ = ["TOPIC", "Monitor", "RunState", "WorkerStats", "is_event"]
