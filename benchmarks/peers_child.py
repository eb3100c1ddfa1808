"""The LitData and Mosaic Streaming rows, run inside the peers' own virtual environment.

    <peers python> -m benchmarks.peers_child SPEC.json  ->  one JSON line of results

Imports torch, numpy, boto3, litdata and streaming only (no featstore, no zarr). The data is
A's outputs exported by the parent as .npy files, so every library stores the same values.
Each library writes with zstd, the same as featstore, and is read with shuffling on.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
import types
from typing import Any

import numpy as np
import torch

from .procfs import RssSampler, dir_bytes
from .workload import BATCH, read_only, train


def _stub_torchvision() -> None:
    """Mosaic's top-level package imports ``streaming.vision``, which imports torchvision; PyPI's
    torchvision does not import beside the torch 2.13 CPU build, and the benchmark never uses
    Mosaic's vision datasets, so an empty stand-in module satisfies that import."""
    if "torchvision" in sys.modules:
        return
    # transformers (imported by Mosaic's dataloader) probes for torchvision with find_spec:
    # import it first, so it sees that torchvision is absent rather than a stand-in
    import transformers.feature_extraction_utils  # noqa: F401
    tv = types.ModuleType("torchvision")
    ds = types.ModuleType("torchvision.datasets")
    ds.VisionDataset = torch.utils.data.Dataset
    tr = types.ModuleType("torchvision.transforms")
    fn = types.ModuleType("torchvision.transforms.functional")
    fn.to_tensor = lambda *a, **k: (_ for _ in ()).throw(NotImplementedError("stub"))
    tv.datasets, tv.transforms, tr.functional = ds, tr, fn
    sys.modules.update({"torchvision": tv, "torchvision.datasets": ds, "torchvision.transforms": tr,
                        "torchvision.transforms.functional": fn})


def _upload(local: str, endpoint: str, bucket: str, prefix: str) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint)
    s3.create_bucket(Bucket=bucket)
    for root, _, files in os.walk(local):
        for f in files:
            p = os.path.join(root, f)
            s3.upload_file(p, bucket, f"{prefix}/{os.path.relpath(p, local)}")


# ---------------------------------------------------------------------------------------------
def _litdata_sample(i: int) -> dict[str, Any]:
    # litdata runs this in processes of its own: load the arrays there (memory-mapped) on first use
    if not _DATA:
        _load(os.environ["FEATSTORE_BENCH_PEER_DATA"])
    d = _DATA
    return {"features": d["features"][i], "logits": d["logits"][i], "target": int(d["target"][i])}


_DATA: dict[str, np.ndarray] = {}


def _load(folder: str) -> None:
    for k in ("features", "logits", "target"):
        _DATA[k] = np.load(os.path.join(folder, f"{k}.npy"), mmap_mode="r")


def litdata_write(out: str, chunk_bytes: int | str = "16MB") -> float:
    from litdata import optimize

    t0 = time.perf_counter()
    optimize(fn=_litdata_sample, inputs=list(range(len(_DATA["target"]))), output_dir=out,
             chunk_bytes=chunk_bytes, compression="zstd", num_workers=1, mode="overwrite")
    return time.perf_counter() - t0


def litdata_loader(src: str, workers: int, cache: str, endpoint: str | None):
    from litdata import StreamingDataLoader, StreamingDataset

    kw: dict[str, Any] = {}
    if endpoint:
        kw["storage_options"] = {"endpoint_url": endpoint}
        kw["cache_dir"] = cache
    ds = StreamingDataset(src, shuffle=True, seed=0, **kw)
    return StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers)


def mosaic_write(out: str, size_limit: int | str = "16mb") -> float:
    _stub_torchvision()
    from streaming import MDSWriter

    cols = {"features": f"ndarray:float16:{_DATA['features'].shape[1]}",
            "logits": f"ndarray:float32:{_DATA['logits'].shape[1]}", "target": "int64"}
    t0 = time.perf_counter()
    with MDSWriter(out=out, columns=cols, compression="zstd", size_limit=size_limit) as w:
        f, lg, y = _DATA["features"], _DATA["logits"], _DATA["target"]
        for i in range(len(y)):
            w.write({"features": f[i], "logits": lg[i], "target": int(y[i])})
    return time.perf_counter() - t0


def mosaic_loader(src: str, workers: int, cache: str, endpoint: str | None):
    _stub_torchvision()
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    if endpoint:
        os.environ["S3_ENDPOINT_URL"] = endpoint
        ds = StreamingDataset(remote=src, local=cache, shuffle=True, shuffle_seed=0, batch_size=BATCH)
    else:
        ds = StreamingDataset(local=src, shuffle=True, shuffle_seed=0, batch_size=BATCH)
    return torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=workers)


def _batches(loader):
    for b in loader:
        yield b["features"], b["logits"], b["target"]


def _train_row(make: Any) -> dict[str, Any]:
    """3 epochs of B from one loader; a failure is recorded as its error text, not a row."""
    try:
        loader = make()
        with RssSampler() as pk:
            res = train(lambda e: _batches(loader))
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return {"train_s": res.seconds, "acc": res.accuracy, "main_rss": pk.main_peak, "worker_rss": pk.child_peak or None}


def run_peer(peer: str, spec: dict[str, Any]) -> dict[str, Any]:
    write, make_loader = (litdata_write, litdata_loader) if peer == "litdata" else (mosaic_write, mosaic_loader)
    work = os.path.join(spec["workdir"], peer)
    reps: list[dict[str, Any]] = []
    for rep in range(spec["repeats"]):
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        local = os.path.join(work, "data")
        r: dict[str, Any] = {"store_s": write(local), "bytes": dir_bytes(local)}
        for workers in spec["workers"]:
            r[f"local_w{workers}"] = _train_row(lambda w=workers, d=local: make_loader(d, w, "", None))
        secs, n = read_only(_batches(make_loader(local, 0, "", None)))
        r["local_read_sps"] = n / secs
        if spec.get("endpoint"):
            bucket, prefix = f"{peer}-{rep}-{os.getpid()}", "data"
            t0 = time.perf_counter()
            _upload(local, spec["endpoint"], bucket, prefix)
            r["upload_s"] = time.perf_counter() - t0
            url = f"s3://{bucket}/{prefix}"
            for workers in spec["workers"]:
                cache = os.path.join(work, f"cache-train-{workers}")
                r[f"s3_w{workers}"] = _train_row(
                    lambda w=workers, c=cache, u=url: make_loader(u, w, c, spec["endpoint"]))
            cache = os.path.join(work, "cache-read")
            secs, n = read_only(_batches(make_loader(url, 0, cache, spec["endpoint"])))
            r["s3_read_sps"] = n / secs
        reps.append(r)
    shutil.rmtree(work, ignore_errors=True)
    return {"reps": reps}


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec.get("threads", torch.get_num_threads()))
    os.environ["FEATSTORE_BENCH_PEER_DATA"] = spec["data"]
    _load(spec["data"])
    out: dict[str, Any] = {"versions": {}}
    for peer, module in (("litdata", "litdata"), ("mosaic", "streaming")):
        try:
            if peer == "mosaic":
                _stub_torchvision()
            mod = __import__(module)
            out["versions"][peer] = getattr(mod, "__version__", "?")
            out[peer] = run_peer(peer, spec)
        except Exception as exc:  # noqa: BLE001 - report any peer failure as text, never a fake row
            out[peer] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
