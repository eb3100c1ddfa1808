"""``docs/benchmarks.md`` and ``docs/benchmarks.png`` from one run's results."""

from __future__ import annotations

import math
import os
import statistics
from typing import Any

from .gpu_check import gpu_section, replace_section
from .measure import Stat
from .peers import SETUP

MiB = 2**20


def _stat(values: list[float | None]) -> Stat | None:
    v = [x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return Stat.of(v) if v else None


def _f(s: Stat | None, digits: int = 2, scale: float = 1.0) -> str:
    if s is None:
        return "n/a"
    return f"{s.median / scale:.{digits}f} ({s.lo / scale:.{digits}f}–{s.hi / scale:.{digits}f})"


def _rows(res: dict[str, Any]) -> list[tuple[str, dict[str, Stat | None], str]]:
    reps = res["reps"]

    def col(key: str, field: str) -> Stat | None:
        return _stat([r[key].get(field) for r in reps if key in r])

    table = []
    labels = [
        ("1. naive: A in `__getitem__` per sample", "naive", "extrapolated from a subset"),
        ("2. frozen submodule: A every step", "frozen", ""),
        ("3. per-batch `torch.save` files, per-sample load", "torch_save", "training extrapolated from a subset"),
        ("4. in-memory tensor, indexed by batch", "in_memory", "compute = A in one process"),
        ("5. featstore local, 0 workers", "fs_local_w0", ""),
        ("5. featstore local, 2 workers", "fs_local_w2", ""),
        ("6. featstore S3 (moto), 0 workers", "fs_s3_w0", ""),
        ("6. featstore S3 (moto), 2 workers", "fs_s3_w2", ""),
    ]
    for label, key, note in labels:
        if not any(key in r for r in reps):
            continue
        stats = {f: col(key, f) for f in ("compute_s", "train_s", "total_s", "bytes", "main_rss", "worker_rss", "acc")}
        if key.startswith("fs_"):
            stats["worker_rss"] = col(key, "writer_rss") if stats["worker_rss"] is None else stats["worker_rss"]
        table.append((label, stats, note))
    a_pure = _stat([r["a_pure"]["forward_s"] for r in reps])
    peers = res.get("peers", {})
    for peer, title in (("litdata", "LitData"), ("mosaic", "Mosaic Streaming")):
        p = peers.get(peer)
        if not p or "reps" not in p:
            continue
        for where in ("local", "s3"):
            for w in (0, 2):
                k = f"{where}_w{w}"
                if k not in p["reps"][0] or "error" in p["reps"][0][k]:
                    continue
                extra = "upload_s" if where == "s3" else None
                compute = [a_pure.median + r["store_s"] + (r.get(extra, 0.0) if extra else 0.0) for r in p["reps"]]
                train = [r[k]["train_s"] for r in p["reps"]]
                table.append((f"7. {title} {'local' if where == 'local' else 'S3 (moto)'}, {w} workers", {
                    "compute_s": _stat(compute), "train_s": _stat(train),
                    "total_s": _stat([c + t for c, t in zip(compute, train, strict=True)]),
                    "bytes": _stat([r["bytes"] for r in p["reps"]]),
                    "main_rss": _stat([r[k]["main_rss"] for r in p["reps"]]),
                    "worker_rss": _stat([r[k]["worker_rss"] for r in p["reps"]]),
                    "acc": _stat([r[k]["acc"] for r in p["reps"]]),
                }, "compute = A in one process (median) + the library's write" + (" + upload" if extra else "")))
    return table


def _paired(res: dict[str, Any], num: Any, den: Any) -> Stat | None:
    vals = []
    for r in res["reps"]:
        try:
            vals.append(num(r) / den(r))
        except (KeyError, TypeError, ZeroDivisionError):
            pass
    return _stat(vals)


def targets(res: dict[str, Any]) -> list[tuple[str, str, Stat | None, str, bool | None]]:
    """(target, threshold, measured ratio, how measured, met)."""
    out = []

    def add(name: str, thr: str, s: Stat | None, how: str, ok: Any) -> None:
        out.append((name, thr, s, how, None if s is None else bool(ok(s.median))))

    n = res["profile"]["n"]
    add("compute: featstore writer throughput / A pure in one process, same malloc settings", "≥ 0.90",
        _paired(res, lambda r: r["fs_local_a_ref_tuned_s"], lambda r: r["fs_local_compute"]["writer_s"]),
        "writer phase from the manifest (`timings.compute_s`), local store, vs a pass of A in one "
        "process measured right before it with `featstore.compute.tuned()`, as the writer runs A",
        lambda x: x >= 0.90)
    add("compute vs a user's loop: featstore writer throughput / A pure with glibc's defaults", "(info)",
        _paired(res, lambda r: r["fs_local_a_ref_s"], lambda r: r["fs_local_compute"]["writer_s"]),
        "what a user gets over their own loop of A: featstore's compute also keeps freed "
        "activations for reuse (`ComputeOptions.tune_allocator`)", lambda x: True)
    add("Dask bound: A pure inside an in-process Dask task / A pure in the main thread", "(info)",
        _stat([r["a_dask_over_main"] for r in res["reps"] if r.get("a_dask_over_main")]),
        "same loop, same malloc settings, no writing: the scheduler's and worker's own threads "
        "share the 2 cores", lambda x: True)
    add("compute incl. Dask start-up: A pure time / featstore compute wall time", "(info)",
        _paired(res, lambda r: r["fs_local_a_ref_s"], lambda r: r["fs_local_compute"]["compute_s"]),
        "store.compute() wall time, LocalCluster start-up and probe included", lambda x: True)
    for w in (0, 2):
        add(f"local training, {w} workers: featstore / in-memory tensor (3 epochs)", "≤ 1.10",
            _paired(res, lambda r, w=w: r[f"fs_local_w{w}"]["train_s"], lambda r, w=w: r[f"fs_local_w{w}_ref_s"]),
            "the in-memory run measured right before each featstore run", lambda x: x <= 1.10)
    for w in (0, 2):
        add(f"S3 training, {w} workers: featstore / in-memory tensor (3 epochs)", "≤ 1.5",
            _paired(res, lambda r, w=w: r[f"fs_s3_w{w}"]["train_s"], lambda r, w=w: r[f"fs_s3_w{w}_ref_s"]),
            "the in-memory run measured right before each featstore run", lambda x: x <= 1.5)
    for where in ("local", "s3"):
        add(f"no-overlap bound, {where}: (in-memory training + 3 read-only epochs) / in-memory training", "(info)",
            _paired(res, lambda r, w=where: r[f"fs_{w}_w0_ref_s"] + 3 * n / r[f"fs_{w}_read_sps"],
                    lambda r, w=where: r[f"fs_{w}_w0_ref_s"]),
            "what the 0-worker ratio is if the reader's CPU work (decode, gather) cannot overlap B's step: "
            "on 2 cores B's 2 torch threads already use both", lambda x: True)
    for where in ("local", "s3"):
        add(f"{where} training, 0 workers, one core left free: featstore / in-memory, B on 1 torch thread",
            "(info)", _paired(res, lambda r, w=where: r[f"fs_{w}_t1_s"], lambda r, w=where: r[f"fs_{w}_t1_ref_s"]),
            "both runs with torch.set_num_threads(1): the reader's threads (and moto) get the other core",
            lambda x: True)
    add("2-worker ceiling: in-memory tensor through 2 DataLoader workers / in-memory tensor", "(info)",
        _paired(res, lambda r: r["in_memory_w2_s"], lambda r: r["in_memory"]["train_s"]),
        "the DataLoader worker machinery alone on 2 cores (persistent workers, shared-memory batches)",
        lambda x: True)
    add("S3 reader byte rate / raw GET rate (4 concurrent, same objects)", "≥ 0.8",
        _paired(res, lambda r: r["fs_s3_read_bps"], lambda r: r["fs_s3_raw_bps"]),
        "one read-only epoch, 0 workers, decode included", lambda x: x >= 0.8)
    add("S3 bound on 2 cores: raw GET time / (raw GET time + local read-only epoch time)", "(info)",
        _paired(res, lambda r: r["fs_s3_compute"]["bytes"] / r["fs_s3_raw_bps"],
                lambda r: r["fs_s3_compute"]["bytes"] / r["fs_s3_raw_bps"] + n / r["fs_local_read_sps"]),
        "the ratio expected if decoding (measured on the local store) cannot overlap moto's serving "
        "because both need the same 2 cores", lambda x: True)
    add("local reader byte rate / raw read rate (informational)", "(info)",
        _paired(res, lambda r: r["fs_local_read_bps"], lambda r: r["fs_local_raw_bps"]),
        "page-cache reads", lambda x: True)
    peers = res.get("peers", {})
    for peer, title in (("litdata", "LitData"), ("mosaic", "Mosaic Streaming")):
        p = peers.get(peer)
        for where in ("local", "s3"):
            mine = _stat([r.get(f"fs_{where}_read_sps") for r in res["reps"]])
            theirs = _stat([r.get(f"{where}_read_sps") for r in p["reps"]]) if p and "reps" in p else None
            s = Stat(mine.median / theirs.median, mine.lo / theirs.hi, mine.hi / theirs.lo, mine.n) \
                if mine and theirs else None
            add(f"reader samples/s, {where}: featstore / {title}", "≥ 1.0", s,
                "one read-only epoch each, 0 workers; medians (range: worst/best pairing)", lambda x: x >= 1.0)
    # On a local store compression="auto" keeps fp16 features raw (CPU matters there, issue 12);
    # the S3 version is the one that compresses them, when this run has one.
    where = "s3" if any("fs_s3_compute" in r for r in res["reps"]) else "local"
    add("storage, features: float16+zstd / float32 torch.save", "≤ 0.5",
        _paired(res, lambda r: r[f"fs_{where}_compute"]["array_bytes"]["features"],
                lambda r: n * 512 * 4), f"the features array of the {where} version (`compression='auto'`"
        " compresses them on S3, keeps them raw on a local store); torch.save stores float32 (n x 512 x 4 bytes)",
        lambda x: x <= 0.5)
    add("storage, whole version (fp16 features, fp32 logits) / torch.save files", "(info)",
        _paired(res, lambda r: r["fs_local_compute"]["bytes"], lambda r: r["torch_save"]["bytes"]),
        "logits are float32 in this workload", lambda x: True)
    mem = res.get("memory")
    if mem:
        (n1, a), (n2, b) = sorted(mem.items(), key=lambda kv: int(kv[0]))
        ra = statistics.median(x["peak_rss"] for x in a["reader"])
        rb = [x["peak_rss"] / ra for x in b["reader"]]
        add(f"memory: reader peak RSS at N={int(n2):,} / at N={int(n1):,}", "≤ 1.2", _stat(rb),
            "fresh process per read, 3 each", lambda x: x <= 1.2)
        add(f"memory: writer worker peak RSS at N={int(n2):,} / at N={int(n1):,}", "(info)",
            _stat([b["writer_worker_rss"] / a["writer_worker_rss"]]), "1 run each", lambda x: True)
    for other in ("frozen", "naive"):
        add(f"end to end, classic in-memory cache: {other} total / in-memory tensor total (row 4)", "(info)",
            _paired(res, lambda r, o=other: r[o]["total_s"], lambda r: r["in_memory"]["total_s"]),
            "A once in a plain loop (glibc defaults), then B from RAM", lambda x: True)
    for other, thr in (("frozen", 2.5), ("naive", 5.0)):
        add(f"end to end: {other} total / featstore local total (0 workers)", f"≥ {thr}",
            _paired(res, lambda r, o=other: r[o]["total_s"], lambda r: r["fs_local_w0"]["total_s"]),
            "featstore total = compute (Dask start-up included) + 3 epochs", lambda x, t=thr: x >= t)
    return out


# Why a target can be missed on a 2-core machine, shown only for the targets this run missed.
MISS_NOTES = (
    ("compute: featstore writer", "- *Compute*: the *Dask bound* row runs the same loop of A inside a "
     "Dask task with nothing written: the in-process scheduler's and worker's threads take their share of "
     "the 2 cores before any encoding. The rest is the writer's checks, statistics, zstd, crc32c and file "
     "writes, which on 2 cores cannot overlap A's forward because A's 2 torch threads use both cores."),
    ("end to end", "- *End to end*: the *classic in-memory cache* rows run A once in a plain loop and read "
     "from RAM: with 3 epochs the total is bounded by roughly 3 x (A + B) / (A + 3 B), and featstore adds "
     "the Dask start-up and the writer on the same 2 cores."),
    ("local training, 0", "- *Local training, 0 workers*: the *no-overlap bound* adds 3 read-only epochs "
     "to the in-memory time. On 2 cores B's 2 torch threads already use both cores, so the reader's decode "
     "cannot hide behind B's step; the *one core left free* row shows the same reader with a core to spare."),
    ("S3 training, 0", "- *S3 training, 0 workers*: moto serves the GETs from the same 2 cores (its CPU "
     "seconds per epoch are in the limits table), on top of the reader's decode; the *no-overlap bound* "
     "and the *one core left free* rows show both sides."),
    ("local training, 2", "- *Training with 2 workers*: the *2-worker ceiling* row serves the in-memory "
     "tensor itself through 2 persistent DataLoader workers; on 2 cores the worker processes and the "
     "shared-memory hand-off cost more than they hide, whatever the dataset."),
    ("S3 training, 2", "- *S3 training, 2 workers*: the *2-worker ceiling* applies, and moto's serving "
     "competes for the same 2 cores."),
    ("S3 reader byte rate", "- *S3 byte rate*: moto serves from the same 2 cores. The *S3 bound* row is "
     "the ratio expected when decoding cannot overlap moto's serving; the raw GET figure has no decode and "
     "leaves moto both cores."),
)


def write_report(res: dict[str, Any], out_dir: str) -> None:
    """Write benchmarks.md (and .png when matplotlib is installed) into ``out_dir``."""
    prof, m = res["profile"], res["machine"]
    reps = res["reps"]
    lines = [
        "# featstore benchmarks",
        "",
        f"Generated by `{res['command']}` ({prof['name']} profile, N={prof['n']:,} samples, "
        f"{prof['repeats']} repeats, {res['elapsed_s'] / 60:.1f} min, started {res['started']}).",
        "Every figure is the median of the repeats with (min–max); ratios are paired within a repeat.",
        "The machine is shared and noisy: compare ratios from one run, not absolute times.",
        "",
        "Workload: synthetic 3x32x32 images (`featstore.demo.SyntheticImages`, 10 classes); Model A is "
        "`featstore.demo.ModelA(features=512, classes=1000)`, a frozen CNN (~9 MFLOP/sample) giving "
        "512-d features (stored float16) and 1000-class logits (stored float32); Model B is an MLP "
        "(512→256, a 10-class head trained on the labels and a 1000-way head distilled from A's "
        "logits), Adam, batch 256, 3 epochs. All rows shuffle every epoch.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, {m['os']}. "
        f"Python {m['python']}, torch {m['torch']} ({m['torch_threads']} threads), featstore {m['featstore']}, "
        f"zarr {m['zarr']}, numpy {m['numpy']}, dask {m['dask']}, fsspec {m['fsspec']}, s3fs {m['s3fs']}"
        + "".join(f", {k} {v}" for k, v in res.get("peers", {}).get("versions", {}).items()) + ".",
        "",
        "## Rows",
        "",
        "| approach | compute s | 3 epochs of B s | total s | stored MiB | main peak RSS MiB | worker peak RSS MiB | B accuracy | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, s, note in _rows(res):
        lines.append(f"| {label} | {_f(s['compute_s'], 1)} | {_f(s['train_s'], 1)} | {_f(s['total_s'], 1)} | "
                     f"{_f(s['bytes'], 1, MiB)} | {_f(s['main_rss'], 0, MiB)} | {_f(s['worker_rss'], 0, MiB)} | "
                     f"{_f(s['acc'], 3)} | {note} |")
    lines += [
        "",
        "Worker peak RSS: the busiest child process during the row (a DataLoader worker with 2 workers); "
        "featstore's embedded Dask worker runs as a thread of the main process on a CPU-only machine, so "
        "the compute's peak is in the main column (the memory rows below run the writer in a worker "
        "process to measure it alone). Accuracy is the last epoch's training accuracy of B (n/a where "
        "extrapolated); rows that read the same stored precision in the same order match exactly.",
        "",
        "## Limits measured in the same run",
        "",
        "| limit | value |",
        "|---|---|",
        f"| Model A pure inference, one process, `inference_mode`, same data and threads | "
        f"{_f(_stat([r['a_pure_sps'] for r in reps]), 0)} samples/s |",
        f"| the same with `featstore.compute.tuned()` (freed activations kept for reuse) | "
        f"{_f(_stat([prof['n'] / r['fs_local_a_ref_tuned_s'] for r in reps if r.get('fs_local_a_ref_tuned_s')]), 0)} samples/s |",
        f"| Model B pure training steps on in-memory batches | {_f(_stat([r['b_pure_sps'] for r in reps]), 0)} samples/s |",
        f"| 3 epochs of B from the in-memory tensor through 2 DataLoader workers | {_f(_stat([r.get('in_memory_w2_s') for r in reps]), 2)} s |",
        f"| featstore compute (writer phase) | {_f(_stat([prof['n'] / r['fs_local_compute']['writer_s'] for r in reps]), 0)} samples/s |",
        f"| raw read of the stored objects, local (4 threads, page cache) | "
        f"{_f(_stat([r['fs_local_raw_bps'] for r in reps]), 0, MiB)} MiB/s |",
        f"| featstore reader, local, read-only epoch | {_f(_stat([r['fs_local_read_bps'] for r in reps]), 0, MiB)} MiB/s, "
        f"{_f(_stat([r['fs_local_read_sps'] for r in reps]), 0)} samples/s |",
        f"| CPU seconds of one read-only local epoch (the reader) | "
        f"{_f(_stat([r.get('fs_local_read_cpu_s') for r in reps]), 3)} s |",
    ]
    if any("fs_s3_raw_bps" in r for r in reps):
        lines += [
            f"| raw S3 GET of the same objects (moto loopback, 4 concurrent) | "
            f"{_f(_stat([r['fs_s3_raw_bps'] for r in reps]), 0, MiB)} MiB/s |",
            f"| featstore reader, S3, read-only epoch | {_f(_stat([r['fs_s3_read_bps'] for r in reps]), 0, MiB)} MiB/s, "
            f"{_f(_stat([r['fs_s3_read_sps'] for r in reps]), 0)} samples/s |",
            f"| CPU seconds of one read-only S3 epoch: the reader / the moto server | "
            f"{_f(_stat([r.get('fs_s3_read_cpu_s') for r in reps]), 3)} / "
            f"{_f(_stat([r.get('fs_s3_server_cpu_s') for r in reps]), 3)} s |",
        ]
    lines.append(f"| memory copy (numpy, 256 MiB) | {_f(_stat(res['memcopy_gbps']), 1)} GB/s |")
    peers = res.get("peers", {})
    for peer, title in (("litdata", "LitData"), ("mosaic", "Mosaic Streaming")):
        p = peers.get(peer)
        if p and "reps" in p:
            for where in ("local", "s3"):
                st = _stat([r.get(f"{where}_read_sps") for r in p["reps"]])
                if st:
                    lines.append(f"| {title} reader, {where}, read-only epoch | {_f(st, 0)} samples/s |")
    lines += ["", "## Targets (issue 3)", "", "| target | threshold | measured | met | how |", "|---|---|---|---|---|"]
    for name, thr, s, how, ok in targets(res):
        met = "n/a" if ok is None else ("yes" if ok else "**no**")
        if thr == "(info)":
            met = "info"
        lines.append(f"| {name} | {thr} | {_f(s, 2)} | {met} | {how} |")
    missed = [name for name, thr, s, how, ok in targets(res) if ok is False and thr != "(info)"]
    notes = [text for prefix, text in MISS_NOTES if any(m.startswith(prefix) for m in missed)]
    if notes:
        lines += ["", "How to read the misses (each backed by an info row of the same run):", "", *notes]
    mem = res.get("memory")
    if mem:
        lines += ["", "## Memory rows", "",
                  "| N | reader peak RSS MiB (fresh process, 1 epoch) | writer worker peak RSS MiB | rows per shard | uncompressed shard MiB |",
                  "|---|---|---|---|---|"]
        for n, d in sorted(mem.items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {int(n):,} | {_f(_stat([x['peak_rss'] for x in d['reader']]), 0, MiB)} | "
                         f"{d['writer_worker_rss'] / MiB:.0f} | {d['samples_per_shard']} | {d['shard_bytes'] / MiB:.1f} |")
        lines += ["", "These versions are written by featstore's real writer from a replay Model A that returns "
                  "A's outputs already computed (tiled), so 10 x N fits in the quick profile."]
    lines += ["", "## LitData and Mosaic Streaming", ""]
    if "unavailable" in peers:
        lines.append(f"Not run: {peers['unavailable']}")
    for peer, title in (("litdata", "LitData"), ("mosaic", "Mosaic Streaming")):
        p = peers.get(peer)
        if p and "error" in p:
            lines.append(f"- {title} failed here: `{p['error'][:500]}`")
        for k, v in (p or {}).get("reps", [{}])[0].items():
            if isinstance(v, dict) and "error" in v:
                lines.append(f"- {title}, {k.replace('_w', ', workers=')}: failed here with `{v['error']}`")
    lines += [
        "They are installed in a separate virtual environment, never as featstore dependencies, and run "
        "in a child process (`benchmarks/peers_child.py`) with the same torch, the same Model B and the "
        "same A outputs (exported as .npy). Both write with zstd. LitData: `optimize(..., "
        "chunk_bytes='16MB', compression='zstd', num_workers=1)` + `StreamingDataset(shuffle=True)` + "
        "`StreamingDataLoader`; S3 via `storage_options={'endpoint_url': ...}`. Mosaic: `MDSWriter("
        "compression='zstd', size_limit='16mb')` + `StreamingDataset(shuffle=True)` + `DataLoader`; S3 "
        "via `S3_ENDPOINT_URL`. Both copy S3 shards into a local cache as they read. Mosaic's top-level "
        "package imports torchvision for its vision datasets; PyPI's torchvision does not import beside "
        "the torch 2.13 CPU build, so the child registers an empty stand-in module (never called).",
        "",
        "Set-up (from the repository root):",
        "",
        "```bash",
        SETUP,
        "```",
        "",
        "The benchmark uses `$FEATSTORE_BENCH_PEERS_PYTHON` or `.venv-peers/bin/python`; without either it "
        "says so here and runs the other rows.",
        "",
        "![benchmark](benchmarks.png)",
        "",
    ]
    if res.get("reader"):
        from .reader import load_note, section

        lines += [section(res["reader"], res["command"], load_note()), ""]
    path = os.path.join(out_dir, "benchmarks.md")
    text, gpu = "\n".join(lines), gpu_section(path)  # the GPU check's section is written by its own script
    text = (replace_section(text, gpu) if gpu else text) + _kept_sections(path)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    _plot(res, os.path.join(out_dir, "benchmarks.png"))


#: Sections other benchmarks write into benchmarks.md between start/end markers of their own
#: (not the ``NAME:begin``/``NAME:end`` form): kept on rewrite too.
KEPT_SECTIONS = (("<!-- views-benchmark:start -->", "<!-- views-benchmark:end -->"),)


def _kept_sections(path: str) -> str:
    """Sections other benchmarks own (``<!-- NAME:begin -->`` ... ``<!-- NAME:end -->``, such as
    ``python -m benchmarks.softlabels``'s, and the pairs of :data:`KEPT_SECTIONS`, such as
    ``python -m benchmarks.views``'s), carried over when this report rewrites the file."""
    import re

    if not os.path.exists(path):
        return ""
    with open(path) as f:
        old = f.read()
    found = re.findall(r"<!-- (\w+):begin -->.*?<!-- \1:end -->", old, flags=re.S)
    blocks = [re.search(rf"<!-- {n}:begin -->.*?<!-- {n}:end -->", old, flags=re.S).group(0) for n in found]
    blocks += [start + old.split(start, 1)[1].split(end, 1)[0] + end
               for start, end in KEPT_SECTIONS if start in old and end in old.split(start, 1)[1]]
    return "".join("\n\n" + b for b in blocks) + ("\n" if blocks else "")


def _plot(res: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    table = _rows(res)
    labels = [t[0] for t in table][::-1]
    comp = [(t[1]["compute_s"].median if t[1]["compute_s"] else 0) for t in table][::-1]
    train = [(t[1]["train_s"].median if t[1]["train_s"] else 0) for t in table][::-1]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(labels) + 1.5))
    ax.barh(labels, comp, label="compute A's outputs", color="#8da0cb")
    ax.barh(labels, train, left=comp, label="3 epochs of B", color="#fc8d62")
    ax.set_xlabel("seconds (median of repeats)")
    ax.set_title(f"featstore benchmark, {res['profile']['name']} profile, N={res['profile']['n']:,}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
