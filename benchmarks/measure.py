"""Measuring helpers: repeated timings, memory-copy bandwidth; peak RSS and sizes live in
:mod:`benchmarks.procfs` (re-exported here)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass

from .procfs import RssSampler, dir_bytes

__all__ = ["RssSampler", "Stat", "clock", "dir_bytes", "memcopy_gbps"]


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
