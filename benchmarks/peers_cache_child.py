"""LitData's and Mosaic's disk caches on the disk cache rows' workload (issue 20), run inside the
peers' own virtual environment (no featstore there).

    <peers python> -m benchmarks.peers_cache_child SPEC.json  ->  one JSON line of results

Each peer writes the workload (the parent's .npy files) as its own dataset with zstd and chunks
of ``spec["chunk_bytes"]`` (about one featstore shard's objects), uploads it to S3 directly, and
reads it through the counting proxy (:mod:`benchmarks.s3count`) for ``spec["epochs"]`` read-only
shuffled epochs, batch 256, 0 workers: first with a cache budget that holds the whole dataset,
then with half of what that cache held (each peer's own on-disk form: LitData keeps the
downloaded chunk files, Mosaic the decompressed shards). Mosaic runs once per shuffle in
``spec["mosaic_shuffles"]``. The cache options are the peers' own:
LitData ``StreamingDataset(cache_dir=, max_cache_size=)``, Mosaic ``StreamingDataset(remote=,
local=, cache_limit=)``.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time
import urllib.request
from typing import Any

import torch

from . import peers_child as pc
from .procfs import dir_bytes
from .workload import BATCH


def proxy_counts(endpoint: str) -> dict[str, int]:
    """The counting proxy's totals (see :func:`benchmarks.s3count.counts`; no featstore here)."""
    with urllib.request.urlopen(endpoint + "/__counts__", timeout=30) as r:
        return json.loads(r.read())


def litdata_loader(url: str, cache: str, budget: int, proxy: str, **_: Any) -> Any:
    from litdata import StreamingDataLoader, StreamingDataset

    ds = StreamingDataset(url, shuffle=True, seed=0, cache_dir=cache, max_cache_size=budget,
                          storage_options={"endpoint_url": proxy})
    return StreamingDataLoader(ds, batch_size=BATCH, num_workers=0)


def mosaic_loader(url: str, cache: str, budget: int, proxy: str, **shuffle: Any) -> Any:
    pc._stub_torchvision()
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    os.environ["S3_ENDPOINT_URL"] = proxy
    ds = StreamingDataset(remote=url, local=cache, cache_limit=budget, shuffle=True, shuffle_seed=0,
                          batch_size=BATCH, **shuffle)
    return torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=0)


def _epoch(loader: Any, proxy: str, cap: int) -> dict[str, Any]:
    """One drained epoch: seconds, samples, and what the server sent; stopped early (and marked
    so) once it has fetched more than ``cap`` bytes, so a thrashing cache cannot run for hours."""
    before, n, stopped = proxy_counts(proxy), 0, False
    t0 = time.perf_counter()
    for b in loader:
        n += len(b["target"])
        if proxy_counts(proxy)["get_bytes"] - before.get("get_bytes", 0) > cap:
            stopped = True
            break
    secs = time.perf_counter() - t0
    after = proxy_counts(proxy)
    return {"s": secs, "samples": n, "stopped": stopped,
            **{k: after.get(k, 0) - before.get(k, 0) for k in ("get_bytes", "gets", "lists", "heads")}}


def _budget_run(make: Any, cache: str, budget: int, spec: dict[str, Any], cap: int, **kw: Any) -> dict[str, Any]:
    """``spec["epochs"]`` epochs with a fresh cache folder; the cache's bytes after them."""
    shutil.rmtree(cache, ignore_errors=True)
    os.makedirs(cache)
    try:
        loader = make(spec["url"], cache, budget, spec["proxy"], **kw)
        epochs: list[dict[str, Any]] = []
        # A thrashing cache: two stopped epochs show it; more would only cost minutes.
        while len(epochs) < spec["epochs"] and sum(e["stopped"] for e in epochs) < 2:
            epochs.append(_epoch(loader, spec["proxy"], cap))
    except Exception as exc:  # noqa: BLE001 - a peer's failure is its row's text, never a fake figure
        return {"budget": budget, "error": f"{type(exc).__name__}: {exc}"[:500]}
    del loader
    gc.collect()
    return {"budget": budget, "epochs": epochs, "cache_bytes": dir_bytes(cache)}


def run_peer(peer: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Write, upload, then the full-budget and the half-budget runs of one peer."""
    work = os.path.join(spec["workdir"], f"cache-{peer}")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    local = os.path.join(work, "data")
    if peer == "litdata":
        pc.litdata_write(local, chunk_bytes=spec["chunk_bytes"])
        make, variants = litdata_loader, [{}]
    else:
        pc.mosaic_write(local, size_limit=spec["chunk_bytes"])
        make, variants = mosaic_loader, spec["mosaic_shuffles"]
    bucket = f"cache-{peer}-{os.getpid()}"
    pc._upload(local, spec["endpoint"], bucket, "data")
    size = dir_bytes(local)
    out: dict[str, Any] = {"dataset_bytes": size, "files": sum(len(f) for _, _, f in os.walk(local)), "runs": []}
    spec = {**spec, "url": f"s3://{bucket}/data"}
    cap = int(spec["cap_ratio"] * size)
    for i, kw in enumerate(variants):
        # A folder per run: Mosaic shares its shard states (shared memory) between datasets of
        # one local folder, so a reused folder would start from the last run's states.
        full = _budget_run(make, os.path.join(work, f"full-{i}"), 8 * size, spec, cap, **kw)
        half_budget = full.get("cache_bytes", size) // 2
        half = _budget_run(make, os.path.join(work, f"half-{i}"), half_budget, spec, cap, **kw)
        out["runs"].append({"options": kw, "full": full, "half": half})
    shutil.rmtree(work, ignore_errors=True)
    return out


if __name__ == "__main__":
    pc.main(sys.argv[1], run_peer)
