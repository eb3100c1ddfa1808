"""How long the ``featstore`` command takes to start: ``featstore --help`` and ``featstore list``
beside ``python -c 'import torch'`` (what every command paid before issue 24).

Each command is a fresh process, timed from outside (start to exit), the three run in turn
(A B C A B C ...) so that a machine's drift touches them alike; the table gives the median and
the ratio to ``import torch`` measured side by side. ``list`` runs on a copy of the test store
``tests/data/store-0.1.0``.

    python -m benchmarks.cli_startup --runs 15        # writes its section of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .sections import write_marked

BEGIN, END = "<!-- cli startup (issue 24): begin -->", "<!-- cli startup (issue 24): end -->"
REPO = Path(__file__).resolve().parents[1]


def commands(store: str) -> dict[str, list[str]]:
    """The commands timed, by the name the table shows."""
    featstore = [sys.executable, "-m", "featstore"]
    return {"featstore --help": [*featstore, "--help"], "featstore list STORE": [*featstore, "list", store],
            "python -c 'import torch'": [sys.executable, "-c", "import torch"]}


def timed(argv: list[str]) -> float:
    """Wall seconds of one run of ``argv``, start to exit (output thrown away)."""
    t0 = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def measure(runs: int, store: str) -> dict[str, list[float]]:
    """``runs`` wall times per command, interleaved, after one warm-up run of each."""
    cmds = commands(store)
    for argv in cmds.values():
        timed(argv)
    out: dict[str, list[float]] = {k: [] for k in cmds}
    for _ in range(runs):
        for name, argv in cmds.items():
            out[name].append(timed(argv))
    return out


def section(res: dict[str, list[float]], load: float) -> str:
    """The docs section: median, min and max per command, and the median's ratio to import torch."""
    torch_s = statistics.median(res["python -c 'import torch'"])
    rows = [f"| `{name}` | {statistics.median(t):.2f} s | {min(t):.2f}-{max(t):.2f} s | "
            f"{statistics.median(t) / torch_s:.2f} |" for name, t in res.items()]
    runs = len(next(iter(res.values())))
    return "\n".join([
        BEGIN, "## Command-line start-up (issue 24)", "",
        f"Whole-process wall time, {runs} runs of each, interleaved (`python -m benchmarks.cli_startup`), "
        f"load average {load:.1f} at the start on {os.cpu_count()} cores (absolute times scale with it; the ratio "
        "to `import torch`, measured side by side, holds). "
        "The quick commands (`--help`, `list`, `info`, `tag`, `delete`, `gc`, `verify`, `cache`) import "
        "neither torch nor Dask, and all but `verify` (which reads the arrays) neither zarr nor numpy "
        "(tests/cli/test_cli.py checks both), so they cost a fraction of `import torch`.",
        "", "| command | median | min-max | median / import torch |", "|---|---|---|---|", *rows, "", END])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--out", default=str(REPO / "docs"), help="folder of benchmarks.md")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        shutil.copytree(REPO / "tests" / "data" / "store-0.1.0", store)
        load = os.getloadavg()[0]
        res = measure(args.runs, store)
    text = section(res, load)
    print(text)
    write_marked(os.path.join(args.out, "benchmarks.md"), BEGIN, END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
