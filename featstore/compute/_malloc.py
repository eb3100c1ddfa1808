"""glibc malloc settings for Model A's forward on CPU.

A CNN's activations are tens of MiB per batch (256 x 32 x 32 x 32 float32 is 32 MiB). With
glibc's defaults every such tensor is a fresh ``mmap``: the kernel maps and zeroes its pages on
each forward and unmaps them when it is freed, and in a worker thread (a Dask worker is one)
even smaller blocks come from per-thread heaps that glibc deletes as soon as they empty. On the
2-core machine of ``docs/benchmarks.md`` that page-fault work cost more than the convolutions
(the demo CNN: ~3,300 samples/s by default, ~8,500 with the settings below, in a thread).

:func:`tuned` keeps freed blocks in the heap for reuse while a shard task runs (large mmap
threshold, no trimming, a large top pad so thread heaps survive), then leaves the settings of
a warmed-up process (see :data:`AFTER`) and returns the free memory to the OS with
``malloc_trim``. A process whose allocator the user set up (``MALLOC_*_``, ``GLIBC_TUNABLES``,
an ``LD_PRELOAD``ed jemalloc or tcmalloc) is left alone. It is process-wide
(the embedded Dask worker is a thread of the caller's process), reference-counted across
concurrent tasks, and does nothing off glibc (macOS, musl) or when
``ComputeOptions(tune_allocator=False)``. Nothing else changes: same values, same fingerprint.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import threading
from collections.abc import Iterator

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
TUNED = {_M_MMAP_THRESHOLD: 1 << 30, _M_TRIM_THRESHOLD: (1 << 31) - 1, _M_TOP_PAD: 64 << 20}
#: Put back when the last tuned task ends. Any mallopt() switches glibc's dynamic mmap threshold
#: off for good, so its cold defaults (128 KiB) would stay fixed and make every later block over
#: 128 KiB a fresh mmap: Model B's training in the same process measured 2x slower that way.
#: These are the values the dynamic scheme reaches in a warmed-up process (threshold at its
#: 32 MiB cap, trim threshold twice that), which is where a process that ran A ends up anyway.
AFTER = {_M_MMAP_THRESHOLD: 32 << 20, _M_TRIM_THRESHOLD: 64 << 20, _M_TOP_PAD: 128 * 1024}
#: A process whose allocator the user configured is left alone. (``MALLOC_TRIM_THRESHOLD_`` is
#: not one of these: Dask sets it in every cluster's parent and worker processes; it is kept as
#: the trim threshold after the tasks instead.)
USER_SETTINGS = ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                 "LD_PRELOAD")

_lock = threading.Lock()
_depth = 0
_active = False


def _glibc() -> ctypes.CDLL | None:
    if any(os.environ.get(k) for k in USER_SETTINGS):
        return None
    return _libc()


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


def _apply(libc: ctypes.CDLL, settings: dict[int, int]) -> bool:
    return all(libc.mallopt(k, v) == 1 for k, v in settings.items())


def _trim_from_env() -> dict[int, int]:
    try:
        return {_M_TRIM_THRESHOLD: int(os.environ["MALLOC_TRIM_THRESHOLD_"])}
    except (KeyError, ValueError):
        return {}


@contextlib.contextmanager
def tuned(enabled: bool = True) -> Iterator[bool]:
    """Keep freed memory for reuse inside the block; yields whether the settings are active.

    >>> with tuned() as active:
    ...     pass  # run Model A's forward here
    """
    global _depth, _active
    libc = _glibc() if enabled else None
    if libc is None:
        yield False
        return
    with _lock:
        if _depth == 0:
            _active = _apply(libc, TUNED)
        _depth += 1
    try:
        yield _active
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _apply(libc, {**AFTER, **_trim_from_env()})
                libc.malloc_trim(0)
