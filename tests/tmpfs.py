"""A small tmpfs for the disk tests (a full disk, a read-only store), as root and as any user.

The tmpfs is mounted in a mount namespace of its own, held by a child process (``unshare``; for a
user other than root also a user namespace, in which that user may mount). Only that namespace
sees the mount, so nothing is left mounted on the machine if the test dies; this process, and
its Dask workers (same user), reach it through the child's root, ``/proc/<pid>/root/<path>``.
Where no namespace can be made (no ``unshare``, user namespaces disabled), root mounts it
directly; otherwise :func:`available` is False and the tests say in their id what they simulate.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

#: The shell line the holder runs: mount, say so, then wait (cat) until this process goes.
_HOLD = 'mount -t tmpfs -o "$1" tmpfs "$2" && echo mounted && exec cat'


def _unshare() -> list[str] | None:
    exe = shutil.which("unshare")
    if exe is None:
        return None
    return [exe, "--mount"] if os.geteuid() == 0 else [exe, "--user", "--map-root-user", "--mount"]


@lru_cache(maxsize=1)
def how() -> str | None:
    """How this machine gives the tests a tmpfs: ``"namespace"``, ``"mount"`` (root, directly)
    or None (neither works here)."""
    with tempfile.TemporaryDirectory() as d:
        cmd = _unshare()
        if cmd and subprocess.run([*cmd, "sh", "-c", 'mount -t tmpfs -o "$1" tmpfs "$2"', "sh", "size=4k", d],
                                  capture_output=True, timeout=60).returncode == 0:
            return "namespace"
        if os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", d],
                                                capture_output=True, timeout=60).returncode == 0:
            subprocess.run(["umount", "-l", d], capture_output=True, timeout=60)
            return "mount"
    return None


def available() -> bool:
    """Whether :func:`mounted` works on this machine, for this user."""
    return how() is not None


@contextlib.contextmanager
def mounted(path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted with ``options`` (``size=192k``, ``ro``) for the duration; yields the
    path at which this process and its children reach it."""
    path.mkdir(parents=True, exist_ok=True)
    if how() == "mount":
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True, capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
        return
    cmd = _unshare()
    assert cmd is not None and how() == "namespace", "no tmpfs on this machine: check tmpfs.available() first"
    holder = subprocess.Popen([*cmd, "sh", "-c", _HOLD, "sh", options, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = holder.stdout.readline().strip()
        assert line == "mounted", f"the tmpfs holder failed: {line!r} {holder.stderr.read() if holder.poll() else ''}"
        yield Path(f"/proc/{holder.pid}/root") / path.relative_to(path.anchor)
    finally:
        holder.stdin.close()  # cat ends, and the namespace (and its mount) with it
        holder.wait(timeout=60)
