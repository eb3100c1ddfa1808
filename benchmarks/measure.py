"""Measuring helpers: repeated timings, peak RSS of this process and its children, sizes."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Stat:
    """Median, min and max of repeated measurements."""

    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> "Stat":
        v = [float(x) for x in values]
        return cls(statistics.median(v), min(v), max(v), len(v))

    def fmt(self, digits: int = 2) -> str:
        return f"{self.median:.{digits}f} ({self.lo:.{digits}f}-{self.hi:.{digits}f})"


class RssSampler:
    """Peak RSS of the main process and of its busiest child, sampled every ``period`` s.

    ``exclude`` pids (the moto server) are left out. Use as a context manager around one row.
    Cheap enough not to slow the row it measures: listing the children scans every process in
    ``/proc`` (psutil's ppid map), so the list is refreshed every ``rescan`` s and only the
    known processes' RSS is read every ``period``.
    """

    def __init__(self, period: float = 0.02, exclude: Iterable[int] = (), rescan: float = 0.5) -> None:
        self.period = period
        self.rescan = rescan
        self.exclude = set(exclude)
        self.main_peak = 0
        self.child_peak = 0
        self._stop = threading.Event()
        self._proc = psutil.Process(os.getpid())
        self._children: list[psutil.Process] = []
        self._scanned = 0.0

    def _sample(self, scan: bool = False) -> None:
        try:
            self.main_peak = max(self.main_peak, self._proc.memory_info().rss)
            if scan or time.monotonic() - self._scanned >= self.rescan:
                self._children = [c for c in self._proc.children(recursive=True) if c.pid not in self.exclude]
                self._scanned = time.monotonic()
            for c in self._children:
                try:
                    self.child_peak = max(self.child_peak, c.memory_info().rss)
                except psutil.Error:
                    pass
        except psutil.Error:
            pass

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
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def clock() -> float:
    return time.perf_counter()


def memcopy_gbps(size: int = 256 * 2**20, repeats: int = 5) -> float:
    """Memory-copy bandwidth (GB/s of bytes copied) with numpy, best of ``repeats``."""
    import numpy as np

    a = np.ones(size, dtype=np.uint8)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        np.copyto(b, a)
        best = min(best, clock() - t0)
    return size / best / 1e9
