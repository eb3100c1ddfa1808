"""``docs/scale.md`` from the figures :mod:`benchmarks.scale` measured (pure formatting and
the stated request-rate model; every figure labelled measured or computed)."""

from __future__ import annotations

import math

#: The stated model for what moto cannot show (S3's documented and commonly measured figures).
S3_GET_S = 0.010  # one small GET, first byte, same region
S3_LIST_PAGE_S = 0.050  # one LIST page of up to 1,000 keys
S3_PREFIX_GET_PER_S = 5500  # per partitioned prefix (AWS S3 performance guidelines)
AGGREGATE_GBPS = 50  # stated aggregate read rate of the whole training job
CONCURRENCY = 32  # featstore.versions.IO_THREADS
RUN = 256  # featstore.versions.RUN_EVERY
BIG = 125_000


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f} MB" if x >= 1e5 else f"{x / 1e3:.1f} kB"


def manifest_table(rows: list[dict]) -> str:
    out = ["| shards | schema | manifest | open (median of 3 processes) | RSS added by open | peak RSS added by open |",
           "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['shards']:,} | {r['schema']} | {_mb(r['manifest_bytes'])} | {r['open_s'] * 1e3:.1f} ms | "
                   f"{r['rss_open_mb']:.1f} MiB | {r['peak_open_mb']:.1f} MiB |")
    by = {(r["shards"], r["schema"]): r for r in rows}
    lo, hi = min(r["shards"] for r in rows), max(r["shards"] for r in rows)
    ratio = {s: by[(hi, s)]["open_s"] / max(by[(lo, s)]["open_s"], 1e-9) for s in (1, 2)}
    out.append("")
    out.append(f"Open time at {hi:,} vs {lo:,} shards (measured): schema 1 **{ratio[1]:.0f}x**, schema 2 "
               f"**{ratio[2]:.1f}x** (sub-millisecond either way: one small GET and a JSON parse).")
    return "\n".join(out)


def plan_table(rows: list[dict]) -> str:
    out = ["| shards | plan one consumer of 8,192: as the reader does (layout) | peak allocations | "
           "over listed sizes (O(shards)) | peak allocations | a consumer of one shard (layout) |",
           "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['shards']:,} | {r['uniform_s'] * 1e3:.2f} ms | {r['uniform_peak_mb']:.2f} MiB | "
                   f"{r['listed_s'] * 1e3:.2f} ms | {r['listed_peak_mb']:.2f} MiB | {r['uniform1_s'] * 1e3:.2f} ms |")
    lo, hi = min(rows, key=lambda r: r["shards"]), max(rows, key=lambda r: r["shards"])
    out += ["", f"Plan time at {hi['shards']:,} vs {lo['shards']:,} shards (measured, median of 5 consumers): "
            f"**{hi['uniform1_s'] / max(lo['uniform1_s'], 1e-9):.1f}x** for a consumer of one shard, "
            f"{hi['uniform_s'] / max(lo['uniform_s'], 1e-9):.1f}x for one of 8,192 consumers (its span grows "
            f"from part of one shard to ~{hi['shards'] // 8192 + 1} shards: the plan is O(its own pieces)), "
            f"{hi['listed_s'] / max(lo['listed_s'], 1e-9):.0f}x over listed sizes (the O(shards) path)."]
    return "\n".join(out)


def billion_table(b: dict) -> str:
    consumers = 1024 * 8
    return "\n".join([
        "| figure | value | how |",
        "|---|---:|---|",
        f"| samples | {b['n_samples']:,} | layout of `choose_layout` at the object-store default (64 MiB) |",
        f"| rows per shard / per chunk | {b['samples_per_shard']:,} / {b['chunk_rows']:,} | computed |",
        f"| shards (x 3 arrays = objects) | {b['shards']:,} ({3 * b['shards']:,}) | computed |",
        f"| manifest.json | {_mb(b['manifest_bytes'])} | measured |",
        f"| shard records (all shards, read by verify/extends only) | {_mb(b['records_bytes'])} "
        f"in {math.ceil(b['shards'] / 65536)} objects | measured |",
        f"| open a version, per process | {b['open_s'] * 1e3:.1f} ms | measured (fresh process, median of 3) |",
        f"| RSS added by open, per process (peak) | {b['rss_open_mb']:.1f} MiB ({b['peak_open_mb']:.1f} MiB) "
        "| measured |",
        f"| plan one consumer of {consumers:,} (1,024 ranks x 8 workers) | {b['plan_s'] * 1e3:.0f} ms | measured "
        "(each consumer plans only itself) |",
        f"| RSS added by open + plan | {b['rss_plan_mb']:.1f} MiB | measured |",
        f"| manifest bytes fetched by the whole job at start | {_mb(b['manifest_bytes'] * consumers)} | computed "
        f"({consumers:,} consumers x one manifest) |",
        f"| read all shard records (verify, extends) | {b['records_read_s']:.1f} s | measured, local disk |",
        "",
        "Opening is constant, and so is planning: a consumer evaluates the epoch's shard permutation only at "
        "the positions of its own span (`featstore.shuffle.ShardPermutation`, a keyed Feistel bijection with "
        "cycle walking) and finds its pieces by arithmetic on the layout (`plan.UniformShards`), where it "
        "used to draw the whole permutation and sum every shard's size (294 ms per consumer here before).",
    ])


def request_rate(b: dict) -> str:
    rate = AGGREGATE_GBPS * 1e9
    row = b["shard_mib"] * 2**20 / b["samples_per_shard"]
    lines = ["| shard size | shard reads/s | GETs/s on the version's prefix (3 arrays) | GETs/s per array folder | "
             "share of one prefix's 5,500 |", "|---:|---:|---:|---:|---:|"]
    for mib in (16, 64):
        reads = rate / (mib * 2**20)
        lines.append(f"| {mib} MiB | {reads:,.0f} | {3 * reads:,.0f} | {reads:,.0f} | "
                     f"{reads / S3_PREFIX_GET_PER_S:.0%} |")
    return "\n".join([
        f"All computed, at a stated aggregate read rate of **{AGGREGATE_GBPS} GB/s** (e.g. 1,024 GPUs at "
        f"~50 MB/s of features each) and rows of {row:,.0f} bytes (fp16[512] features, fp32[1000] logits, "
        "an int64 label). Each shard of each array is one object; a reader fetches whole shard objects "
        "(one GET per array per shard it reads).",
        "",
        *lines,
        "",
        "With the old 16 MiB default the job needs ~8,900 GET/s, above the 5,500 GET/s that S3 serves per "
        "partitioned prefix before it has split the bucket's key space; at 64 MiB it needs ~2,200 GET/s, "
        "spread over the three array folders (`<version>/features/`, `logits/`, `target/`), each a prefix "
        "S3 can partition on. The shard number follows in the key (`features/c/<shard>/0`), so S3's "
        "automatic splits under sustained load can spread one array over many partitions as well.",
        "",
        f"At 64 MiB one array folder reaches 5,500 GET/s only at ~{S3_PREFIX_GET_PER_S * 64 * 2**20 / 1e9:.0f} GB/s "
        "of aggregate reading (computed). A piece that needs only a few of a shard's inner chunks (at a "
        "consumer's edge) costs two ranged GETs (the index, then the chunks) instead of one whole-object GET, "
        "which keeps a reader's memory at the chunks it needs; whole-shard pieces, the common case, stay one GET.",
        "",
        spread_section(),
    ])


SPREADS = (1, 4, 16)


def spread_table(arrays: int = 3) -> str:
    """GETs/s per spread prefix at the stated read rate, by shard size and prefix count (computed)."""
    rate = AGGREGATE_GBPS * 1e9
    lines = ["| shard size | N | GETs/s per spread prefix (3 arrays) | share of 5,500 | GETs/s per array folder "
             "in a prefix | aggregate read rate at which one prefix reaches 5,500 GET/s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for mib in (16, 64):
        shard = mib * 2**20
        for n in SPREADS:
            per_prefix = arrays * rate / (shard * n)
            lines.append(f"| {mib} MiB | {n} | {per_prefix:,.0f} | {per_prefix / S3_PREFIX_GET_PER_S:.1%} | "
                         f"{per_prefix / arrays:,.0f} | {S3_PREFIX_GET_PER_S * shard * n / arrays / 1e9:,.0f} GB/s |")
    return "\n".join(lines)


def spread_section(arrays: int = 3) -> str:
    rate = AGGREGATE_GBPS * 1e9
    need = {mib: math.ceil(arrays * rate / (mib * 2**20 * S3_PREFIX_GET_PER_S)) for mib in (16, 64)}
    return "\n".join([
        "### Spreading a version over several prefixes",
        "",
        "`ComputeOptions(spread_prefixes=N)` (1 to 256; None or 1, the default, is the layout above) puts a "
        "version's shard objects under N top-level prefixes of the store, "
        "`<store>/_spread/<hh>/<name>/_versions/<id>/<array>/c/<shard>/0`, with `<hh>` two hex digits (`00` to "
        "N-1). Shard `s` goes to prefix `(h(id, view) + s) mod N`: round robin from a hashed offset, so every "
        "prefix holds the same number of the version's shards (within one), any run of consecutive shards "
        "touches as many prefixes as it can, and versions start at different prefixes. All arrays of a shard "
        "share its prefix. Metadata (`zarr.json`), receipts, records and the manifest stay in the version's "
        "folder; the manifest's layout records `\"spread\": N` (a manifest without it, any version written "
        "before, is 1).",
        "",
        "```python",
        "store.compute(\"cnn-a/train\", model=model_a, dataset=train_set, outputs={\"features\": \"float16\"},",
        "              options=featstore.ComputeOptions(spread_prefixes=16))",
        "```",
        "",
        "Everything featstore does finds the objects where they are: the reader (whole-object and ranged GETs, "
        "local memory maps), `version[a:b]`, `load()`, `verify()`, resume (receipts, and the check that a "
        "finished shard's objects are still stored, by one listing per prefix), `delete` and `gc` (a version's "
        "spread objects go with it; gc groups them with their version folder, so a committed version's are "
        "never touched), views (`_spread/<hh>/.../_views/<v>/...`) and `extends` (a child keeps its parent's "
        "spread and reads the parent's shards under the parent's prefixes; another `spread_prefixes` with "
        "`extends` is an `InvalidInput`). The spread is not part of the fingerprint (the values are the "
        "same): the first run of a version fixes it in its claim, and a resume with another value adopts it "
        "(with a warning).",
        "",
        "Plain Zarr does not find spread shards at the version's URL: there the arrays declare the chunk key "
        "encoding `featstore.mapped`, so Zarr refuses to open them (\"Unknown chunk key encoding\") instead of "
        "reading the missing shards as zeros. Open the group through the mapping store instead:",
        "",
        "```python",
        "group = zarr.open_group(version.zarr_store(), mode=\"r\")   # or version.view(v).zarr_store()",
        "group[\"features\"][:10]",
        "```",
        "",
        f"The arithmetic, computed, at the same {AGGREGATE_GBPS} GB/s ({arrays} arrays, one GET per array per "
        "shard read; N = 1 is the table above):",
        "",
        spread_table(arrays),
        "",
        "In general: GETs/s per prefix = arrays x read rate / (shard bytes x N), so N = ceil(arrays x read "
        "rate / (shard bytes x 5,500)) keeps every prefix under S3's budget, all its arrays counted against it "
        "(not only each array folder's share), without waiting for S3 to split "
        f"(at {AGGREGATE_GBPS} GB/s: {need[64]} at 64 MiB, {need[16]} at 16 MiB). S3 still has to partition "
        "new prefixes under load (503 SlowDown, retried, until it has): what spreading buys is N evenly "
        "loaded key ranges to split at, and, because the `_spread/<hh>/` prefixes are shared by every version "
        "of the store, a new version lands on prefixes S3 already split for earlier ones, where a new version "
        "folder starts cold. What it costs: a resume's and a commit's object check list N + 1 folders instead "
        "of one (concurrently), and `delete` removes N + 1 folders.",
    ])


def resume_section(r: dict) -> str:
    n = r["shards"]
    per_key_list = r["list_flat_s"] / n
    runs = math.ceil(BIG / RUN)
    rows = [
        "| step | featstore before | now | how |",
        "|---|---:|---:|---|",
        f"| find finished shards, {n:,} shards on moto | {r['old_claim_s']:.1f} s (list + {n:,} serial GETs) | "
        f"{r['list_runs_s'] * 1e3:.0f} ms (one listing of {r['n_runs']} run objects) | measured |",
        f"| same, receipts not yet compacted | | {r['list_flat_s']:.2f} s (listing only, no GET) | measured |",
        f"| read every receipt for the commit, {n:,} shards | {r['old_claim_s']:.1f} s | {r['read_runs_s']:.2f} s "
        f"({r['n_runs']} runs, {CONCURRENCY} concurrent) | measured |",
        f"| find finished shards, {BIG:,} shards on this moto | "
        f"{BIG * (r['get_serial_s'] + per_key_list) / 60:.0f} min | {runs * per_key_list:.1f} s | "
        "computed from the per-request costs measured here |",
        *([f"| find finished shards, {r['big_shards']:,} shards on moto, compacted | | "
           f"{r['big_list_s']:.2f} s (one listing of {r['big_runs']} runs) | measured |",
           f"| read every receipt for the commit, {r['big_shards']:,} shards on moto | | {r['big_read_s']:.1f} s "
           f"({r['big_runs']} runs, {CONCURRENCY} concurrent) | measured |"] if "big_shards" in r else []),
        f"| find finished shards, {BIG:,} shards on S3 | {BIG * S3_GET_S / 60:.0f} min "
        f"| {math.ceil(runs / 1000) * S3_LIST_PAGE_S:.2f} s | computed: {S3_GET_S * 1e3:.0f} ms a GET, "
        f"{S3_LIST_PAGE_S * 1e3:.0f} ms a LIST page |",
        f"| read receipts for the commit, {BIG:,} shards on S3 | {BIG * S3_GET_S / 60:.0f} min | "
        f"{math.ceil(runs / CONCURRENCY) * S3_GET_S:.2f} s + parsing | computed ({runs} runs, {CONCURRENCY} in "
        "flight: requests only; parsing 125,000 JSON receipts adds seconds of CPU, most of the moto figure above) |",
    ]
    return "\n".join([
        f"Moto here (a loaded 2-core machine) served {r['put_per_s']:.0f} PUT/s, one GET in "
        f"{r['get_serial_s'] * 1e3:.0f} ms serially and {r['get_concurrent_s'] * 1e3:.0f} ms each with "
        f"{CONCURRENCY} in flight (moto is CPU-bound, so concurrency buys little here; on S3 it does), and "
        f"listed {1 / per_key_list:,.0f} keys/s. Writing {BIG:,} per-shard receipts to it would take hours, so "
        f"the old way was measured at {n:,} shards and extrapolated with those per-request costs"
        + (f"; the new way was also measured at {r['big_shards']:,} shards, from the {r['big_runs']} run "
           "objects the tasks leave." if "big_shards" in r else "."),
        "",
        *rows,
        "",
        "A resumed compute runs before its first task: the probe (one batch of A), the claim (create-if-absent "
        "`_pending.json`, the arrays' `zarr.json`), and finding the finished shards, which is now names only: "
        "one listing of `_receipts/`, in which the driver has folded every 256 finished shards into one "
        "`run-<first>-<last>.json` (a crash leaves at most 255 unfolded). The commit reads "
        "the earlier runs' receipts (the runs, concurrently) for the shard records.",
    ])


CLUSTER = """## Running a compute on a multi-node Dask cluster

- **One worker per GPU.** Start one `dask worker` process per GPU, each with `--nthreads 1 --resources "GPU=1"`
  and `CUDA_VISIBLE_DEVICES` set to its GPU (the `dask-cuda` `dask cuda worker` command does exactly this). featstore
  gives every shard task `resources={"GPU": 1}` when the workers advertise GPUs, so no GPU ever runs two tasks,
  and Model A is built once per worker process and kept on its device across tasks.
- **Scheduler.** Pass the scheduler's address as `client="tcp://scheduler:8786"` (or a `distributed.Client`):
  featstore never starts or stops a cluster it was given. Progress reaches the driver as worker events, so
  the scheduler needs no featstore code to run a compute; its featstore dashboard page and `/metrics` come
  from the scheduler preload `dask scheduler --preload featstore.dashboard` (imported before the dashboard
  is built). The workers need featstore and Model A's code importable (the same image on every node).
- **Model A and the dataset.** Pass a zero-argument factory for a big model (`model=lambda: build_teacher()`,
  with `ComputeOptions(model_id=...)` naming its weights, so the driver need not build it to fingerprint it),
  and a dataset object that opens its files lazily on the worker: both are pickled once into the graph.
- **Credentials.** The store's `storage_options` travel, pickled, to every worker: put no secrets there. Give
  each node its own credential chain instead: an instance profile / IAM role (EC2, EKS IRSA), or
  `AWS_PROFILE`/`AWS_ACCESS_KEY_ID` in the workers' environment. featstore's S3 retry policy travels with
  the options, so every worker retries the same way.
- **Shards and tasks.** Each task owns whole shards (no two tasks write one object), and returns only small
  receipts; the driver holds one receipt per shard until the commit (at 1e9 samples ~75,000 small dicts).
  Killing the driver loses nothing written: rerunning `compute` with the same arguments resumes from the
  listing described above.
- **Growing.** When the dataset grows, `store.compute(name, ..., extends="name@<id>")` computes only the
  new samples (and the parent's last, partial shard) and references the parent's shards in place.
"""


def write_report(data: dict) -> str:
    b = data["billion"]
    return "\n\n".join([
        "# featstore at scale\n\nWritten by `python -m benchmarks.scale` (metadata only, no payload: the figures "
        "are about what grows with the number of shards). Each figure says whether it was measured on this "
        "machine or computed. This run shared a 2-core machine with several other jobs (load average ~30): "
        "absolute times are several times slower than on a quiet machine; the comparisons are side by side "
        "in one run.",
        "## The manifest no longer grows with the data\n\nSchema 1 (before) kept every shard's receipt "
        "(~300 bytes of JSON) in `manifest.json`, which every process parses on open. Schema 2 keeps the "
        "layout, arrays, codecs, fingerprint and statistics summary there, and each shard's digests and "
        "statistics in fixed-width binary records (`_records/<k>-<sha>.bin`, 96 bytes per array and shard, "
        "65,536 shards per object, each object's sha256 in the manifest), read only by `verify`, `compute` "
        "and `extends`. Schema 1 versions still open, verify and read. Synthetic versions at 3,584 rows per "
        "shard, each opened in a fresh process:\n\n" + manifest_table(data["manifests"]),
        "## A billion samples\n\n" + billion_table(b),
        *(["## Planning a consumer's epoch\n\nIn this process, 3,584 rows per shard (the last count is the billion "
           "row's shard count):\n\n" + plan_table(data["plans"])] if data.get("plans") else []),
        "## Requests per S3 prefix\n\n" + request_rate(b),
        "## Resume and commit\n\n" + resume_section(data["resume"]),
        CLUSTER,
    ]) + "\n"
