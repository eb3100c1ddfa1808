"""Keep Dask's 40-line "Compute Failed" report of a featstore task off the user's console.

When a task raises, the Dask worker logs the whole task and traceback at ERROR level before
the driver re-raises featstore's own, clearer error. :func:`quiet_task_failures` filters those
records from the console handlers of the ``distributed`` logger only: Dask's own log (the
worker's log deque, shown by the dashboard and ``Client.get_worker_logs``) keeps them.
As a Dask worker preload (``dask_setup``) it does the same in worker processes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distributed import Worker

#: Task keys of featstore's computes start with this.
KEY_PREFIX = "featstore-"


class TaskFailureFilter(logging.Filter):
    """Drops the worker's "Compute Failed" record of a featstore task."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if not msg.startswith("Compute Failed"):
            return True
        args = record.args if isinstance(record.args, tuple) else ()  # (key, ...): how the worker logs it
        return not (args and str(args[0]).startswith(("('" + KEY_PREFIX, KEY_PREFIX)))


_FILTER = TaskFailureFilter()


def quiet_task_failures() -> None:
    """Install the filter on every console handler of ``distributed``'s loggers (idempotent)."""
    for name in ("distributed", "distributed.worker"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler) \
                    and type(handler).__name__ != "DequeHandler" and _FILTER not in handler.filters:
                handler.addFilter(_FILTER)


def dask_setup(worker: Worker) -> None:
    """Worker preload hook: quiet this worker process's console too."""
    quiet_task_failures()
