"""S3 rows on a real server (issue 20): SeaweedFS beside moto, measured side by side in one run.

    python -m benchmarks.servers                 # N=20,000, 3 repeats; updates its section of docs/benchmarks.md
    python -m benchmarks.servers --n 4000 --repeats 1 --out /tmp/b   # a smoke run

moto is a Python server on the same 2 cores as the client, which bounds every S3 figure measured
against it; SeaweedFS (``weed server -s3``, Go; :mod:`featstore.testing`) is a real one. For
each server, on the reader rows' light workload (:mod:`benchmarks.reader`: 512 fp16 features +
1000 fp32 logits + an int64 target per sample):

- *write*: ``store.compute`` of the version (a replay Model A: the rows time the writer, not A;
  on a cluster like the embedded default, started once) vs raw PUTs of the same objects' bytes
  right after it, with the writer's client (s3fs) and concurrency (2 task threads);
- *read*: one read-only epoch (0 workers, shuffled) vs whole-object GETs of the same objects with
  the reader's client (obstore) and concurrency (``prefetch`` = 4), in alternating order;
- *training*: 3 epochs of the light B (on one torch thread) from the S3 version vs from the same
  version on a local store, 0 workers, in alternating order;
- *cold epoch*: one epoch of the light B from S3 with no cache (``cache=None``: the process keeps
  no object, so every object of the epoch is fetched, its first read in that epoch) vs the same
  epoch (same order) from the local store, in alternating order;
- *warm epoch*: one epoch of the light B from S3 with ``cache="disk"`` after an epoch that put
  every object on the node's disk (0 GETs, counted) vs the same epoch from the local store, in
  alternating order (as :mod:`benchmarks.diskcache` does against moto).

The first read-only epoch of each new version is kept apart (a figure, not a pair): the pairs
measure the epochs after it, as a training run's are.

Every ratio pairs two measurements taken next to each other; the ranges are over pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import featstore
from featstore.versions import stored

from .diskcache import GetCounter, epoch_s, light_b_pairs
from .measure import Stat
from .reader import (BATCH, FIELDS, featstore_batches, light_outputs, load_note, read_only, s3_clients, torch_threads,
                     train_light, write_light)
from .sections import write_marked

BEGIN, END = "<!-- s3 servers (issue 20): begin -->", "<!-- s3 servers (issue 20): end -->"
SERVERS = ("moto", "seaweedfs")
#: The writer's concurrency on a CPU machine: the embedded in-process worker runs 2 task threads.
WRITE_THREADS = 2
#: The reader's concurrency: ``ReaderOptions.prefetch``.
READ_THREADS = 4
PAIRS = 2  # read and training pairs per repeat
#: Cold-epoch and warm-epoch light-B pairs per repeat (one epoch on each side).
EPOCH_PAIRS = 4
#: What the rows mean, below the tables (measured by hand where a figure is quoted).
NOTES = (
    "- *The same client and concurrency*: the raw GETs are obstore's, 4 at a time, whole objects, as the "
    "reader's shard GETs are (24 GETs per epoch of this version, none ranged, counted by a proxy); the "
    "raw PUTs are s3fs's, 2 at a time, as the writer's. Both servers share the 2 cores with the client.",
    "- *Reader byte rate and S3 training* miss their targets on both servers, by about as much on the real "
    "server as on moto: the server's software is not what bounds them, the 2 cores are. A read-only SeaweedFS "
    "epoch costs the client 0.15-0.16 s of CPU (obstore, the crc32c of every chunk, zstd of the features, "
    "the batch gathers) and the server 0.11-0.14 s (`read_cpu_s`, `server_cpu_s` in "
    "docs/benchmarks-servers.json), so with B on one core the reads and the server share the other; a raw "
    "GET pays only the transfer. Tried and measured (not kept): gathering fetched shards with one "
    "`index_select` over arena slots (training 1.55 vs 1.65, read-only epochs 0.44 s vs 0.35 s: the copy into "
    "the slots costs more than the numpy gather, 0.11-0.18 s per epoch), and smaller shards (512 samples "
    "instead of 2,560: 1.61 vs 1.46). Where the server runs on other machines, its CPU leaves this one.",
    "- *Cold and warm epochs*: one epoch of the light B, not three, so each pair is cold or warm "
    "throughout. The cold row's S3 side reads with no cache (`cache=None`): the process keeps no object "
    "between epochs, so every object of the epoch is fetched (the data GETs per cold epoch above) and "
    "decoded; the version's first epoch in the process (its client, manifest and the server's caches to "
    "warm) is kept apart, as a figure above. The warm row's S3 side reads through the disk tier after an "
    "epoch that put every object on the node's disk: each object is mapped from its cache file and decoded "
    "as a local store's file is (0 GETs per warm epoch above). Its one difference from the local side: "
    "`compression='auto'` stores the features zstd on S3 (a network saves ≥ 10%) and raw on local disk, so "
    "the disk tier decodes them every epoch (~0.03 CPU s per epoch here) and the local store does not. "
    "The both-tiers row adds the memory tier, which keeps each shard decoded once in shared memory: no "
    "decode per epoch, and the batches are gathered from contiguous decoded rows (the local store's "
    "objects interleave a crc32c with every chunk), hence below 1. "
    "Tried and measured (not kept, commit c7f4a2c and its revert): reading the next epoch's first window "
    "ahead as an epoch ends. With every timed epoch paying for the reads it starts, as epochs back to "
    "back do, it gained nothing here (cold 1.53-1.59, warm 1.09-1.10 in three runs); timed without that "
    "wait it looked like cold 1.24 and warm 1.05, because one side's read-ahead then ran during the other"
    " side's timed epoch: work a side starts must finish inside its own timing in these alternating "
    "pairs.",
    "- *compute vs raw PUTs*: the compute's time includes what raw PUTs do not (the probe batch, "
    "fingerprints, encoding and zstd, receipts, the claim and commit with their checks); info only.",
)


def _say(msg: str) -> None:
    print(f"[servers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _objects(v: featstore.Version) -> list[str]:
    s = stored(v).storage
    return [p for f in FIELDS for p in s.fs.find(s.path(f"{stored(v).key}/{f}/c"))]


def raw_put_rate(v: featstore.Version, threads: int = WRITE_THREADS) -> float:
    """Bytes/s of PUTs of the version's data objects' bytes (read first) to a scratch prefix of
    the same bucket, through s3fs, ``threads`` at a time."""
    s = stored(v).storage
    blobs = [s.fs.cat_file(p) for p in _objects(v)]
    scratch = f"{s.root}/_raw-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda ib: s.fs.pipe_file(f"{scratch}/{ib[0]}", ib[1]), enumerate(blobs)))
    rate = sum(len(b) for b in blobs) / (time.perf_counter() - t0)
    s.fs.rm(scratch, recursive=True)
    return rate


def _stored(v: featstore.Version) -> int:
    s = stored(v).storage
    return int(sum(s.fs.du(s.path(f"{stored(v).key}/{f}"), total=True) for f in FIELDS))


def _fresh_store(endpoint: str) -> featstore.FeatureStore:
    import boto3

    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return featstore.open_store(f"s3://{bucket}/feats", storage_options={"endpoint_url": endpoint})


def server_repeat(endpoint: str, pid: int, m: dict, local: featstore.Version, client: Any,
                  cache_dir: str) -> dict[str, Any]:
    """One repeat of every row on one server: the write pair, then the read and training pairs,
    then the cold-epoch and warm-epoch pairs (the disk tier under ``cache_dir``)."""
    r: dict[str, Any] = {}
    t0 = time.perf_counter()
    v = write_light(_fresh_store(endpoint), m, "auto", client=client)
    r["compute_s"] = time.perf_counter() - t0
    r["stored_bytes"] = _stored(v)
    r["compute_bps"] = r["stored_bytes"] / r["compute_s"]
    r["raw_put_bps"] = raw_put_rate(v)
    r["read"], r["train"] = [], []
    # The first epoch of a version in a process (its manifest, records and the client to build,
    # the server's caches cold) is kept apart; the pairs measure the epochs after it.
    r["first_read_s"], _ = read_only(featstore_batches(v.dataset(batch_size=BATCH, seed=0)))
    for i in range(PAIRS):
        p: dict[str, float] = {}
        for what in (("raw", "fs") if i % 2 == 0 else ("fs", "raw")):
            if what == "raw":
                p["raw_get_bps"] = s3_clients(v, endpoint, concurrency=READ_THREADS, only=("obstore",))["obstore_bps"]
            else:
                c0 = _cpu(pid)
                p["read_s"], p["read_cpu_s"] = read_only(featstore_batches(v.dataset(batch_size=BATCH, seed=0)))
                p["server_cpu_s"] = _cpu(pid) - c0
        p["read_bps"] = r["stored_bytes"] / p["read_s"]
        r["read"].append(p)
        t: dict[str, float] = {}
        with torch_threads(1):  # B on one thread: OpenMP's spinning threads collapse on a shared 2-core machine
            for what in (("local", "s3") if i % 2 == 0 else ("s3", "local")):
                src = local if what == "local" else v
                t[f"{what}_train_s"] = train_light(featstore_batches(src.dataset(batch_size=BATCH, seed=0)))
        r["train"].append(t)
    r.update(epoch_pairs(v, local, cache_dir, 2 * r["stored_bytes"]))
    return r


def epoch_pairs(v: featstore.Version, local: featstore.Version, cache_dir: str, budget: int) -> dict[str, Any]:
    """One epoch of the light B from S3 next to the same epoch from the local store: cold (no
    cache: every object fetched) and warm (``cache="disk"`` holding every object), with the data
    GETs of each side counted at featstore's S3 client."""
    opts = {"batch_size": BATCH, "seed": 0}
    lds = local.dataset(**opts)
    r: dict[str, Any] = {}
    with GetCounter() as gets, torch_threads(1):  # B on one thread, as the training row
        r["cold"] = light_b_pairs({"local": lds, "s3": v.dataset(**opts)}, EPOCH_PAIRS, first_epoch=20)
        r["cold_gets"], _ = gets.take()
        disk = v.dataset(**opts, cache="disk", cache_dir=cache_dir, cache_bytes=budget)
        r["fill_s"] = epoch_s(disk, 0)  # puts every object on the node's disk
        r["fill_gets"], _ = gets.take()
        r["warm"] = light_b_pairs({"local": lds, "disk": disk}, EPOCH_PAIRS, first_epoch=40)
        r["warm_gets"], _ = gets.take()
        # both tiers: the compressed arrays decoded once into shared memory, the objects on disk
        both = v.dataset(**opts, cache="memory+disk", cache_dir=cache_dir, cache_bytes=budget, disk_bytes=budget)
        epoch_s(both, 0)  # decodes every shard into shared memory, from the disk tier
        r["warm_memory"] = light_b_pairs({"local": lds, "memory": both}, EPOCH_PAIRS, first_epoch=60)
        r["warm_memory_gets"], _ = gets.take()
        both.clear_cache()  # the shared memory it took
    return r


def run_servers(n: int, repeats: int, workdir: str, servers: tuple[str, ...] = SERVERS) -> dict[str, Any]:
    """Every row ``repeats`` times on each server, the servers interleaved within a repeat."""
    from featstore.testing import SeaweedFS

    from .run import _moto

    for k, val in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret",
                   "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, val)
    from distributed import Client, LocalCluster

    m = light_outputs(n)
    # The embedded default's cluster (one in-process worker, 2 threads), started once: the write
    # rows time the compute, not a cluster's start.
    cluster = LocalCluster(n_workers=1, threads_per_worker=WRITE_THREADS, processes=False, dashboard_address=":0")
    client = Client(cluster)
    local = write_light(featstore.open_store(os.path.join(workdir, "local")), m, "auto", client=client)
    started: dict[str, tuple[str, int]] = {}
    stoppers = [client.close, cluster.close]
    try:
        if "moto" in servers:
            proc, endpoint = _moto()
            stoppers.append(proc.kill)
            started["moto"] = (endpoint, proc.pid)
        if "seaweedfs" in servers:
            weed = SeaweedFS(os.path.join(workdir, "weed"), os.environ["AWS_ACCESS_KEY_ID"],
                             os.environ["AWS_SECRET_ACCESS_KEY"]).start()
            stoppers.append(weed.stop)
            assert weed.proc is not None
            started["seaweedfs"] = (weed.endpoint, weed.proc.pid)
        res: dict[str, Any] = {"n": n, "servers": {s: [] for s in started}}
        for rep in range(repeats):
            for name in (list(started) if rep % 2 == 0 else list(started)[::-1]):
                _say(f"repeat {rep + 1}/{repeats}: {name}")
                cache_dir = os.path.join(workdir, f"cache-{name}-{rep}")
                res["servers"][name].append(server_repeat(*started[name], m, local, client, cache_dir))
                shutil.rmtree(cache_dir, ignore_errors=True)
        return res
    finally:
        for stop in stoppers:
            stop()


# -- the report section -----------------------------------------------------------------------
def _stat(reps: list[dict], f: Any) -> Stat | None:
    vals = [x for r in reps for x in f(r)]
    return Stat.of(vals) if vals else None


def rows(res: dict[str, Any]) -> list[tuple[str, str, str, Stat | None, str]]:
    """(server, row, target, measured, how) for every row."""
    out = []
    for name, reps in res["servers"].items():
        out += [
            (name, "S3 reader byte rate / raw GET rate (obstore, 4 concurrent, same objects)", "≥ 0.9",
             _stat(reps, lambda r: [p["read_bps"] / p["raw_get_bps"] for p in r["read"]]),
             "one read-only epoch (0 workers, shuffled, decode included) next to whole-object GETs of the "
             "same objects with the reader's client and concurrency, in alternating order"),
            (name, "training B, 0 workers, 3 epochs (B on 1 thread): from S3 / from a local store", "≤ 1.15",
             _stat(reps, lambda r: [t["s3_train_s"] / t["local_train_s"] for t in r["train"]]),
             "the light B on the same version stored on S3 and on local disk, in alternating order"),
            (name, "light B, one cold epoch from S3 (nothing cached in this process: first read of each "
             "object) / the same epoch from the local store", "≤ 1.30",
             _stat(reps, lambda r: [p["s3_s"] / p["local_s"] for p in r["cold"]]),
             f"{EPOCH_PAIRS} pairs per repeat in alternating order, 0 workers, B on 1 thread; `cache=None`, so "
             "the epoch GETs every object of the version (GETs counted at featstore's S3 client)"),
            (name, "light B, one warm epoch from S3 with cache='disk' (every object already on the node's disk) "
             "/ the same from the local store", "≤ 1.05",
             _stat(reps, lambda r: [p["disk_s"] / p["local_s"] for p in r["warm"]]),
             f"{EPOCH_PAIRS} pairs per repeat in alternating order, 0 workers, B on 1 thread, after one epoch "
             "that fetched every object into a fresh `cache_dir` (budget twice the version); 0 GETs during "
             "the pairs"),
            (name, "light B, one warm epoch from S3 with cache='memory+disk' (compressed arrays decoded once "
             "into shared memory, objects on the node's disk) / the same from the local store", "≤ 1.05",
             _stat(reps, lambda r: [p["memory_s"] / p["local_s"] for p in r.get("warm_memory", [])]),
             "as the row above, both tiers, after one epoch that decoded every shard into shared memory from "
             "the disk tier: the batches are gathered from mapped decoded shards, as from a local store's files "
             "(the warm row above decodes its zstd features every epoch)"),
            (name, "compute's S3 write throughput / raw PUTs of the same bytes (s3fs, 2 concurrent)", "(info)",
             _stat(reps, lambda r: [r["compute_bps"] / r["raw_put_bps"]]),
             "stored bytes / `store.compute` time (replay Model A: probe, encode, zstd, PUTs, receipts, "
             "commit) next to PUTs of the same objects' bytes with the writer's client and concurrency"),
        ]
    return out


def _fmt(s: Stat | None, digits: int = 2) -> str:
    return "n/a" if s is None else f"{s.median:.{digits}f} ({s.lo:.{digits}f}–{s.hi:.{digits}f})"


def section(res: dict[str, Any]) -> str:
    """The section of docs/benchmarks.md: the rows, then the figures behind them."""
    lines = [BEGIN, "## S3 on a real server: SeaweedFS beside moto (issue 20)", "",
             f"`{res['command']}` — N={res['n']:,} samples of the reader rows' light workload, "
             f"{len(next(iter(res['servers'].values())))} repeats, {res['elapsed_s']:.0f} s; {res['load']}. "
             "Both servers on loopback on the same 2 cores as the client: moto (Python, `ThreadedMotoServer` in "
             "its own process) and SeaweedFS 4.48 (`weed server -s3`, `featstore/testing/_servers.py`).", "",
             "| server | row | target | measured | met | how |", "|---|---|---|---|---|---|"]
    for name, row, target, stat, how in rows(res):
        met = "info" if target == "(info)" or stat is None else (
            "yes" if (stat.median >= float(target[2:]) if target.startswith("≥") else stat.median <= float(target[2:]))
            else "**no**")
        lines.append(f"| {name} | {row} | {target} | {_fmt(stat)} | {met} | {how} |")
    lines += ["", "| server | figure | value |", "|---|---|---|"]
    for name, reps in res["servers"].items():
        lines += [f"| {name} | {label} | {value} |" for label, value in _figures(reps)]
    lines += ["", "How to read these rows:", "", *NOTES]
    lines += ["", END]
    return "\n".join(lines)


def _figures(reps: list[dict]) -> list[tuple[str, str]]:
    """The absolute figures behind one server's ratios."""
    mib = 2**20

    def per_read(key: str, scale: float = 1.0) -> str:
        return _fmt(_stat(reps, lambda r: [p[key] / scale for p in r["read"]]), 1 if scale > 1 else 2)

    return [
        ("raw GET, obstore, 4 concurrent", f"{per_read('raw_get_bps', mib)} MiB/s"),
        ("featstore read-only epoch", f"{per_read('read_bps', mib)} MiB/s"),
        ("a version's first read-only epoch in the process", f"{_fmt(_stat(reps, lambda r: [r['first_read_s']]))} s"),
        ("CPU seconds per read-only epoch: the server / the reader",
         f"{per_read('server_cpu_s')} / {per_read('read_cpu_s')} s"),
        ("light B, 3 epochs: from S3 / from local",
         f"{_fmt(_stat(reps, lambda r: [t['s3_train_s'] for t in r['train']]))} / "
         f"{_fmt(_stat(reps, lambda r: [t['local_train_s'] for t in r['train']]))} s"),
        ("light B, one epoch, cold pairs: from S3 (no cache) / from local",
         f"{_fmt(_stat(reps, lambda r: [p['s3_s'] for p in r['cold']]))} / "
         f"{_fmt(_stat(reps, lambda r: [p['local_s'] for p in r['cold']]))} s"),
        ("light B, one epoch, warm pairs: from S3 through the disk tier / from local",
         f"{_fmt(_stat(reps, lambda r: [p['disk_s'] for p in r['warm']]))} / "
         f"{_fmt(_stat(reps, lambda r: [p['local_s'] for p in r['warm']]))} s"),
        ("light B, one epoch, warm pairs with both tiers: from S3 / from local",
         f"{_fmt(_stat(reps, lambda r: [p['memory_s'] for p in r.get('warm_memory', [])]))} / "
         f"{_fmt(_stat(reps, lambda r: [p['local_s'] for p in r.get('warm_memory', [])]))} s"),
        ("data GETs per cold epoch / per warm epoch (disk tier) / per warm epoch (both tiers)",
         f"{_fmt(_stat(reps, lambda r: [r['cold_gets'] / EPOCH_PAIRS]), 0)} / "
         f"{_fmt(_stat(reps, lambda r: [r['warm_gets'] / EPOCH_PAIRS]), 0)} / "
         f"{_fmt(_stat(reps, lambda r: [r.get('warm_memory_gets', 0) / EPOCH_PAIRS]), 0)}"),
        ("the read-only epoch that filled the disk tier", f"{_fmt(_stat(reps, lambda r: [r['fill_s']]))} s"),
        ("raw PUT, s3fs, 2 concurrent", f"{_fmt(_stat(reps, lambda r: [r['raw_put_bps'] / mib]), 1)} MiB/s"),
        ("store.compute write throughput", f"{_fmt(_stat(reps, lambda r: [r['compute_bps'] / mib]), 1)} MiB/s"),
        ("stored bytes of the version", f"{_fmt(_stat(reps, lambda r: [r['stored_bytes'] / mib]), 1)} MiB"),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.servers", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=20_000, help="samples of the light workload")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every row per server")
    p.add_argument("--servers", default=",".join(SERVERS), help="comma-separated: moto, seaweedfs")
    p.add_argument("--out", default="docs", help="folder of benchmarks.md and benchmarks-servers.json")
    args = p.parse_args(argv)
    command = "python -m benchmarks.servers" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    work = tempfile.mkdtemp(prefix="featstore-servers-")
    t0 = time.perf_counter()
    try:
        res = run_servers(args.n, args.repeats, work, tuple(args.servers.split(",")))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res.update(command=command, elapsed_s=time.perf_counter() - t0, load=load_note())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "benchmarks-servers.json"), "w") as f:
        json.dump(res, f, indent=1)
    write_marked(os.path.join(args.out, "benchmarks.md"), BEGIN, END, section(res))
    for name, row, target, stat, _ in rows(res):
        _say(f"{name}: {row}: {_fmt(stat)} (target {target})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
