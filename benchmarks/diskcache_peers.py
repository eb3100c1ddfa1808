"""featstore's, LitData's and Mosaic's disk caches side by side (issue 20): epoch time and bytes
downloaded per epoch, with a budget that holds the whole dataset and with half of it.

Called by :mod:`benchmarks.diskcache` (``python -m benchmarks --only diskcache``). Every system
reads the same workload (the light version's values; each stores them its own way, zstd, about
one featstore shard of samples per chunk) from the same moto server through one counting proxy
(:mod:`benchmarks.s3count`, its own process), which counts the body bytes of every object GET
the server sends: the same count whatever the client. Each run: a fresh cache folder, then
:data:`EPOCHS` read-only shuffled epochs, batch 256, 0 workers. The half budget is half of what
the system's cache held after the full-budget run (its own on-disk form). The peers run in their
own environment (:mod:`benchmarks.peers_cache_child`); without it the section says so.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import numpy as np

import featstore

from . import s3count
from .peers import run_child
from .procfs import dir_bytes
from .reader import BATCH, light_outputs

EPOCHS = 4
#: An epoch that has fetched this many times its dataset is stopped (a thrashing cache).
CAP_RATIO = 3.0
#: Mosaic's shuffles tried: its default (``py1e``: with one node its block, 4M samples, spans the
#: dataset) and a shard-wise one (``py1s``, shards shuffled then the samples inside each, on one
#: canonical node: py1s's default of 64 canonical nodes interleaves 64 places of the order),
#: which reads shard by shard as featstore and LitData do.
MOSAIC_SHUFFLES = ({"shuffle_algo": "py1e"}, {"shuffle_algo": "py1s", "num_canonical_nodes": 1})


def _epochs(ds: featstore.FeatureDataset, proxy: str) -> list[dict[str, Any]]:
    out = []
    for epoch in range(EPOCHS):
        before = s3count.counts(proxy)
        ds.set_epoch(epoch)
        t0 = time.perf_counter()
        n = sum(len(b["target"]) for b in ds)
        secs = time.perf_counter() - t0
        after = s3count.counts(proxy)
        out.append({"s": secs, "samples": n, "stopped": False,
                    **{k: after.get(k, 0) - before.get(k, 0) for k in ("get_bytes", "gets", "lists", "heads")}})
    return out


def _fs_run(v: featstore.Version, cache: str, budget: int, policy: str, proxy: str) -> dict[str, Any]:
    ds = v.dataset(batch_size=BATCH, seed=0, cache="disk", cache_dir=cache, cache_bytes=budget, disk_policy=policy)
    r = {"budget": budget, "epochs": _epochs(ds, proxy), "cache_bytes": dir_bytes(cache)}
    shutil.rmtree(cache, ignore_errors=True)
    return r


def featstore_runs(s3v: featstore.Version, bucket: str, proxy: str, size: int, workdir: str) -> dict[str, Any]:
    """Per policy ('keep', 'lru'): a full-budget run, then one with half of what it cached."""
    v = featstore.open_store(f"s3://{bucket}/feats", storage_options={"endpoint_url": proxy}).open(s3v.ref)
    runs = []
    for policy in ("keep", "lru"):
        full = _fs_run(v, os.path.join(workdir, f"fs-{policy}-full"), 8 * size, policy, proxy)
        half = _fs_run(v, os.path.join(workdir, f"fs-{policy}-half"), full["cache_bytes"] // 2, policy, proxy)
        runs.append({"policy": policy, "full": full, "half": half})
    return {"dataset_bytes": size, "runs": runs}


def peer_runs(n: int, endpoint: str, proxy: str, shard: int, workdir: str) -> dict[str, Any]:
    """LitData's and Mosaic's runs in the peers' environment (``{"unavailable": why}`` without it),
    each budget run in a child process of its own."""
    data = os.path.join(workdir, "peers-cache-data")
    os.makedirs(data, exist_ok=True)
    for k, t in light_outputs(n).items():
        np.save(os.path.join(data, f"{k}.npy"), t.numpy())
    row_bytes = 512 * 2 + 1000 * 4 + 8  # features fp16 + logits fp32 + target int64: the peers' raw row
    base = {"workdir": os.path.join(workdir, "peers-cache"), "endpoint": endpoint, "proxy": proxy,
            "epochs": EPOCHS, "cap_ratio": CAP_RATIO, "threads": 1}
    try:
        out = run_child("benchmarks.peers_cache_child",
                        {**base, "task": "prepare", "data": data, "chunk_bytes": shard * row_bytes}, 900)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    if "unavailable" in out:
        return out
    for peer, variants in (("litdata", ({},)), ("mosaic", MOSAIC_SHUFFLES)):
        p = out[peer]
        p["runs"] = []
        for i, opts in enumerate(variants):
            run = {**base, **p, "task": "run", "peer": peer, "options": opts}
            full = run_child("benchmarks.peers_cache_child", {**run, "budget": 8 * p["dataset_bytes"],
                             "cache": os.path.join(base["workdir"], f"{peer}-{i}-full")}, 600)
            half = run_child("benchmarks.peers_cache_child", {**run, "budget": full.get("cache_bytes", 0) // 2,
                             "cache": os.path.join(base["workdir"], f"{peer}-{i}-half")}, 600)
            p["runs"].append({"options": opts, "full": full, "half": half})
    shutil.rmtree(base["workdir"], ignore_errors=True)
    return out


def run_all(s3v: featstore.Version, bucket: str, endpoint: str, size: int, shard: int, workdir: str,
            say: Any, peers: bool = True) -> dict[str, Any]:
    """featstore's and the peers' runs (``peers=False``: not theirs) through one counting proxy
    in front of ``endpoint``."""
    proc, proxy = s3count.start(endpoint)
    try:
        say("disk cache rows: featstore through the counting proxy")
        out = {"featstore": featstore_runs(s3v, bucket, proxy, size, workdir)}
        if not peers:
            out["peers"] = {"unavailable": "disabled by --no-peers"}
        else:
            say("disk cache rows: LitData and Mosaic (peers' environment)")
            out["peers"] = peer_runs(len(s3v), endpoint, proxy, shard, workdir)
    finally:
        proc.kill()
        proc.wait()
    return out


# -- the section -----------------------------------------------------------------------------
def _rows(res: dict[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
    """(system, run, dataset bytes) for every run that has figures."""
    out = [(f"featstore, policy '{r['policy']}'", r, res["featstore"]["dataset_bytes"])
           for r in res["featstore"]["runs"]]
    peers = res["peers"]
    for peer, name in (("litdata", "LitData"), ("mosaic", "Mosaic Streaming")):
        p = peers.get(peer) or {}
        ver = peers.get("versions", {}).get(peer, "?")
        for r in p.get("runs", []):
            opts = "".join(f", {k}={v!r}" for k, v in r.get("options", {}).items())
            out.append((f"{name} {ver}{opts}", r, p["dataset_bytes"]))
    return out


def _cell(run: dict[str, Any], size: int) -> tuple[str, str, str]:
    """(epoch 1 s, epochs 2+ s, bytes per epoch / dataset for epochs 1..)."""
    if "error" in run or "unavailable" in run:
        run = {"error": run.get("error") or run["unavailable"]}
        return "failed", "", run["error"][:160].replace("|", "/")
    ep = run["epochs"]
    later = [e["s"] for e in ep[1:]]
    frac = ", ".join(f"{e['get_bytes'] / size:.2f}" + (f"* ({e['samples']:,} samples)" if e["stopped"] else "")
                     for e in ep)
    return f"{ep[0]['s']:.2f}", f"{np.median(later):.2f}" if later else "", frac


def section_lines(res: dict[str, Any] | None) -> list[str]:
    """The side-by-side table for :func:`benchmarks.diskcache.section` (empty without results)."""
    if not res:
        return []
    lines = ["", "### Beside LitData's and Mosaic's disk caches", "",
             "Every system reads the same values from the same moto server through one counting proxy "
             "(`benchmarks/s3count.py`, its own process), which counts the body bytes of the object GETs the "
             f"server sends (the same count for every client). A fresh cache folder per run, {EPOCHS} read-only "
             "shuffled epochs, batch 256, 0 workers; *bytes / dataset* is that count over the system's dataset "
             "bytes on S3, for epochs 1 to 4. *Half budget*: half of what the system's cache held after the "
             "full-budget run (LitData `max_cache_size`, Mosaic `cache_limit`, featstore `cache_bytes`).", ""]
    if "unavailable" in res["peers"]:
        lines += [f"The peers' rows did not run: {res['peers']['unavailable'][:600]}", ""]
    lines += ["| system | dataset on S3 | budget | epoch 1 s | epochs 2+ s (median) | bytes / dataset, epochs 1–4 |",
              "|---|---|---|---|---|---|"]
    for name, run, size in _rows(res):
        for what in ("full", "half"):
            r = run[what]
            e1, e2, frac = _cell(r, size)
            budget = f"{'whole' if what == 'full' else 'half'}: {r.get('budget', 0) / 2**20:.1f} MiB"
            lines.append(f"| {name} | {size / 2**20:.1f} MiB | {budget} | {e1} | {e2} | {frac} |")
    for peer in ("litdata", "mosaic"):
        if "error" in res["peers"].get(peer, {}):
            lines += ["", f"{peer} failed: {res['peers'][peer]['error'][:400]}"]
    lines += ["", "`*`: the epoch was stopped once it had fetched "
              f"{CAP_RATIO:.0f} times its dataset (checked after every batch: a thrashing cache), with the "
              "samples it had read by then; the run ends there (the peer's download threads would go on "
              "fetching into the next epoch's count). Each peer run is a process of its own."]
    return lines
