"""The scale in numbers: ``python -m benchmarks.scale`` writes ``docs/scale.md``.

Metadata only (no payload), so a billion-sample version fits on this machine:

1. manifest bytes, open time and RSS per process at 500 / 12,500 / 125,000 shards, schema 1
   (per-shard JSON inline, what featstore wrote before) beside schema 2, each opened in a fresh
   process, side by side in one run;
2. a 1e9-sample version at the S3 default layout: manifest and records bytes, open time and
   RSS per process, plan time per consumer for 1,024 ranks x 8 DataLoader workers;
3. resume start-up on the moto S3 server: finding the finished shards the old way (list, then
   one GET per receipt, serially) and the new way (one listing; receipts compacted into runs),
   at a shard count moto can hold here, extrapolated to 125,000 with the stated model;
4. the request-rate arithmetic per S3 prefix (computed).

Every figure says whether it was measured here or computed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from featstore.format import Layout, ReceiptRun, ShardReceipt
from featstore.read import UniformShards, consumer_plan
from featstore import FeatureStore, open_store
from featstore.versions import receipt_key, stored, version_key
from featstore.versions import compact_receipts, finished_shards, read_receipts, run_key, write_receipt
from featstore.compute import choose_layout
from featstore.compute import OBJECT_STORE_SHARD_BYTES

from .procfs import rss
from .synthetic import ARRAYS, synthetic_receipts, synthetic_version

ROW_BYTES = [512 * 2, 1000 * 4, 8]  # features fp16[512], logits fp32[1000], target int64
BIG_RESUME = 125_000


# -- 1. one process opening one version ---------------------------------------------------------
def child_open(url: str, ref: str, plan: bool) -> dict:
    """In a fresh process: open ``ref`` (and plan one consumer); time and RSS it."""
    store = open_store(url)
    before = rss(os.getpid())
    t0 = time.perf_counter()
    v = store.open(ref)
    opened = time.perf_counter() - t0
    after = rss(os.getpid())
    out = {"open_s": opened, "rss_open_mb": (after - before) / 2**20,
           "peak_open_mb": (_high_water() - before) / 2**20}
    if plan:
        t0 = time.perf_counter()
        layout = v.manifest.layout
        sizes = UniformShards(layout.n_samples, layout.samples_per_shard)  # as the reader plans
        for cid in (0, 4095, 8191):
            consumer_plan(sizes, seed=0, epoch=1, shuffle=True, consumers=8192, cid=cid, partition="pad",
                          window=4 * v.manifest.layout.samples_per_shard)
        out["plan_s"] = (time.perf_counter() - t0) / 3
        out["rss_plan_mb"] = (rss(os.getpid()) - before) / 2**20
    return out


def _high_water() -> int:
    """This process's peak RSS in bytes (VmHWM: reset by exec, unlike ru_maxrss, which a child
    inherits from the process that forked it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def open_in_child(url: str, ref: str, plan: bool = False, repeats: int = 3) -> dict:
    """The median of ``repeats`` fresh processes opening ``ref``."""
    runs = []
    for _ in range(repeats):
        cmd = [sys.executable, "-m", "benchmarks.scale", "--child", url, ref] + (["--plan"] if plan else [])
        runs.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    return {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]}


def schema1_version(store: FeatureStore, name: str, n_shards: int, spp: int = 3584) -> str:
    """A metadata-only version in the old format (every shard's receipt inline)."""
    m = synthetic_version(store, name, n_shards, samples_per_shard=spp, chunk_rows=512, with_records=False)
    receipts = synthetic_receipts(m.layout, list(m.arrays))
    old = replace(m, shards=tuple(ShardReceipt(r.index, r.start, r.stop, r.digests) for r in receipts),
                  records=None)
    key = f"{version_key(m.name, m.id)}/manifest.json"
    store.storage.delete(key)
    store.storage.create_json(key, old.to_json())
    return f"{m.name}@{m.id}"


def manifest_rows(root: str, counts: list[int]) -> list[dict]:
    store = open_store(root)
    rows = []
    for n in counts:
        for schema in (1, 2):
            name = f"s{schema}/n{n}"
            ref = schema1_version(store, name, n) if schema == 1 else (
                lambda m: f"{m.name}@{m.id}")(synthetic_version(store, name, n, samples_per_shard=3584, chunk_rows=512,
                                                               with_records=False))
            vkey = version_key(*ref.split("@"))
            size = len(store.storage.read_bytes(f"{vkey}/manifest.json"))
            rows.append({"shards": n, "schema": schema, "manifest_bytes": size, **open_in_child(root, ref)})
            print(f"  schema {schema}, {n} shards: {rows[-1]}", file=sys.stderr)
    return rows


def plan_rows(counts: list[int], spp: int = 3584, consumers: int = 8192, repeats: int = 5) -> list[dict]:
    """One consumer's plan (of ``consumers``) at each shard count, as the reader builds it
    (:class:`UniformShards`) and over listed sizes (the O(shards) path): median time, and the
    peak of Python allocations while planning (tracemalloc). ``uniform1`` plans a consumer
    that reads one shard (as many consumers as shards): the same output at every count, so
    only what the shard count itself costs remains."""
    import statistics
    import tracemalloc

    rows = []
    for n in counts:
        row: dict = {"shards": n}
        for kind, sizes, c in (("uniform", UniformShards(n * spp, spp), consumers), ("listed", [spp] * n, consumers),
                               ("uniform1", UniformShards(n * spp, spp), n)):
            times, peak = [], 0
            for cid in range(0, c, max(1, c // repeats))[:repeats]:
                kw = dict(seed=0, epoch=1, shuffle=True, consumers=c, cid=cid, partition="pad", window=4 * spp)
                t0 = time.perf_counter()
                consumer_plan(sizes, **kw)
                times.append(time.perf_counter() - t0)
                tracemalloc.start()  # a second plan, traced: tracemalloc slows what it traces
                consumer_plan(sizes, **kw)
                peak = max(peak, tracemalloc.get_traced_memory()[1])
                tracemalloc.stop()
            row[f"{kind}_s"], row[f"{kind}_peak_mb"] = statistics.median(times), peak / 2**20
        rows.append(row)
    return rows


# -- 2. a billion samples -----------------------------------------------------------------------
def billion_row(root: str, n_samples: int = 10**9) -> dict:
    layout = choose_layout(n_samples, ROW_BYTES, None, None, OBJECT_STORE_SHARD_BYTES)
    store = open_store(root)
    t0 = time.perf_counter()
    m = synthetic_version(store, "billion/set", layout.n_shards, samples_per_shard=layout.samples_per_shard,
                          chunk_rows=layout.chunk_rows)
    built = time.perf_counter() - t0
    ref = f"{m.name}@{m.id}"
    vkey = version_key(m.name, m.id)
    records = sum(len(store.storage.read_bytes(k) or b"") for k in store.storage.find(f"{vkey}/_records"))
    t0 = time.perf_counter()
    n_receipts = len(stored(store.open(ref)).shard_receipts())
    read_records_s = time.perf_counter() - t0
    return {"n_samples": m.layout.n_samples, "samples_per_shard": m.layout.samples_per_shard,
            "chunk_rows": m.layout.chunk_rows, "shards": m.layout.n_shards,
            "shard_mib": m.layout.samples_per_shard * sum(ROW_BYTES) / 2**20,
            "manifest_bytes": len(store.storage.read_bytes(f"{vkey}/manifest.json")),
            "records_bytes": records, "records_read_s": read_records_s, "receipts": n_receipts,
            "build_s": built, **open_in_child(root, ref, plan=True)}


# -- 3. resume start-up on the moto S3 server ---------------------------------------------------
def moto_server() -> tuple[object, str]:
    from moto.server import ThreadedMotoServer

    for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def resume_rows(n_shards: int) -> dict:
    import boto3

    server, endpoint = moto_server()
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="scale-bench")
        store = open_store("s3://scale-bench/feats", {"endpoint_url": endpoint})
        layout = Layout(n_shards * 8, 8, 8)
        receipts = [ShardReceipt(r.index, r.start, r.stop, r.digests, r.stats)
                    for r in synthetic_receipts(layout, list(ARRAYS))]
        flat, runs = version_key("resume/flat", "0" * 16), version_key("resume/runs", "1" * 16)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda r: write_receipt(store.storage, flat, r), receipts))
        put_s = time.perf_counter() - t0
        for i in range(0, n_shards, 256):  # what the tasks leave behind: one run per 256 shards
            for r in receipts[i:i + 256]:
                write_receipt(store.storage, runs, r)
            compact_receipts(store.storage, runs, receipts[i:i + 256])
        out = {"shards": n_shards, "put_per_s": n_shards / put_s, **_resume_timings(store, flat, runs, n_shards)}
        return {**out, **_runs_at_scale(store, BIG_RESUME)}
    finally:
        server.stop()


def big_resume_row() -> dict:
    """Only the compacted 125,000-shard resume on a fresh moto server."""
    import boto3

    server, endpoint = moto_server()
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="scale-bench")
        return _runs_at_scale(open_store("s3://scale-bench/feats", {"endpoint_url": endpoint}), BIG_RESUME)
    finally:
        server.stop()


def _runs_at_scale(store: FeatureStore, n: int) -> dict:
    """What a resume of an ``n``-shard version finds on moto once its tasks compacted their
    receipts: ``n / 256`` run objects (written here directly), listed and read back."""
    key = version_key("resume/big", "2" * 16)
    layout = Layout(n * 8, 8, 8)
    receipts = synthetic_receipts(layout, list(ARRAYS))
    chunks = [receipts[i:i + 256] for i in range(0, n, 256)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda c: store.storage.write_json(run_key(key, c[0].index, c[-1].index),
                                                         ReceiptRun(tuple(c)).to_json()), chunks))
    t0 = time.perf_counter()
    assert len(finished_shards(store.storage, key)) == n
    listed = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert len(read_receipts(store.storage, key)) == n
    return {"big_shards": n, "big_runs": len(chunks), "big_list_s": listed, "big_read_s": time.perf_counter() - t0}


def _resume_timings(store: FeatureStore, flat: str, runs: str, n: int) -> dict:
    st = store.storage
    t0 = time.perf_counter()  # featstore before: list, then one GET per receipt, one at a time
    names = st.list_dirs(f"{flat}/_receipts")
    for e in names:
        st.read_bytes(f"{flat}/_receipts/{e}")
    old = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert len(finished_shards(st, flat)) == n
    list_flat = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert len(finished_shards(st, runs)) == n
    list_runs = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert len(read_receipts(st, flat, range(min(n, 2000)))) == min(n, 2000)
    get_concurrent = (time.perf_counter() - t0) / min(n, 2000)
    t0 = time.perf_counter()
    assert len(read_receipts(st, runs)) == n
    read_runs = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(200):
        st.read_bytes(receipt_key(flat, i))
    get_serial = (time.perf_counter() - t0) / 200
    return {"old_claim_s": old, "list_flat_s": list_flat, "list_runs_s": list_runs, "read_runs_s": read_runs,
            "get_serial_s": get_serial, "get_concurrent_s": get_concurrent, "n_runs": -(-n // 256)}


# -- 4. the report ------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", nargs=2, metavar=("URL", "REF"))
    p.add_argument("--plan", action="store_true")
    p.add_argument("--shards", default="500,12500,125000")
    p.add_argument("--moto-shards", type=int, default=2500)
    p.add_argument("--out", default="docs/scale.md")
    p.add_argument("--resume-only", action="store_true",
                   help="measure only the compacted 125,000-shard resume; keep the other figures of the .json")
    p.add_argument("--billion-only", action="store_true",
                   help="measure only the billion-sample row; keep the other figures of the .json")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child_open(*args.child, args.plan)))
        return 0
    if args.resume_only:
        with open(os.path.splitext(args.out)[0] + ".json") as f:
            data = json.load(f)
        data["resume"].update(big_resume_row())
        return _write(args.out, data)
    if args.billion_only:
        with open(os.path.splitext(args.out)[0] + ".json") as f:
            data = json.load(f)
        with tempfile.TemporaryDirectory(prefix="featstore-scale-") as root:
            data["billion"] = billion_row(f"{root}/b")
        data["plans"] = plan_rows([int(x) for x in args.shards.split(",")] + [data["billion"]["shards"]])
        return _write(args.out, data)
    with tempfile.TemporaryDirectory(prefix="featstore-scale-") as root:
        print("manifests ...", file=sys.stderr)
        manifests = manifest_rows(f"{root}/m", [int(x) for x in args.shards.split(",")])
        print("a billion samples ...", file=sys.stderr)
        billion = billion_row(f"{root}/b")
        print(f"  {billion}", file=sys.stderr)
    plans = plan_rows([int(x) for x in args.shards.split(",")] + [billion["shards"]])
    print("resume on moto ...", file=sys.stderr)
    resume = resume_rows(args.moto_shards)
    print(f"  {resume}", file=sys.stderr)
    return _write(args.out, {"manifests": manifests, "billion": billion, "plans": plans, "resume": resume})


def _write(out: str, data: dict) -> int:
    from .scale_report import write_report

    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump(data, f, indent=1)
    with open(out, "w") as f:
        f.write(write_report(data))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
