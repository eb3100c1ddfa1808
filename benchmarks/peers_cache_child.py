"""LitData's and Mosaic's disk caches on the disk cache rows' workload (issue 20), run inside the
peers' own virtual environment (no featstore there).

    <peers python> -m benchmarks.peers_cache_child SPEC.json  ->  one JSON line of results

Each peer writes the workload (the parent's .npy files) as its own dataset with zstd and chunks
of ``spec["chunk_bytes"]`` (about one featstore shard's objects), uploads it to S3 directly, and
reads it through the counting proxy (:mod:`benchmarks.s3count`) for ``spec["epochs"]`` read-only
shuffled epochs, batch 256, 0 workers, each run in a process of its own (``spec["task"] ==
"run"``): first with a cache budget that holds the whole dataset, then with half of what that
cache held (each peer's own on-disk form: LitData keeps the
downloaded chunk files, Mosaic the decompressed shards). The parent runs Mosaic once per shuffle
it tries. The cache options are the peers' own:
LitData ``StreamingDataset(cache_dir=, max_cache_size=)``, Mosaic ``StreamingDataset(remote=,
local=, cache_limit=)``.
"""

from __future__ import annotations

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


def budget_run(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec["epochs"]`` epochs of ``spec["peer"]`` with a fresh cache folder and ``spec["budget"]``;
    the cache's bytes after them. A run ends at its first stopped epoch: the peer's download
    threads of an abandoned epoch keep fetching, which the proxy would count in the next one."""
    cache = spec["cache"]
    shutil.rmtree(cache, ignore_errors=True)
    os.makedirs(cache)
    make = litdata_loader if spec["peer"] == "litdata" else mosaic_loader
    cap = int(spec["cap_ratio"] * spec["dataset_bytes"])
    try:
        loader = make(spec["url"], cache, spec["budget"], spec["proxy"], **spec["options"])
        epochs: list[dict[str, Any]] = []
        while len(epochs) < spec["epochs"] and not any(e["stopped"] for e in epochs):
            epochs.append(_epoch(loader, spec["proxy"], cap))
    except Exception as exc:  # noqa: BLE001 - a peer's failure is its row's text, never a fake figure
        return {"budget": spec["budget"], "error": f"{type(exc).__name__}: {exc}"[:500]}
    return {"budget": spec["budget"], "epochs": epochs, "cache_bytes": dir_bytes(cache)}


def prepare(peer: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Write the workload as ``peer``'s dataset and upload it: its URL and bytes."""
    local = os.path.join(spec["workdir"], f"data-{peer}")
    shutil.rmtree(local, ignore_errors=True)
    if peer == "litdata":
        pc.litdata_write(local, chunk_bytes=spec["chunk_bytes"])
    else:
        pc.mosaic_write(local, size_limit=spec["chunk_bytes"])
    bucket = f"cache-{peer}-{os.getpid()}"
    pc._upload(local, spec["endpoint"], bucket, "data")
    out = {"url": f"s3://{bucket}/data", "dataset_bytes": dir_bytes(local),
           "files": sum(len(f) for _, _, f in os.walk(local))}
    shutil.rmtree(local, ignore_errors=True)
    return out


def main(spec_path: str) -> None:
    """``spec["task"]``: ``"prepare"`` (both peers' datasets) or ``"run"`` (one budget run); one JSON line."""
    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec.get("threads", torch.get_num_threads()))
    if spec["task"] == "run":
        print(json.dumps(budget_run(spec)))
        return
    os.environ["FEATSTORE_BENCH_PEER_DATA"] = spec["data"]
    pc._load(spec["data"])
    pc._stub_torchvision()
    out: dict[str, Any] = {"versions": {}}
    for peer, module in (("litdata", "litdata"), ("mosaic", "streaming")):
        out["versions"][peer] = getattr(__import__(module), "__version__", "?")
        out[peer] = prepare(peer, spec)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
