"""Peak RSS and folder sizes from ``/proc`` and ``os`` alone.

No psutil: the peers' child process (:mod:`benchmarks.peers_child`) runs in a separate
environment and uses the same sampler as every other row.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable


def rss(pid: int) -> int:
    """Resident bytes of ``pid`` (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``. Each thread lists the children it started (a Dask nanny
    starts its worker from its event-loop thread), so all of ``/proc/pid/task`` is read."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
            out += kids
            todo += kids
    return out


class RssSampler:
    """Peak RSS of this process and of its busiest descendant, sampled every ``period`` s.

    ``exclude`` pids (the moto server) are left out. Use as a context manager around one row.
    Cheap enough not to slow the row it measures (psutil's child listing scans every process
    in ``/proc``, which took a visible share of a core at 50 Hz): the descendants are listed
    every ``rescan`` s and only their RSS is read every ``period``.
    """

    def __init__(self, period: float = 0.02, exclude: Iterable[int] = (), rescan: float = 0.5) -> None:
        self.period, self.rescan = period, rescan
        self.exclude = set(exclude)
        self.main_peak = self.child_peak = 0
        self._stop = threading.Event()
        self._children: list[int] = []
        self._scanned = 0.0

    def _sample(self, scan: bool = False) -> None:
        self.main_peak = max(self.main_peak, rss(os.getpid()))
        if scan or time.monotonic() - self._scanned >= self.rescan:
            self._children = [c for c in descendants(os.getpid()) if c not in self.exclude]
            self._scanned = time.monotonic()
        for c in self._children:
            self.child_peak = max(self.child_peak, rss(c))

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def __enter__(self) -> "RssSampler":
        self._sample(scan=True)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(scan=True)


def dir_bytes(path: str) -> int:
    """Bytes of every file under ``path``."""
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
