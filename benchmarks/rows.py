"""The rows of the benchmark: classic approaches, featstore, and the limits, one repeat each.

Every function here runs one repeat and returns plain numbers; :mod:`benchmarks.run` repeats
them and takes medians. Model A, the data and Model B are the same for every row.
"""

from __future__ import annotations

import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

import featstore
from featstore.demo import ModelA, SyntheticImages
from featstore.versions import stored

from .measure import RssSampler, clock, dir_bytes
from .workload import BATCH, CLASSES, LOGITS, TrainResult, read_only, train

NAME = "bench/cnn-a"
OUTPUTS = {"features": "float16", "logits": "float32"}


@dataclass
class Ctx:
    """What every row shares: the data, Model A, folders and the S3 endpoint."""

    n: int
    workdir: str
    endpoint: str | None
    exclude_pids: tuple[int, ...] = ()
    data: SyntheticImages = field(init=False)
    model: ModelA = field(init=False)
    memory: dict[str, torch.Tensor] = field(default_factory=dict)  # A's outputs, for rows 3-4

    def __post_init__(self) -> None:
        self.data = SyntheticImages(self.n, classes=CLASSES)
        self.model = ModelA(features=512, classes=LOGITS).eval().requires_grad_(False)

    def fresh(self, what: str) -> str:
        path = os.path.join(self.workdir, f"{what}-{uuid.uuid4().hex[:8]}")
        os.makedirs(path, exist_ok=True)
        return path

    def s3_store(self) -> featstore.FeatureStore:
        import boto3

        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=bucket)
        return featstore.open_store(f"s3://{bucket}/feats", storage_options={"endpoint_url": self.endpoint})


def _row(compute_s: float, train: TrainResult | None, nbytes: int | None, rss: RssSampler | None,
         **extra: Any) -> dict[str, Any]:
    out = {"compute_s": compute_s, "train_s": train.seconds if train else None,
           "total_s": compute_s + (train.seconds if train else 0.0),
           "bytes": nbytes, "acc": train.accuracy if train else None,
           "main_rss": rss.main_peak if rss else None, "worker_rss": (rss.child_peak or None) if rss else None}
    out.update(extra)
    return out


# ---------------------------------------------------------------------------------------------
# Model A in one process: the compute limit, and the precompute of rows 3 (torch.save) and 4.
# ---------------------------------------------------------------------------------------------
def batches_of(data: Dataset, n: int, bs: int = BATCH):
    """The writer's way of reading the dataset: ``__getitems__`` per batch, default_collate."""
    for b0 in range(0, n, bs):
        yield default_collate(data.__getitems__(list(range(b0, min(b0 + bs, n)))))


def a_pure_and_save(ctx: Ctx) -> dict[str, Any]:
    """Model A over the data in this process (``inference_mode``, torch's threads), keeping the
    outputs in RAM (row 4's precompute) and, timed apart, ``torch.save`` per batch (row 3's).

    Returns the forward-loop time (the limit and row 4's compute), the save time, the folder of
    ``.pt`` files and its bytes. Row 3 stores float32 (what ``torch.save`` of A's output keeps).
    """
    folder = ctx.fresh("torchsave")
    feats, logits, targets = [], [], []
    t_save = 0.0
    with RssSampler(exclude=ctx.exclude_pids) as rss:
        t0 = clock()
        for i, b in enumerate(batches_of(ctx.data, ctx.n)):
            with torch.inference_mode():
                out = ctx.model(b["input"])
            feats.append(out["features"].half())
            logits.append(out["logits"])
            targets.append(b["target"])
            s0 = clock()
            torch.save({"features": out["features"], "logits": out["logits"], "target": b["target"]},
                       os.path.join(folder, f"batch-{i:06d}.pt"))
            t_save += clock() - s0
        total = clock() - t0
    ctx.memory = {"features": torch.cat(feats), "logits": torch.cat(logits), "target": torch.cat(targets)}
    return {"forward_s": total - t_save, "save_s": t_save, "folder": folder, "bytes": dir_bytes(folder),
            "main_rss": rss.main_peak}


def a_pure_only(ctx: Ctx, n: int | None = None) -> float:
    """Seconds of Model A over the first ``n`` samples (default all) in this thread: the
    reference for featstore's compute."""
    t0 = clock()
    for b in batches_of(ctx.data, ctx.n if n is None else min(n, ctx.n)):
        with torch.inference_mode():
            ctx.model(b["input"])
    return clock() - t0


def a_in_dask_over_main(ctx: Ctx, n: int = 5000) -> float:
    """Model A's throughput (tuned allocator) inside a task of an in-process Dask worker over
    the same loop's in this thread: what running under Dask costs before any writing."""
    from distributed import Client, LocalCluster

    from featstore.compute import tuned
    def loop() -> float:
        with tuned():
            return a_pure_only(ctx, n)

    main = loop()
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as lc, \
            Client(lc) as client:
        client.submit(loop, pure=False).result()  # warm-up
        in_dask = client.submit(loop, pure=False).result()
    return main / in_dask


def b_pure(ctx: Ctx, steps: int = 60) -> float:
    """Model B's training throughput (samples/s) on in-memory, already-batched features."""
    m = ctx.memory
    xs = [(m["features"][i:i + BATCH], m["logits"][i:i + BATCH], m["target"][i:i + BATCH])
          for i in range(0, min(ctx.n, steps * BATCH), BATCH)]
    res = train(lambda e: xs, epochs=1 + steps // max(1, len(xs)), max_steps=steps)
    return res.steps * BATCH / res.seconds


# ---------------------------------------------------------------------------------------------
# Rows 1-4: the classic approaches.
# ---------------------------------------------------------------------------------------------
class _NaiveData(Dataset):
    """Row 1: Model A called in ``__getitem__``, one sample at a time."""

    def __init__(self, data: SyntheticImages, model: torch.nn.Module) -> None:
        self.data, self.model = data, model

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        item = self.data[i]
        with torch.no_grad():
            out = self.model(item["input"][None])
        return out["features"][0].half(), out["logits"][0], item["target"]


def naive(ctx: Ctx, subset: int) -> dict[str, Any]:
    """Row 1 on ``subset`` samples for one epoch, extrapolated to N samples x 3 epochs."""
    sub = Subset(_NaiveData(ctx.data, ctx.model), range(min(subset, ctx.n)))
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(sub, batch_size=BATCH, shuffle=True, generator=g)
    with RssSampler(exclude=ctx.exclude_pids) as rss:
        res = train(lambda e: loader, epochs=1)
    scale = (ctx.n / len(sub)) * 3
    return _row(0.0, TrainResult(res.seconds * scale, float("nan"), res.steps), None, rss, extrapolated=True)


def frozen(ctx: Ctx) -> dict[str, Any]:
    """Row 2: A as a frozen submodule, run on every training step (features rounded to fp16,
    the same precision as the stored rows)."""
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(ctx.data, batch_size=BATCH, shuffle=True, generator=g)

    def batches(epoch: int):
        for b in loader:
            with torch.inference_mode():
                out = ctx.model(b["input"])
            yield out["features"].half().clone(), out["logits"].clone(), b["target"]

    with RssSampler(exclude=ctx.exclude_pids) as rss:
        res = train(batches)
    return _row(0.0, res, None, rss)


class _PtFiles(Dataset):
    """Row 3: per-batch ``.pt`` files, one ``torch.load`` (memory-mapped) per sample."""

    def __init__(self, folder: str, n: int) -> None:
        self.folder, self.n = folder, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        f, r = divmod(i, BATCH)
        d = torch.load(os.path.join(self.folder, f"batch-{f:06d}.pt"), mmap=True, weights_only=True)
        return d["features"][r].half(), d["logits"][r], d["target"][r]


def torch_save_files(ctx: Ctx, folder: str, compute_s: float, nbytes: int, subset: int) -> dict[str, Any]:
    """Row 3: train from the ``.pt`` files, per-sample loads, shuffled by the DataLoader; on
    ``subset`` samples for one epoch when that is smaller than N x 3, extrapolated."""
    ds = _PtFiles(folder, ctx.n)
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(ds, batch_size=BATCH, shuffle=True, generator=g)
    steps = max(1, subset // BATCH)
    with RssSampler(exclude=ctx.exclude_pids) as rss:
        res = train(lambda e: loader, epochs=1, max_steps=steps)
    scale = (ctx.n * 3) / (res.steps * BATCH)
    extrapolated = scale > 1.01
    tr = TrainResult(res.seconds * scale, float("nan") if extrapolated else res.accuracy, res.steps)
    return _row(compute_s, tr, nbytes, rss, extrapolated=extrapolated)


def in_memory(ctx: Ctx, compute_s: float) -> dict[str, Any]:
    """Row 4: the outputs as in-memory tensors, a shuffled index, one gather per batch."""
    m = ctx.memory

    def batches(epoch: int):
        perm = torch.randperm(ctx.n, generator=torch.Generator().manual_seed(epoch))
        for i in range(0, ctx.n, BATCH):
            idx = perm[i:i + BATCH]
            yield m["features"][idx], m["logits"][idx], m["target"][idx]

    with RssSampler(exclude=ctx.exclude_pids) as rss:
        res = train(batches)
    nbytes = sum(t.numel() * t.element_size() for t in m.values())
    return _row(compute_s, res, nbytes, rss)


class _MemoryStream(torch.utils.data.IterableDataset):
    """The in-memory tensor served through persistent DataLoader workers: the cost of the worker
    machinery itself (batches sent back through shared memory), with no storage at all."""

    def __init__(self, memory: dict[str, torch.Tensor]) -> None:
        self.memory, self.epoch = memory, -1

    def __iter__(self):
        self.epoch += 1  # each persistent worker's copy counts the epochs it served
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        n = len(self.memory["target"])
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.epoch))
        for b, i in enumerate(range(0, n, BATCH)):
            if b % nw == wid:
                idx = perm[i:i + BATCH]
                yield self.memory["features"][idx], self.memory["logits"][idx], self.memory["target"][idx]


def in_memory_workers(ctx: Ctx, workers: int = 2) -> float:
    """Limit: 3 epochs of B from the in-memory tensor through ``workers`` DataLoader workers (s)."""
    loader = DataLoader(_MemoryStream(ctx.memory), batch_size=None, num_workers=workers, persistent_workers=True)
    return train(lambda epoch: loader).seconds


# ---------------------------------------------------------------------------------------------
# Rows 5-6: featstore.
# ---------------------------------------------------------------------------------------------
def fs_compute(ctx: Ctx, store: featstore.FeatureStore) -> tuple[featstore.Version, dict[str, Any]]:
    """Compute A's outputs into ``store`` (an embedded LocalCluster, as a user gets by default)."""
    with RssSampler(exclude=ctx.exclude_pids) as rss:
        t0 = clock()
        v = store.compute(NAME, model=ctx.model, dataset=ctx.data, keep=["target"], outputs=OUTPUTS,
                          batch_size=BATCH, options=featstore.ComputeOptions(progress=False))
        wall = clock() - t0
    return v, {"compute_s": wall, "writer_s": v.manifest.timings["compute_s"],
               "main_rss": rss.main_peak, "worker_rss": rss.child_peak or None, "bytes": version_bytes(v),
               "array_bytes": {f: version_bytes(v, f) for f in v.manifest.arrays}}


def version_bytes(v: featstore.Version, field: str | None = None) -> int:
    """Bytes of the version's objects (chunks, metadata, receipts, manifest), or of one array."""
    s = stored(v).storage
    key = stored(v).key if field is None else f"{stored(v).key}/{field}"
    return int(sum(s.fs.du(s.path(key), total=False).values()))


def _fs_batches(loader: DataLoader):
    for b in loader:
        yield b["features"], b["logits"], b["target"]


def fs_loader(v: featstore.Version, workers: int, seed: int = 0) -> tuple[Any, DataLoader]:
    """featstore's reader as the README recommends: persistent workers follow ``set_epoch``."""
    ds = v.dataset(batch_size=BATCH, shuffle=True, seed=seed, fields=("features", "logits", "target"))
    return ds, DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)


def fs_train(ctx: Ctx, v: featstore.Version, workers: int) -> tuple[TrainResult, RssSampler]:
    ds, loader = fs_loader(v, workers)

    def batches(epoch: int):
        ds.set_epoch(epoch)
        return _fs_batches(loader)

    with RssSampler(exclude=ctx.exclude_pids) as rss:
        res = train(batches)
    return res, rss


def fs_read_rate(v: featstore.Version, workers: int = 0, server_pid: int | None = None) -> dict[str, float]:
    """One epoch read and decoded, no training: samples/s, seconds, and the CPU seconds it
    cost this process (the reader) and the S3 server's process (``server_pid``), which share
    the machine's cores with Model B."""
    import psutil

    def cpu(pid: int | None) -> float:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system

    ds, loader = fs_loader(v, workers)
    c0, s0 = cpu(None), cpu(server_pid) if server_pid else 0.0
    secs, n = read_only(_fs_batches(loader))
    c1, s1 = cpu(None), cpu(server_pid) if server_pid else 0.0
    return {"sps": n / secs, "secs": secs, "cpu_s": c1 - c0, "server_cpu_s": s1 - s0}


def raw_read_rate(v: featstore.Version, concurrency: int) -> tuple[float, int]:
    """Read every data object of the version whole (local read or one S3 GET each), with
    ``concurrency`` threads: (bytes/s, bytes). The ceiling for the reader's byte rate."""
    s = stored(v).storage
    fields = ("features", "logits", "target")
    keys = [p for f in fields for p in s.fs.find(s.path(f"{stored(v).key}/{f}/c"))]

    def get(path: str) -> int:
        return len(s.fs.cat_file(path))

    t0 = clock()
    with ThreadPoolExecutor(concurrency) as pool:
        total = sum(pool.map(get, keys))
    return total / (clock() - t0), total


def cleanup(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def export_for_peers(ctx: Ctx, folder: str) -> None:
    """A's outputs as .npy files, so the peers store exactly what featstore stores."""
    m = ctx.memory
    np.save(os.path.join(folder, "features.npy"), m["features"].numpy())
    np.save(os.path.join(folder, "logits.npy"), m["logits"].numpy())
    np.save(os.path.join(folder, "target.npy"), m["target"].numpy())
