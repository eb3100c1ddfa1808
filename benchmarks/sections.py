"""Marked sections of ``docs/benchmarks.md``: each benchmark owns one and rewrites only it."""

from __future__ import annotations

import os


def write_marked(path: str, begin: str, end: str, text: str) -> None:
    """Put ``text`` (which starts with ``begin`` and ends with ``end``) in place of the section
    between those markers in ``path``, or append it the first time; the rest stays as it is."""
    old = open(path).read() if os.path.exists(path) else ""
    if begin in old and end in old:
        new = old[:old.index(begin)] + text.rstrip("\n") + old[old.index(end) + len(end):]
    else:
        new = old.rstrip("\n") + ("\n\n" if old else "") + text.rstrip("\n") + "\n"
    with open(path, "w") as f:
        f.write(new)
