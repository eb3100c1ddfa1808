"""The reader's rows (issue 12): byte rates against raw reads, a light Model B against the
in-memory tensor with and without ``cache="memory"``, memory with 2 workers, S3 clients.

    python -m benchmarks --only reader      # these rows alone; updates their section of docs/benchmarks.md

Workload: N samples of 512 float16 features (post-ReLU Gaussians: half zeros, like a CNN's) +
1000 float32 logits + an int64 target, written by featstore's real writer from a replay Model A
(:mod:`benchmarks.memory`). The light Model B is an MLP 512 -> 256 -> 10 trained with Adam on
features and target (the logits are read with every batch, as a distillation loop would, and
not used), batch 256, 3 shuffled epochs, 0 DataLoader workers. Every featstore figure is paired
with its reference measured right before it.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

import featstore
from featstore.versions import stored

from .memory import Replay, ReplayData
from .procfs import descendants
from .rows import raw_read_rate
from .sections import write_marked

BATCH = 256
EPOCHS = 3
#: Light-B pairs per thread setting and repeat: B's times move by +-20% between runs on a shared
#: 2-core machine, and the run that comes second in a pair tends to be slower, so the pairs
#: alternate their order (reference first, then featstore first).
PAIRS = 4
#: S3 reader epochs per repeat, each next to a raw GET pass (moto shares the 2 cores).
S3_PAIRS = 2
#: Local read-only epochs per repeat, each next to a raw read pass and an in-memory epoch.
LOCAL_PAIRS = 3
FIELDS = ("features", "logits", "target")


def light_outputs(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"features": torch.relu(torch.randn(n, 512, generator=g)).half(),
            "logits": torch.randn(n, 1000, generator=g), "target": torch.randint(0, 10, (n,), generator=g)}


def write_light(store: featstore.FeatureStore, memory: dict[str, torch.Tensor], compression: str,
                samples_per_shard: int | None = None, client: Any = None) -> featstore.Version:
    """The light workload as a version (features stored float16, as the in-memory tensor);
    ``client``: a Dask cluster to run on (None: the embedded default, started per call)."""
    n = len(memory["target"])
    return store.compute(f"light/{compression}", model=Replay(), dataset=ReplayData(memory, n), input_key=None,
                         keep=["target"], outputs={"features": "float16", "logits": "float32"},
                         batch_size=BATCH, samples_per_shard=samples_per_shard, client=client,
                         options=featstore.ComputeOptions(
                             progress=False, dataset_id=f"light-{n}", compression=compression))


# -- Model B and the two ways of feeding it --------------------------------------------------
def train_light(batches: Any, epochs: int = EPOCHS) -> float:
    """Seconds for ``epochs`` of the light B on ``batches(epoch)`` (reading included)."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    ce = nn.CrossEntropyLoss()
    t0 = time.perf_counter()
    for epoch in range(epochs):
        for f, _logits, y in batches(epoch):
            loss = ce(net(f.float()), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return time.perf_counter() - t0


def memory_batches(m: dict[str, torch.Tensor], select: bool = False) -> Any:
    """Shuffled batches of the in-memory tensors, indexed as a training loop does
    (``tensor[idx]``); ``select=True``: with ``torch.index_select`` (a faster kernel for rows)."""
    def batches(epoch: int):
        perm = torch.randperm(len(m["target"]), generator=torch.Generator().manual_seed(epoch))
        for i in range(0, len(perm), BATCH):
            idx = perm[i:i + BATCH]
            if select:
                yield tuple(torch.index_select(m[k], 0, idx) for k in FIELDS)
            else:
                yield m["features"][idx], m["logits"][idx], m["target"][idx]
    return batches


def featstore_batches(ds: featstore.FeatureDataset, loader: Any = None) -> Any:
    def batches(epoch: int):
        ds.set_epoch(epoch)
        for b in (loader if loader is not None else ds):
            yield b["features"], b["logits"], b["target"]
    return batches


def read_only(batches: Any) -> tuple[float, float]:
    """(seconds, CPU seconds of this process) to drain one epoch: no training."""
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in batches(0):
        pass
    return time.perf_counter() - t0, time.process_time() - c0


@contextlib.contextmanager
def torch_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# -- memory with 2 workers --------------------------------------------------------------------
def _smaps(pid: int) -> dict[str, int]:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.split()[-1] == "kB"}
    except OSError:
        return {}


def footprint(pids: list[int], shm_folder: str | None) -> int:
    """Bytes these processes hold, shared pages split between their users (PSS), with the
    shared cache counted once as its folder's size instead of per mapping."""
    total = 0
    for pid in pids:
        s = _smaps(pid)
        total += s.get("Pss", 0) - s.get("Pss_Shmem", 0)
    if shm_folder and os.path.isdir(shm_folder):
        total += sum(os.path.getsize(os.path.join(shm_folder, n)) for n in os.listdir(shm_folder))
    return total


class _Zeros(torch.utils.data.IterableDataset):
    """Batches of zeros shaped like the workload's: the footprint of the worker machinery."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for b, i in enumerate(range(0, self.n, BATCH)):
            if b % nw == wid:
                k = min(BATCH, self.n - i)
                yield {"features": torch.zeros(k, 512, dtype=torch.float16), "logits": torch.zeros(k, 1000),
                       "target": torch.zeros(k, dtype=torch.int64)}


def workers_footprint(ds: Any, epochs: int = EPOCHS) -> tuple[int, float]:
    """Footprint of this process and 2 persistent workers after ``epochs`` of the light B."""
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True, timeout=300)
    if isinstance(ds, featstore.FeatureDataset):
        secs = train_light(featstore_batches(ds, loader), epochs)
        folder = ds.process_reads().memory.folder if ds.options.cache else None
    else:
        secs = train_light(lambda e: ((b["features"], b["logits"], b["target"]) for b in loader), epochs)
        folder = None
    fp = footprint([os.getpid(), *descendants(os.getpid())], folder)
    loader = None  # noqa: F841 - its persistent workers exit with it
    return fp, secs


# -- S3 clients -------------------------------------------------------------------------------
def s3_clients(v: featstore.Version, endpoint: str, concurrency: int = 4,
               only: tuple[str, ...] | None = None) -> dict[str, float]:
    """Bytes/s of whole-object GETs of the version's data objects through s3fs, boto3 and
    obstore (when installed; ``only``: those clients), ``concurrency`` threads each, and each
    client's CPU seconds."""
    import boto3

    s = stored(v).storage
    keys = [p for f in FIELDS for p in s.fs.find(s.path(f"{stored(v).key}/{f}/c"))]
    bucket = keys[0].split("/", 1)[0]
    b3 = boto3.client("s3", endpoint_url=endpoint)
    getters = {"s3fs": lambda p: len(s.fs.cat_file(p)),
               "boto3": lambda p: len(b3.get_object(Bucket=bucket, Key=p.split("/", 1)[1])["Body"].read())}
    try:
        import obstore
        from obstore.store import S3Store

        ob = S3Store(bucket, endpoint=endpoint, region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
                     client_options={"allow_http": True})
        getters["obstore"] = lambda p: len(memoryview(obstore.get(ob, p.split("/", 1)[1]).bytes()))
    except ImportError:
        pass
    out = {}
    for name, get in getters.items():
        if only is not None and name not in only:
            continue
        c0, t0 = time.process_time(), time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            nbytes = sum(pool.map(get, keys))
        out[f"{name}_bps"] = nbytes / (time.perf_counter() - t0)
        out[f"{name}_cpu_s"] = time.process_time() - c0
    return out


# -- one repeat -------------------------------------------------------------------------------
_LIGHT_RUNS = ("mem_ref", "fs", "mem_ref_cache", "fs_cache")


def _light_run(run: str, v: featstore.Version, m: dict[str, torch.Tensor]) -> float:
    """Seconds of 3 epochs of the light B fed one way (``_LIGHT_RUNS``)."""
    if run.startswith("mem_ref"):
        return train_light(memory_batches(m))
    if run == "fs":
        return train_light(featstore_batches(v.dataset(batch_size=BATCH, seed=0)))
    ds = v.dataset(batch_size=BATCH, seed=0, cache="memory", cache_bytes=2**30)
    ds.clear_cache()  # epoch 1 included: it starts cold
    try:
        return train_light(featstore_batches(ds))
    finally:
        ds.clear_cache()


def _local_rows(v: featstore.Version, vz: featstore.Version, m: dict[str, torch.Tensor]) -> dict[str, Any]:
    r: dict[str, Any] = {"stored_bytes": _bytes(v),
                         "decoded_bytes": sum(t.numel() * t.element_size() for t in m.values())}
    r["crc_s"] = crc_all(v)
    r["local_pairs"] = []
    for i in range(LOCAL_PAIRS):  # each shuffled epoch next to a raw read and the in-memory epoch, alternating
        p: dict[str, float] = {}
        for what in (("raw", "mem", "fs") if i % 2 == 0 else ("fs", "mem", "raw")):
            if what == "raw":
                p["raw_bps"], _ = raw_read_rate(v, concurrency=4)
            elif what == "mem":
                p["mem_read_s"], p["mem_read_cpu_s"] = read_only(memory_batches(m))
            else:
                p["fs_read_s"], p["fs_read_cpu_s"] = read_only(featstore_batches(v.dataset(batch_size=BATCH, seed=0)))
        r["local_pairs"].append(p)
    for k in ("raw_bps", "mem_read_s", "mem_read_cpu_s", "fs_read_s", "fs_read_cpu_s"):
        r[k] = float(np.median([p[k] for p in r["local_pairs"]]))
    r["fs_seq_read_s"], _ = read_only(featstore_batches(v.dataset(batch_size=BATCH, seed=0, shuffle=False)))
    with _env("FEATSTORE_ARENA", "0"):  # the gather as it was: numpy, shard by shard
        r["fs_pershard_read_s"], _ = read_only(featstore_batches(v.dataset(batch_size=BATCH, seed=0)))
    r["mem_sel_read_s"], _ = read_only(memory_batches(m, select=True))
    r["zstd_read_s"], r["zstd_read_cpu_s"] = read_only(featstore_batches(vz.dataset(batch_size=BATCH, seed=0)))
    r["zstd_stored_bytes"] = _bytes(vz)
    pre = [list(memory_batches(m)(e)) for e in range(EPOCHS)]  # B alone: batches gathered beforehand
    r["b_only_s"] = train_light(lambda e: iter(pre[e]))
    pre.clear()
    r["pairs"] = {}
    for threads in (torch.get_num_threads(), 1):
        sfx = "" if threads > 1 else "_t1"
        pairs = r["pairs"][sfx] = []
        with torch_threads(threads):
            for i in range(PAIRS):  # each featstore run next to its reference, in alternating order
                p = {}
                for run in (_LIGHT_RUNS if i % 2 == 0 else _LIGHT_RUNS[::-1]):
                    p[run] = _light_run(run, v, m)
                pairs.append(p)
        for k in ("mem_ref", "fs", "mem_ref_cache", "fs_cache"):
            r[f"{k}{sfx}_s"] = float(np.median([p[k] for p in pairs]))
    return r


def crc_all(v: featstore.Version) -> float:
    """Seconds to crc32c every data object of the version (page cache, one thread): what
    checking every chunk on every epoch would add to an epoch."""
    import crc32c

    s = stored(v).storage
    blobs = [s.fs.cat_file(p) for f in FIELDS for p in s.fs.find(s.path(f"{stored(v).key}/{f}/c"))]
    t0 = time.perf_counter()
    for b in blobs:
        crc32c.crc32c(b)
    return time.perf_counter() - t0


def _bytes(v: featstore.Version) -> int:
    s = stored(v).storage
    return int(sum(s.fs.du(s.path(f"{stored(v).key}/{f}"), total=True) for f in FIELDS))


def run_reader(n: int, repeats: int, workdir: str, endpoint: str | None, say: Any) -> dict[str, Any]:
    """Every reader row ``repeats`` times; returns the raw figures (see :func:`section`)."""
    m = light_outputs(n)
    store = featstore.open_store(os.path.join(workdir, "reader-store"))
    say("reader rows: writing the light versions (auto and zstd)")
    v, vz = write_light(store, m, "auto"), write_light(store, m, "zstd")
    res: dict[str, Any] = {"n": n, "compression": {k: a.compression for k, a in v.manifest.arrays.items()},
                           "reps": []}
    s3v = None
    if endpoint:
        import uuid

        import boto3

        bucket = f"reader-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        s3 = featstore.open_store(f"s3://{bucket}/feats", storage_options={"endpoint_url": endpoint})
        say("reader rows: writing the light version to S3")
        s3v = write_light(s3, m, "auto")
    for rep in range(repeats):
        say(f"reader rows: repeat {rep + 1}/{repeats}")
        r = _local_rows(v, vz, m)
        r["w2_zeros_fp"], _ = workers_footprint(_Zeros(n))
        ds = vz.dataset(batch_size=BATCH, seed=0, cache="memory", cache_bytes=2**30)
        ds.clear_cache()
        r["w2_cache_fp"], r["w2_cache_s"] = workers_footprint(ds)
        r["w2_nocache_fp"], _ = workers_footprint(vz.dataset(batch_size=BATCH, seed=0))
        ds.clear_cache()
        if s3v is not None:
            s3ds = s3v.dataset(batch_size=BATCH, seed=0)
            r["s3_pairs"] = []
            for i in range(S3_PAIRS):  # each reader epoch next to a raw GET pass, in alternating order
                p: dict[str, float] = {}
                for what in (("raw", "fs") if i % 2 == 0 else ("fs", "raw")):
                    if what == "raw":
                        p["raw_bps"] = s3_clients(s3v, endpoint, only=("s3fs",))["s3fs_bps"]
                    else:
                        p["read_s"], p["read_cpu_s"] = read_only(featstore_batches(s3ds))
                r["s3_pairs"].append(p)
            r["s3_read_s"] = float(np.median([p["read_s"] for p in r["s3_pairs"]]))
            r["s3_read_cpu_s"] = float(np.median([p["read_cpu_s"] for p in r["s3_pairs"]]))
            # which client the reader's GETs went through (obstore unless FEATSTORE_S3_CLIENT=s3fs)
            r["s3_client"] = "obstore" if s3ds.process_reads().storage._s3_getter() is not None else "s3fs"
            r["s3_stored_bytes"] = _bytes(s3v)
            with _env("FEATSTORE_S3_CLIENT", "s3fs"):  # the reader as it was: every GET through s3fs
                r["s3fs_read_s"], _ = read_only(featstore_batches(s3v.dataset(batch_size=BATCH, seed=0)))
            r["s3"] = s3_clients(s3v, endpoint)
        res["reps"].append(r)
    return res


# -- the report section -----------------------------------------------------------------------
BEGIN, END = "<!-- reader rows (issue 12): begin -->", "<!-- reader rows (issue 12): end -->"


def _ratios(res: dict[str, Any], f: Any) -> Any:
    from .measure import Stat

    vals: list[float] = []
    for r in res["reps"]:
        with contextlib.suppress(KeyError, ZeroDivisionError, TypeError):
            got = f(r)
            vals.extend(got if isinstance(got, list) else [got])
    return Stat.of(vals) if vals else None


def _paired(r: dict[str, Any], threads: str, a: str, b: str) -> list[float]:
    return [p[a] / p[b] for p in r["pairs"][threads]]


def targets(res: dict[str, Any]) -> list[tuple[str, str, Any, str]]:
    """(row, threshold, Stat of the paired ratio, how it is measured)."""
    mem_cut = "in-memory tensor"
    client = "/".join(sorted({r.get("s3_client", "s3fs") for r in res["reps"] if "s3" in r})) or "-"
    rows = [
        ("local read-only epoch byte rate / raw page-cache read rate", "≥ 0.5",
         lambda r: [r["stored_bytes"] / p["fs_read_s"] / p["raw_bps"] for p in r["local_pairs"]],
         "stored bytes / one read-only epoch (0 workers, shuffled, no training) vs reading every data "
         f"object whole with 4 threads, measured next to each other ({LOCAL_PAIRS} pairs per repeat, in "
         "alternating order); version written with `compression='auto'`"),
        ("reference: in-memory tensor read-only epoch byte rate / raw page-cache read rate", "(info)",
         lambda r: [r["stored_bytes"] / p["mem_read_s"] / p["raw_bps"] for p in r["local_pairs"]],
         f"the same shuffled batches gathered from the {mem_cut} (torch indexing): a gather of "
         "random rows into each batch, which any reader does and a whole-file read does not"),
        ("featstore shuffled read-only epoch: in-memory tensor's time / featstore's", "(info)",
         lambda r: [p["mem_read_s"] / p["fs_read_s"] for p in r["local_pairs"]],
         "how close the reader comes to the bound above (1.0: as fast as the in-memory tensor)"),
        ("featstore shuffled read-only epoch: shard-by-shard numpy gather's time / the arena's", "(info)",
         lambda r: r["fs_pershard_read_s"] / r["fs_read_s"],
         "the same epoch with `FEATSTORE_ARENA=0`: what gathering each batch with one `index_select` over "
         "the window's shards mapped back to back changed"),
        ("featstore shuffled read-only epoch: in-memory tensor with `torch.index_select`'s time / featstore's",
         "(info)", lambda r: r["mem_sel_read_s"] / r["fs_read_s"],
         "the in-memory reference indexes as a training loop does (`tensor[idx]`); `index_select` is "
         "torch's faster kernel for rows, the one featstore uses"),
        ("where the bound lifts: unshuffled read-only epoch byte rate / raw page-cache read rate", "≥ 0.5",
         lambda r: r["stored_bytes"] / r["fs_seq_read_s"] / r["raw_bps"],
         "the same version read with `shuffle=False`: each batch's rows are consecutive rows of the "
         "mapped shards, no random row gather"),
        ("crc32c of every chunk / featstore read-only epoch (local)", "(info)",
         lambda r: r["crc_s"] / r["fs_read_s"],
         "what checking every chunk on every epoch would add, timed as a separate pass; the reader "
         "checks each mapped chunk once per process (a file rewritten since is mapped and checked again)"),
        ("local reader CPU per epoch: featstore / in-memory tensor", "(info)",
         lambda r: r["fs_read_cpu_s"] / r["mem_read_cpu_s"], "process CPU seconds of the read-only epochs"),
        ("compression on a local store: read CPU, features zstd / features raw (auto)", "(info)",
         lambda r: r["zstd_read_cpu_s"] / r["fs_read_cpu_s"],
         "the same data with `compression='zstd'`; why 'auto' on a local store keeps fp16 features raw"),
        ("compression on a local store: stored bytes, zstd / auto", "(info)",
         lambda r: r["zstd_stored_bytes"] / r["stored_bytes"], "what zstd saves on this version"),
        ("light B, 0 workers, 3 epochs: featstore / in-memory tensor", "≤ 1.10",
         lambda r: _paired(r, "", "fs", "mem_ref"),
         f"each featstore run / the in-memory run next to it; {PAIRS} pairs per repeat, in alternating order"),
        ("light B, 0 workers, 3 epochs: featstore cache='memory' / in-memory tensor", "≤ 1.03",
         lambda r: _paired(r, "", "fs_cache", "mem_ref_cache"),
         "cache emptied before each run: epoch 1 (decode and insert) included; paired as above"),
        ("no-overlap bound: (in-memory training + 3 x (featstore - in-memory) read-only epochs) / in-memory", "(info)",
         lambda r: (r["mem_ref_s"] + EPOCHS * (r["fs_read_s"] - r["mem_read_s"])) / r["mem_ref_s"],
         "the ratio when the reader's extra work cannot overlap B's step (B's 2 torch threads use both cores)"),
        ("a reader's cost inside B's loop / its read-only epochs: in-memory tensor", "(info)",
         lambda r: (r["mem_ref_s"] - r["b_only_s"]) / (EPOCHS * r["mem_read_s"]),
         "(B fed from the in-memory tensor - B alone on batches gathered beforehand) / 3 read-only "
         "epochs: how much B's loop magnifies what a reader costs"),
        ("a reader's cost inside B's loop / its read-only epochs: featstore", "(info)",
         lambda r: (r["fs_s"] - r["b_only_s"]) / (EPOCHS * r["fs_read_s"]), "the same for featstore"),
        ("light B, one core left free (B on 1 torch thread): featstore / in-memory", "(info)",
         lambda r: _paired(r, "_t1", "fs", "mem_ref"), "both runs with torch.set_num_threads(1)"),
        ("light B, one core left free: featstore cache='memory' / in-memory", "(info)",
         lambda r: _paired(r, "_t1", "fs_cache", "mem_ref_cache"), "both runs with torch.set_num_threads(1)"),
        ("2 workers, cache='memory': footprint / one decoded copy of the version", "≤ 1.2",
         lambda r: (r["w2_cache_fp"] - r["w2_zeros_fp"]) / r["decoded_bytes"],
         "main + 2 persistent workers after 3 epochs of the light B on the zstd version: PSS without "
         "shared memory + the cache folder's bytes, minus the same for batches of zeros through the "
         "same 2 workers"),
        ("2 workers, no cache: footprint / one decoded copy of the version", "(info)",
         lambda r: (r["w2_nocache_fp"] - r["w2_zeros_fp"]) / r["decoded_bytes"], "the same, without the cache"),
        (f"S3 reader byte rate (through {client}) / raw GET rate (s3fs, 4 concurrent, same objects)", "≥ 0.8",
         lambda r: [r["s3_stored_bytes"] / p["read_s"] / p["raw_bps"] for p in r["s3_pairs"]],
         f"one read-only epoch, 0 workers, decode included, next to a raw s3fs pass over the same objects "
         f"({S3_PAIRS} pairs per repeat, in alternating order); moto on the same cores"),
        (f"S3 reader byte rate (through {client}) / raw GET rate (obstore, 4 concurrent, same objects)",
         "(info)", lambda r: r["s3_stored_bytes"] / r["s3_read_s"] / r["s3"]["obstore_bps"],
         "the same epoch against the fastest raw client"),
        ("S3 reader byte rate: featstore's client / every GET through s3fs", "(info)",
         lambda r: r["s3fs_read_s"] / r["s3_read_s"],
         "the same read-only epoch with `FEATSTORE_S3_CLIENT=s3fs`: what adopting obstore changed"),
        ("S3 client GET rate: obstore / s3fs (4 concurrent)", "(info)",
         lambda r: r["s3"]["obstore_bps"] / r["s3"]["s3fs_bps"], "whole-object GETs of the same objects"),
        ("S3 client GET rate: boto3 / s3fs (4 concurrent)", "(info)",
         lambda r: r["s3"]["boto3_bps"] / r["s3"]["s3fs_bps"], "whole-object GETs of the same objects"),
        ("S3 client CPU per byte: obstore / s3fs", "(info)",
         lambda r: r["s3"]["obstore_cpu_s"] / r["s3"]["s3fs_cpu_s"], "process CPU seconds of those GETs"),
    ]
    return [(name, thr, _ratios(res, f), how) for name, thr, f, how in rows]


def section(res: dict[str, Any], command: str, load: str) -> str:
    """The markdown section for docs/benchmarks.md."""
    from .report import MiB, _f, _stat

    reps = res["reps"]
    lines = [BEGIN, "", "## The reader at the memory limit (issue 12)", "",
             f"Generated by `{command}` (N={res['n']:,}, {len(reps)} repeats; {load}). Workload: "
             f"{res['n']:,} samples of 512 float16 features + 1000 float32 logits + an int64 target; "
             f"stored with `compression='auto'` on a local store as {res['compression']}. Light B: MLP "
             "512→256→10, Adam, batch 256, 3 shuffled epochs, 0 workers. Ratios are paired within a repeat.",
             "", "| row | threshold | measured | met | how |", "|---|---|---|---|---|"]
    for name, thr, s, how in targets(res):
        ok = "n/a" if s is None else "info" if thr == "(info)" else (
            "yes" if (s.median >= float(thr[2:]) if thr.startswith("≥") else s.median <= float(thr[2:])) else "**no**")
        lines.append(f"| {name} | {thr} | {_f(s, 2)} | {ok} | {how} |")
    lines += ["", "| figure | value |", "|---|---|",
              f"| raw page-cache read, 4 threads | {_f(_stat([r['raw_bps'] for r in reps]), 0, MiB)} MiB/s |",
              f"| featstore read-only epoch, local | "
              f"{_f(_stat([r['stored_bytes'] / r['fs_read_s'] for r in reps]), 0, MiB)} MiB/s, "
              f"{_f(_stat([r['fs_read_cpu_s'] for r in reps]), 3)} CPU s |",
              f"| featstore read-only epoch, local, unshuffled | "
              f"{_f(_stat([r['stored_bytes'] / r['fs_seq_read_s'] for r in reps]), 0, MiB)} MiB/s |",
              f"| in-memory tensor read-only epoch | "
              f"{_f(_stat([r['stored_bytes'] / r['mem_read_s'] for r in reps]), 0, MiB)} MiB/s, "
              f"{_f(_stat([r['mem_read_cpu_s'] for r in reps]), 3)} CPU s |",
              f"| light B alone (batches gathered beforehand), 3 epochs | "
              f"{_f(_stat([r['b_only_s'] for r in reps]), 2)} s |",
              f"| light B, in-memory tensor, 3 epochs | {_f(_stat([r['mem_ref_s'] for r in reps]), 2)} s |",
              f"| light B, featstore / with cache='memory', 3 epochs | {_f(_stat([r['fs_s'] for r in reps]), 2)} / "
              f"{_f(_stat([r['fs_cache_s'] for r in reps]), 2)} s |"]
    if any("s3" in r for r in reps):
        for c in ("s3fs", "boto3", "obstore"):
            st = _stat([r["s3"].get(f"{c}_bps") for r in reps if "s3" in r])
            if st:
                lines.append(f"| S3 GET through {c}, 4 concurrent | {_f(st, 0, MiB)} MiB/s, "
                             f"{_f(_stat([r['s3'][f'{c}_cpu_s'] for r in reps]), 3)} CPU s |")
        lines.append(f"| featstore read-only epoch, S3 | "
                     f"{_f(_stat([r['s3_stored_bytes'] / r['s3_read_s'] for r in reps if 's3' in r]), 0, MiB)} MiB/s, "
                     f"{_f(_stat([r['s3_read_cpu_s'] for r in reps if 's3' in r]), 3)} CPU s |")
    lines += ["", *NOTES, "", END]
    return "\n".join(lines)


NOTES = (
    "How to read these rows:",
    "",
    "- *Local byte rate*: a shuffled epoch gathers random rows into every batch, a whole-file read "
    "copies sequentially; the *reference* row gathers the same batches from the in-memory tensor. "
    "featstore maps each array's shard objects back to back into one reserved address range per "
    "process (`featstore/read/shards/_arena.py`; no read, no decode for raw arrays) and gathers a batch of an "
    "array with one `torch.index_select` over it, straight from the page cache; each chunk's crc32c "
    "is checked once per mapping. The *shard-by-shard* row is the numpy gather it replaced "
    "(`FEATSTORE_ARENA=0`, also what non-Linux systems use). The in-memory reference indexes as a "
    "training loop does (`tensor[idx]`); gathered with `torch.index_select` the same in-memory "
    "epoch is faster still: what featstore spends beyond that is per-batch work besides the copy "
    "(the zstd int64 target decoded every epoch, window bookkeeping, batch assembly). The byte "
    "rate rows pair each epoch with a raw read next to it: on this shared machine either moves by "
    "a factor of 2 between minutes.",
    "- *Load*: the header gives the machine's load during the run. On a shared machine absolute "
    "times grow and torch's OpenMP threads (B, the in-memory tensor's indexing) suffer most; the "
    "ratios are paired within a repeat, and the ranges show the spread between repeats.",
    "- *Light B*: B's two torch threads use both cores, so whatever the reader adds is added to the "
    "time (the *no-overlap bound*); the *one core left free* rows run both sides with B on one "
    "thread. With no core to spare the local reader reads in the training loop's thread (pool "
    "threads would only take turns with B's). On the local store `compression='auto'` leaves fp16 "
    "features and fp32 logits raw (see "
    "the compression rows), so `cache='memory'` has only the int64 target to hold: the page cache "
    "is already the machine's one copy of raw arrays (the cache's shards are mapped into an arena "
    "too, so a cached array is gathered the same way). The *reader's cost inside B's loop* rows "
    "show that B's loop magnifies every reader's work, the in-memory tensor's included (caches and "
    "cores shared with B's threads), so a reader whose read-only epoch is x times the in-memory "
    "tensor's adds about x times as much to B.",
    "- *2 workers*: the *zstd* version puts every array through the shared cache; without it each "
    "worker holds its own decoded windows.",
    "- *S3 clients*: obstore (Rust, `obstore.get`) fetched the same objects faster and with a "
    "fraction of s3fs's CPU, so featstore's data reads (`Storage.read_bytes`/`read_range`: the "
    "reader's shard objects) go through obstore; writes, listings, deletes, conditional creates, "
    "metadata reads and the zarr path stay on s3fs. Options obstore cannot take faithfully, a "
    "process forked after obstore's runtime started, or `FEATSTORE_S3_CLIENT=s3fs` read through "
    "s3fs. The retry budget, the typed `StoreUnavailable`, the secret masking and fork/spawn/"
    "forkserver DataLoader workers are tested against the obstore path (fault proxy, secrets, "
    "contract and DataLoader tests); the reader row names the client it used. On S3 "
    "`compression='auto'` stores the fp16 features with zstd (bytes matter there), so that epoch "
    "decodes them; the uncompressed logits are gathered straight from the fetched objects.",
)


def write_section(md_path: str, text: str) -> None:
    """This benchmark's section of ``md_path`` replaced (or appended), the rest left alone."""
    write_marked(md_path, BEGIN, END, text)


def load_note() -> str:
    """The machine's load while the rows ran (other jobs share it)."""
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min) / {five:.1f} (5 min) at the end on {os.cpu_count()} cores"

