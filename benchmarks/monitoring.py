"""Does watching cost compute time? The demo CNN's compute, side by side, in one run.

    python -m benchmarks.monitoring --n 20000 --repeats 3 [--before DIR]

Rows, each a fresh process per repeat and the rows interleaved (this machine is shared and
noisy, so each "after" is measured right next to its "before"):

- ``per-shard``: this checkout's default: one Dask task per shard, progress events per batch
  and shard, Fine Performance Metrics (``ComputeOptions(shards_per_task=1)``);
- ``long tasks``: this checkout with a few long tasks (two per worker, the old task layout;
  ``shards_per_task=None``), same events;
- ``before``: the code in ``--before DIR`` (a checkout of the commit before the monitoring
  change: the few long tasks, one bare progress event per batch).

The compute time is the manifest's ``timings.compute_s`` (the shard tasks, from submit to the
last receipt, without cluster start-up); results go to ``docs/monitoring.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, tempfile, time, dataclasses
import featstore
from featstore.demo import ModelA, SyntheticImages
n, per_task = int(sys.argv[1]), sys.argv[2]
fields = {f.name for f in dataclasses.fields(featstore.ComputeOptions)}
kw = {"progress": False}
if "shards_per_task" in fields:
    kw["shards_per_task"] = None if per_task == "long" else 1
with tempfile.TemporaryDirectory() as d:
    store = featstore.open_store(d)
    t0 = time.perf_counter()
    v = store.compute("demo/cnn-a", model=ModelA(), dataset=SyntheticImages(n), keep=["target"],
                      outputs={"features": "float16", "logits": "float32"}, batch_size=256,
                      options=featstore.ComputeOptions(**kw))
    wall = time.perf_counter() - t0
    print(json.dumps({"compute_s": v.manifest.timings["compute_s"], "wall_s": wall,
                      "shards": v.manifest.layout.n_shards}))
"""

REPO = Path(__file__).resolve().parent.parent


def run_once(path: Path, n: int, per_task: str) -> dict:
    """One compute in a fresh process with ``path`` first on ``PYTHONPATH``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", CHILD, str(n), per_task], env=env, capture_output=True,
                         text=True, check=True, cwd=path)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Run the rows interleaved and write docs/monitoring.json and docs/monitoring.md."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--before", type=Path, default=None, help="a checkout of the code before the change")
    p.add_argument("--out", type=Path, default=REPO / "docs")
    p.add_argument("--report-from", type=Path, default=None, help="rewrite the report from a monitoring.json")
    args = p.parse_args(argv)
    if args.report_from:
        saved = json.loads(args.report_from.read_text())
        args.n, args.repeats = saved["n"], saved["repeats"]
        write_report(args, saved["rows"])
        return 0
    rows = {"per-shard": (REPO, "shard"), "long tasks": (REPO, "long")}
    if args.before:
        rows["before"] = (args.before.resolve(), "long")
    results: dict[str, list[dict]] = {k: [] for k in rows}
    for rep in range(args.repeats):
        for label, (path, per_task) in rows.items():
            results[label].append(run_once(path, args.n, per_task))
            print(f"repeat {rep + 1}: {label}: {results[label][-1]}", file=sys.stderr)
    write_report(args, results)
    return 0


def _median(rs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rs)


def write_report(args: argparse.Namespace, results: dict[str, list[dict]]) -> None:
    """The rows' medians and ranges, and the ratios of per-shard to each other row."""
    ref = results["per-shard"]
    out = {"n": args.n, "repeats": args.repeats, "cpus": os.cpu_count(),
           "load_avg": os.getloadavg(), "rows": results,
           "ratios": {k: _median(ref, "compute_s") / _median(v, "compute_s") for k, v in results.items()
                      if k != "per-shard"},
           # each repeat's rows ran one after the other: their ratio is the least noisy figure
           "paired_ratios": {k: statistics.median(a["compute_s"] / b["compute_s"] for a, b in zip(ref, v, strict=True))
                             for k, v in results.items() if k != "per-shard"}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "monitoring.json").write_text(json.dumps(out, indent=2))
    lines = [f"| row | compute s (median, min–max of {args.repeats}) | wall s incl. start-up | shards |",
             "|---|---|---|---|"]
    for k, rs in results.items():
        cs = [r["compute_s"] for r in rs]
        lines.append(f"| {k} | {statistics.median(cs):.2f} ({min(cs):.2f}–{max(cs):.2f}) | "
                     f"{_median(rs, 'wall_s'):.2f} | {rs[0]['shards']} |")
    lines.append("")
    lines.extend(f"per-shard / {k}: **{out['paired_ratios'][k]:.3f}** (median of the per-repeat ratios; "
                 f"ratio of the medians {r:.3f}; < 1 is faster)" for k, r in out["ratios"].items())
    (args.out / "monitoring-table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
