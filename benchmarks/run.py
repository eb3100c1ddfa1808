"""Orchestration: profiles, repeats, the moto server, and the report.

    python -m benchmarks --profile quick      # N=10,000, 3 repeats: a few minutes on 2 cores
    python -m benchmarks --profile full       # N=100,000
    python -m benchmarks --only reader        # only the reader rows (issue 12), N=40,000
    python -m benchmarks --only diskcache     # only the disk cache rows (issue 20), N=20,000
    python -m benchmarks --only teachers      # only several teachers on the same views (issue 26)
    python -m benchmarks --only modes         # only online / compute-then-read / fill (issue 25), N=2,048
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from featstore.compute import tuned
from featstore.versions import stored
from . import diskcache, memory, reader, rows
from .measure import memcopy_gbps
from .peers import run_peers

log = logging.getLogger("benchmarks")


@dataclass(frozen=True)
class Profile:
    """How big a run is."""

    name: str
    n: int
    repeats: int = 3
    naive_subset: int = 1024       # row 1 runs on this many samples, extrapolated
    torchsave_subset: int = 4096   # row 3 trains on this many samples, extrapolated
    mem_n: int = 10_000            # the memory rows use mem_n and 10 x mem_n samples
    peers: bool = True
    s3: bool = True
    reader_n: int = 40_000         # the reader rows' light workload (issue 12)
    disk_n: int = 20_000           # the disk cache rows' light workload on S3 (issue 20)


PROFILES = {
    "quick": Profile("quick", n=20_000),
    "full": Profile("full", n=200_000, naive_subset=4096, torchsave_subset=16384, mem_n=20_000),
}


def _moto() -> tuple[subprocess.Popen, str]:
    """A moto S3 server in its own process (its memory and CPU are not the reader's)."""
    code = ("from moto.server import ThreadedMotoServer; import time; "
            "s = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False); s.start(); "
            "h, p = s.get_host_and_port(); print(f'http://{h}:{p}', flush=True); time.sleep(10**6)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline().strip() if proc.stdout else ""
    if not line.startswith("http"):
        proc.kill()
        raise RuntimeError("the moto server did not start")
    return proc, line


def _say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(profile: Profile, out_dir: str, workdir: str) -> dict[str, Any]:
    """Run every row ``profile.repeats`` times (interleaved, so noise spreads evenly)."""
    for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    moto, endpoint = _moto() if profile.s3 else (None, None)
    ctx = rows.Ctx(profile.n, workdir, endpoint, exclude_pids=(moto.pid,) if moto else ())
    res: dict[str, Any] = {"profile": asdict(profile), "reps": [], "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    t_start = time.perf_counter()
    try:
        res["memcopy_gbps"] = [memcopy_gbps() for _ in range(3)]
        for rep in range(profile.repeats):
            r: dict[str, Any] = {}
            _say(f"repeat {rep + 1}/{profile.repeats}: Model A in one process (+ torch.save files)")
            a = rows.a_pure_and_save(ctx)
            r["a_pure"] = {k: v for k, v in a.items() if k != "folder"}
            r["a_pure_sps"] = profile.n / a["forward_s"]
            r["in_memory"] = rows.in_memory(ctx, a["forward_s"])
            r["b_pure_sps"] = rows.b_pure(ctx)
            r["in_memory_w2_s"] = rows.in_memory_workers(ctx, 2)
            r["a_dask_over_main"] = rows.a_in_dask_over_main(ctx)
            _say("torch.save files")
            r["torch_save"] = rows.torch_save_files(ctx, a["folder"], a["forward_s"] + a["save_s"], a["bytes"],
                                                    profile.torchsave_subset)
            rows.cleanup(a["folder"])
            _say("naive and frozen submodule")
            r["naive"] = rows.naive(ctx, profile.naive_subset)
            r["frozen"] = rows.frozen(ctx)
            stores = [("local", rows.featstore.open_store(ctx.fresh("store")))]
            if endpoint:
                stores.append(("s3", ctx.s3_store()))
            for where, store in stores:
                _say(f"featstore {where}: compute")
                # The machine is shared: each featstore figure gets its own reference measured
                # right before it, so a ratio compares seconds apart, not minutes.
                r[f"fs_{where}_a_ref_s"] = rows.a_pure_only(ctx)
                with tuned():  # like for like: the malloc settings featstore's compute uses
                    r[f"fs_{where}_a_ref_tuned_s"] = rows.a_pure_only(ctx)
                v, c = rows.fs_compute(ctx, store)
                r[f"fs_{where}_compute"] = c
                for w in (0, 2):
                    _say(f"featstore {where}: train, {w} workers")
                    r[f"fs_{where}_w{w}_ref_s"] = rows.in_memory(ctx, 0.0)["train_s"]
                    tr, rss = rows.fs_train(ctx, v, w)
                    r[f"fs_{where}_w{w}"] = rows._row(c["compute_s"], tr, c["bytes"], rss,
                                                      writer_rss=c["worker_rss"])
                # A core left free: B on one torch thread, in memory and from featstore.
                with reader.torch_threads(1):
                    r[f"fs_{where}_t1_ref_s"] = rows.in_memory(ctx, 0.0)["train_s"]
                    r[f"fs_{where}_t1_s"] = rows.fs_train(ctx, v, 0)[0].seconds
                rr = rows.fs_read_rate(v, 0, server_pid=moto.pid if where == "s3" and moto else None)
                r[f"fs_{where}_read_sps"] = rr["sps"]
                r[f"fs_{where}_read_bps"] = c["bytes"] / rr["secs"]
                r[f"fs_{where}_read_cpu_s"] = rr["cpu_s"]
                r[f"fs_{where}_server_cpu_s"] = rr["server_cpu_s"]
                r[f"fs_{where}_raw_bps"], _ = rows.raw_read_rate(v, concurrency=4)
                if where == "local":
                    store.storage.delete(stored(v).key, recursive=True)
            res["reps"].append(r)
        res["reader"] = reader.run_reader(profile.reader_n, profile.repeats, workdir, endpoint, _say)
        _say("memory: the reader and a writer worker at N and 10 x N")
        res["memory"] = _memory(ctx, profile, workdir)
        res["peers"] = {"unavailable": "disabled by --no-peers"}
        if profile.peers:
            _say("LitData and Mosaic Streaming (peers' environment)")
            data_dir = ctx.fresh("peers-data")
            rows.export_for_peers(ctx, data_dir)
            res["peers"] = run_peers(data_dir, os.path.join(workdir, "peers"), profile.repeats, endpoint,
                                     [0, 2], torch.get_num_threads())
    finally:
        if moto is not None:
            moto.kill()
    res["elapsed_s"] = time.perf_counter() - t_start
    res["machine"] = _machine()
    return res


def _memory(ctx: rows.Ctx, profile: Profile, workdir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in (profile.mem_n, 10 * profile.mem_n):
        root = ctx.fresh(f"mem-{n}")
        v, writer_peak = memory.replay_version(root, ctx.memory, n, ctx.exclude_pids)
        readers = [memory.reader_peak(root, v.id) for _ in range(3)]
        out[str(n)] = {"writer_worker_rss": writer_peak, "reader": readers,
                       "shard_bytes": v.manifest.layout.samples_per_shard * (512 * 2 + 1000 * 4 + 8),
                       "samples_per_shard": v.manifest.layout.samples_per_shard}
        rows.cleanup(root)
    return out


def _machine() -> dict[str, Any]:
    import dask
    import fsspec
    import numpy
    import s3fs
    import zarr

    import featstore

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    import psutil

    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(), "os": platform.platform(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "featstore": featstore.__version__,
            "zarr": zarr.__version__, "numpy": numpy.__version__, "dask": dask.__version__,
            "fsspec": fsspec.__version__, "s3fs": s3fs.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    p.add_argument("-n", type=int, default=None, help="samples (overrides the profile)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--mem-n", type=int, default=None, help="memory rows use this and 10x (overrides)")
    p.add_argument("--no-peers", action="store_true", help="skip LitData and Mosaic Streaming")
    p.add_argument("--no-s3", action="store_true", help="skip the S3 (moto) rows")
    p.add_argument("--out", default="docs", help="folder for benchmarks.md/.png/.json (default docs)")
    p.add_argument("--workdir", default=None, help="scratch folder (default: a temp folder, removed)")
    p.add_argument("--only", choices=["all", "reader", "diskcache", "teachers", "modes"], default="all",
                   help="'reader' / 'diskcache' / 'teachers' / 'modes': only those rows, written into their section "
                        "of benchmarks.md ('teachers': python -m benchmarks.teachers with its defaults)")
    args = p.parse_args(argv)
    if args.only == "teachers":  # its own knobs: python -m benchmarks.teachers --help
        from . import teachers

        return teachers.main(["--out", args.out], "python -m benchmarks " + " ".join(
            argv if argv is not None else sys.argv[1:]))
    prof = PROFILES[args.profile]
    prof = replace(prof, n=args.n or prof.n, repeats=args.repeats or prof.repeats,
                   mem_n=args.mem_n or prof.mem_n,
                   peers=prof.peers and not args.no_peers, s3=prof.s3 and not args.no_s3)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    work = args.workdir or tempfile.mkdtemp(prefix="featstore-bench-")
    command = "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.only == "reader":
        return _reader_only(prof, args, work, command.strip())
    if args.only == "diskcache":
        return _diskcache_only(prof, args, work, command.strip())
    if args.only == "modes":
        from .modes import main as modes_main

        res = modes_main(args.n or 2048, args.out, command.strip(), _say)
        _say(f"wrote the modes rows into {args.out}/benchmarks.md in {res['elapsed_s']:.0f} s")
        return 0
    try:
        res = run(prof, args.out, work)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    res["command"] = command.strip()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "benchmarks.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    from .report import write_report

    write_report(res, args.out)
    _say(f"wrote {args.out}/benchmarks.md, .png and .json in {res['elapsed_s']:.0f} s")
    return 0


def _reader_only(prof: Profile, args: argparse.Namespace, work: str, command: str) -> int:
    """Run the reader rows alone and update only their section of benchmarks.md."""
    for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    moto, endpoint = _moto() if prof.s3 else (None, None)
    t0 = time.perf_counter()
    try:
        res = reader.run_reader(args.n or prof.reader_n, prof.repeats, work, endpoint, _say)
    finally:
        if moto is not None:
            moto.kill()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    res.update(command=command, elapsed_s=time.perf_counter() - t0, machine=_machine(), load=reader.load_note())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "benchmarks-reader.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    reader.write_section(os.path.join(args.out, "benchmarks.md"), reader.section(res, command, res["load"]))
    _say(f"wrote the reader rows into {args.out}/benchmarks.md in {res['elapsed_s']:.0f} s")
    return 0


def _diskcache_only(prof: Profile, args: argparse.Namespace, work: str, command: str) -> int:
    """Run the disk cache rows alone (they need S3: moto) and update only their section."""
    for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    moto, endpoint = _moto()
    t0 = time.perf_counter()
    try:
        res = diskcache.run_diskcache(args.n or prof.disk_n, prof.repeats, work, endpoint, _say,
                                      peers=not args.no_peers)
    finally:
        moto.kill()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    res.update(command=command, elapsed_s=time.perf_counter() - t0, machine=_machine(), load=reader.load_note())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "benchmarks-diskcache.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    diskcache.write_section(os.path.join(args.out, "benchmarks.md"), diskcache.section(res, command, res["load"]))
    _say(f"wrote the disk cache rows into {args.out}/benchmarks.md in {res['elapsed_s']:.0f} s")
    return 0
