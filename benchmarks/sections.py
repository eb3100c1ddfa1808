"""Marked sections of ``docs/benchmarks.md``: each benchmark owns one and rewrites only it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any


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


def measured(out: str, name: str, render: bool, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A benchmark's results: read back from ``out/name`` (``--render``: only rewrite the
    section), or measured now and saved there."""
    saved = os.path.join(out, name)
    if render:
        with open(saved) as f:
            return json.load(f)
    res = measure()
    with open(saved, "w") as f:
        json.dump(res, f, indent=1)
    return res
