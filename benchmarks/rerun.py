"""What a rerun costs now that it checks every item (issue 42): the demo's compute (20,000
synthetic images, the small CNN, the embedded LocalCluster), then an unchanged rerun (every
item read and digested, compared with the stored digests; nothing computed), then a rerun with
one item edited (the same check, then one shard computed, the others referenced).

One run, in order, in fresh processes' worth of state (a new store each time the script runs);
the load average is read at the start and the end. The target: the unchanged rerun's check
costs at most 0.25 of the compute it skips.

    python -m benchmarks.rerun                 # writes its section of docs/benchmarks.md
    python -m benchmarks.rerun -n 5000 --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import featstore
from featstore.demo import ModelA, SyntheticImages

from .sections import write_marked

BEGIN, END = "<!-- rerun (issue 42): begin -->", "<!-- rerun (issue 42): end -->"
REPO = Path(__file__).resolve().parents[1]


class OneEdited(torch.utils.data.Dataset):
    """``SyntheticImages(n)`` with item ``at``'s image brightened: one edited item."""

    def __init__(self, n: int, at: int) -> None:
        self.data, self.at = SyntheticImages(n), at

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = self.data[i]
        return {**item, "input": item["input"] + 0.5} if i == self.at else item


def _compute(store: featstore.FeatureStore, data: torch.utils.data.Dataset) -> tuple[featstore.Version, float]:
    t0 = time.perf_counter()
    v = store.compute("demo/cnn-a", model=ModelA(), dataset=data, keep=["target"],
                      outputs={"features": "float16", "logits": "float32"}, batch_size=256,
                      options=featstore.ComputeOptions(progress=False))
    return v, time.perf_counter() - t0


def measure(n: int) -> dict[str, object]:
    """The three calls' wall times and reports."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        store = featstore.open_store(os.path.join(tmp, "store"))
        first, t_first = _compute(store, SyntheticImages(n))
        again, t_again = _compute(store, SyntheticImages(n))
        edited, t_edited = _compute(store, OneEdited(n, n // 2 + 7))
    return {"n": n, "load_start": round(load, 2), "load_end": round(os.getloadavg()[0], 2),
            "cores": os.cpu_count(), "first_s": round(t_first, 2),
            "first_compute_s": first.manifest.timings["compute_s"],
            "unchanged_s": round(t_again, 2), "unchanged_report": again.report.to_json(),
            "edited_s": round(t_edited, 2), "edited_report": edited.report.to_json(),
            "shards": first.manifest.layout.n_shards, "same_id": again.id == first.id, "new_id": edited.id != first.id}


def section(r: dict) -> str:
    """The docs section."""
    un, ed = r["unchanged_report"], r["edited_report"]
    ratio = r["unchanged_s"] / r["first_s"]
    return "\n".join([
        BEGIN, "## What a rerun costs: every item checked (issue 42)", "",
        f"`python -m benchmarks.rerun` (one run, {r['cores']} cores, load average {r['load_start']} at the start and "
        f"{r['load_end']} at the end): the demo's Model A over {r['n']:,} synthetic images on the embedded "
        f"LocalCluster ({r['shards']} shards), then the same call again, then again with one item edited. A rerun "
        "reads and digests every item (no Model A) and compares each with the digest stored for its row "
        "(`version.report` says what it found).", "",
        "| call | wall time | Model A ran | items checked / changed | shards computed / reused | check |",  # noqa: E501
        "|---|---|---|---|---|---|",
        f"| first compute | {r['first_s']:.1f} s (compute {r['first_compute_s']:.1f} s) | yes | - | "
        f"{r['shards']} / 0 | - |",
        f"| unchanged rerun | {r['unchanged_s']:.2f} s | no | {un['items_checked']:,} / {un['items_changed']} | "
        "0 / 0 | "
        f"{un['check_s']:.2f} s |",
        f"| one item edited | {r['edited_s']:.1f} s | yes | {ed['items_checked']:,} / {ed['items_changed']} | "
        f"{ed['shards_computed']} / {ed['shards_reused']} | {ed['check_s']:.2f} s |",
        "",
        f"**The unchanged rerun costs {ratio:.3f} of the compute it skips** (whole call / whole first call; target "
        f"<= 0.25). The edited rerun's version is new ({'a new id' if r['new_id'] else 'the same id?'}) and computes "
        "only the edited item's shard; the unchanged one returns the stored version "
        f"({'the same id' if r['same_id'] else 'another id?'}).", "", END])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=20_000)
    ap.add_argument("--out", default=str(REPO / "docs"), help="folder of benchmarks.md")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    r = measure(args.n)
    print(json.dumps(r, indent=1))
    if not args.no_write:
        with open(os.path.join(args.out, "benchmarks-rerun.json"), "w") as f:
            json.dump(r, f, indent=1)
        write_marked(os.path.join(args.out, "benchmarks.md"), BEGIN, END, section(r))
    print(section(r), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
