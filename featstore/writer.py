"""The compute driver: validate the call, fingerprint it, run the shard tasks on Dask, commit.

The driver plans and watches; the work happens in :mod:`featstore.tasks` (inside Dask tasks),
the version's lifecycle (claim, receipts, commit) in :mod:`featstore.versions`, and what goes
into Zarr in :mod:`featstore.format`. Reading is not this module's business: the writer and
the reader never import each other.
"""

from __future__ import annotations

import datetime as _dt
import logging
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
import zarr

from ._version import __version__
from .cluster import Cluster, connect, task_resources, workers
from .codecs import keep_codec, output_codec
from .errors import ComputeFailed, EmptyDataset, FeatstoreError, InvalidInput, OutputMismatch
from .fingerprint import dataset_digest, describe_key, fingerprint, model_digest
from .format import RESERVED_FIELDS, check_compression, choose_compression, chunk_label
from .manifest import ArraySpec, Layout, Manifest, ShardReceipt, ViewsSpec
from .names import check_field, check_name
from .stats import summarize
from .tasks import TaskSpec, probe, release_models, run_shards, select
from .versions import Catalog, Claim, Version
from .views import SEED_FIELD, SEED_POLICY, VIEW_FIELD, check_replayable, replay, view_seed

log = logging.getLogger("featstore")

MIN_SHARDS = 8


@dataclass(frozen=True)
class ComputeOptions:
    """Less common knobs of :func:`compute`, grouped so the call stays short.

    Attributes:
        dataset_id: names the dataset's exact contents; replaces the sampled content digest.
        model_id: names Model A's exact weights; needed to avoid building a factory locally.
        allow_nonfinite: store NaN/Inf instead of raising :class:`NonFiniteOutput`.
        autocast: ``"float16"``/``"bfloat16"`` to run A under ``torch.autocast`` (part of the
            fingerprint, since it changes the outputs).
        target_shard_bytes: uncompressed bytes per shard when ``samples_per_shard`` is None.
        chunk_rows: rows per Zarr chunk inside a shard (None: about 1 MiB of the widest array).
        progress: show a terminal progress bar.
        n_workers: workers of the embedded LocalCluster (None: one per GPU, else one).
        processes: whether the embedded LocalCluster's workers are processes. None: processes
            when the machine has GPUs (one per GPU), else one worker thread in this process,
            which measured 1.4-1.9x faster compute on a 2-core CPU machine (no worker start-up,
            no pickling of A and the dataset, and a faster forward than in a worker process).
        compression: ``"zstd"``, ``"none"`` or ``"auto"``: zstd for each array where it saves
            at least 10% of the bytes on the probe batch (fp16 features, labels), none where it
            does not (float32 logits are nearly incompressible, and zstd would slow every read
            ~10x for a few percent of storage). The choice is recorded per array in the manifest.
        tune_allocator: on CPU workers with glibc, keep freed memory for reuse while a shard
            task runs instead of mapping and zeroing fresh pages for every activation tensor
            (measured 2.5x on the demo CNN); see :mod:`featstore.allocator`.
    """

    dataset_id: str | None = None
    model_id: str | None = None
    allow_nonfinite: bool = False
    autocast: str | None = None
    target_shard_bytes: int = 16 * 2**20
    chunk_rows: int | None = None
    progress: bool = True
    n_workers: int | None = None
    processes: bool | None = None
    compression: str = "auto"
    tune_allocator: bool = True

    def __post_init__(self) -> None:
        check_compression(self.compression)


# ---------------------------------------------------------------------------------------------
# Pure helpers: selecting fields, normalising outputs, sizing the layout.
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Pure helpers: the validated call, its fingerprint, the layout.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Request:
    """A validated ``compute`` call (what the fingerprint and the tasks are built from)."""

    name: str
    n: int
    input_key: Any
    keep: dict[str, Any]
    outputs: dict[str, str]
    batch_size: int
    samples_per_shard: int | None
    views: int | None = None
    augment: Any = None
    augment_seed: int = 0


def normalize_keep(keep: Sequence[Any] | Mapping[str, Any]) -> dict[str, Any]:
    """``["target"]`` -> ``{"target": "target"}``; ``{"label": 1}`` stays; ints get ``field<i>``."""
    if isinstance(keep, str):
        keep = [keep]
    pairs = keep.items() if isinstance(keep, Mapping) else ((k if isinstance(k, str) else f"field{k}", k) for k in keep)
    return {check_field(name): key for name, key in pairs}


def _validate(name: str, dataset: Any, input_key: Any, keep: Sequence[Any] | Mapping[str, Any],
              outputs: Mapping[str, str] | None, batch_size: int, samples_per_shard: int | None,
              options: "ComputeOptions", views: int | None = None, augment: Any = None,
              augment_seed: int = 0) -> _Request:
    """Check every argument before anything runs; bad input raises with what to change."""
    check_name(name)
    if outputs is None:
        outputs = {"features": "float32"}
    if not isinstance(outputs, Mapping) or not outputs:
        raise InvalidInput("outputs must be a non-empty dict like {'features': 'float16'}.")
    outputs = {check_field(k): output_codec(v).name for k, v in outputs.items()}
    keep_map = normalize_keep(keep)
    reserved = set(RESERVED_FIELDS) | ({VIEW_FIELD, SEED_FIELD} if views is not None else set())
    clash = (set(outputs) & set(keep_map)) | ((set(outputs) | set(keep_map)) & reserved)
    if clash:
        raise InvalidInput(f"array names {sorted(clash)} are used twice or reserved; rename them.")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidInput(f"batch_size must be a positive int, got {batch_size!r}.")
    if options.autocast not in (None, "float16", "bfloat16"):
        raise InvalidInput("ComputeOptions.autocast must be None, 'float16' or 'bfloat16'.")
    try:
        n = len(dataset)
    except TypeError:
        raise InvalidInput("dataset must be a map-style dataset with __len__ and __getitem__.") from None
    if n == 0:
        raise EmptyDataset("the dataset is empty; there is nothing to compute. Check its path or filter.")
    first = _first_seen(dataset, n, views, augment, augment_seed)
    select(first, input_key, "input")
    for k in keep_map.values():
        select(first, k, "keep field")
    return _Request(name, n, input_key, keep_map, outputs, batch_size, samples_per_shard,
                    views, augment, augment_seed)


def _first_seen(dataset: Any, n: int, views: int | None, augment: Any, augment_seed: int) -> Any:
    """The first item as Model A will see it, after checking the views arguments; with views,
    ``augment`` is replayed twice on two items and must give the same bytes both times."""
    if views is None:
        if augment is not None:
            raise InvalidInput("augment= needs views=K (K augmented views per sample are computed and "
                               "stored); for one augmented view pass views=1.")
        return dataset[0]
    if isinstance(views, bool) or not isinstance(views, int) or views < 1:
        raise InvalidInput(f"views must be a positive int (augmented views per sample), got {views!r}.")
    if not callable(augment):
        raise InvalidInput("views=K needs augment=fn, where fn(item, generator) -> item draws all its "
                           "randomness from the torch.Generator it is given.")
    if isinstance(augment_seed, bool) or not isinstance(augment_seed, int):
        raise InvalidInput(f"augment_seed must be an int, got {augment_seed!r}.")
    check_replayable(dataset, augment, augment_seed, sorted({0, n // 2}))
    return replay(augment, dataset[0], view_seed(augment_seed, 0, 0))


def views_spec(req: _Request) -> ViewsSpec | None:
    """The views part of the fingerprint and the manifest (None without views)."""
    if req.views is None:
        return None
    return ViewsSpec(req.views, req.augment_seed, SEED_POLICY, describe_key(req.augment))


def _fingerprint_parts(req: _Request, model: Any, dataset: Any, options: "ComputeOptions") -> dict[str, Any]:
    """Everything that decides the stored bytes (see the README section on fingerprints)."""
    return {
        "model": model_digest(model, options.model_id),
        "dataset": dataset_digest(dataset, options.dataset_id),
        "input_key": describe_key(req.input_key),
        "keep": {k: describe_key(v) for k, v in req.keep.items()},
        "outputs": req.outputs,
        # Compression never changes the values, but it changes the stored bytes (and digests).
        "codecs": {"chunk": chunk_label(options.compression), "schema": 1},
        "autocast": options.autocast,
        # Only with views, so versions without them keep their ids.
        **({} if req.views is None else {"views": asdict(views_spec(req))}),
    }


def choose_layout(n: int, row_bytes: Sequence[int], samples_per_shard: int | None,
                  chunk_rows: int | None, target_shard_bytes: int) -> Layout:
    """Rows per shard and per chunk: about ``target_shard_bytes`` per shard, at least
    ``MIN_SHARDS`` shards when N allows (so readers have something to spread), 1 MiB chunks."""
    widest = max(max(row_bytes), 1)
    total = max(sum(row_bytes), 1)
    if chunk_rows is None:
        chunk_rows = 1 << max(4, min(14, (2**20 // widest).bit_length() - 1))
    if samples_per_shard is None:
        by_bytes = max(1, target_shard_bytes // total)
        spread = -(-n // MIN_SHARDS)
        samples_per_shard = max(1, min(by_bytes, spread))
    if samples_per_shard < 1 or chunk_rows < 1:
        raise InvalidInput("samples_per_shard and chunk_rows must be positive integers.")
    chunk_rows = min(chunk_rows, samples_per_shard)
    samples_per_shard = -(-samples_per_shard // chunk_rows) * chunk_rows
    return Layout(n_samples=n, samples_per_shard=samples_per_shard, chunk_rows=chunk_rows)


class _Progress:
    """Terminal progress (samples/s and ETA), fed by worker events."""

    def __init__(self, total: int, done: int, name: str, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=done, unit="sample", unit_scale=True,
                            desc=f"compute {name}", file=sys.stderr, dynamic_ncols=True)
        self.lock = threading.Lock()

    def __call__(self, event: Any) -> None:
        _, n = event
        if self.bar is not None:
            with self.lock:
                self.bar.update(int(n))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _spec_arrays(probed: Mapping[str, tuple[tuple[int, ...], str, float]], outputs: Mapping[str, str],
                 keep: Mapping[str, Any], compression: str) -> dict[str, ArraySpec]:
    arrays = {}
    for name, codec_name in outputs.items():
        shape, dtype, saving = probed[name]
        if not getattr(torch, dtype).is_floating_point:
            raise OutputMismatch(f"output {name!r} is {dtype}; Model A outputs must be floating point.")
        codec = output_codec(codec_name)
        arrays[name] = ArraySpec(codec.name, codec.stored, shape, "output",
                                 choose_compression(compression, saving))
    for name in keep:
        shape, dtype, saving = probed[name]
        codec = keep_codec(getattr(torch, dtype))
        arrays[name] = ArraySpec(codec.name, codec.stored, shape, "keep",
                                 choose_compression(compression, saving))
    return arrays


def _libraries() -> dict[str, str]:
    import dask
    import fsspec

    return {"featstore": __version__, "torch": torch.__version__, "zarr": zarr.__version__,
            "numpy": np.__version__, "dask": dask.__version__, "fsspec": fsspec.__version__,
            "python": sys.version.split()[0]}


# ---------------------------------------------------------------------------------------------
# The driver.
# ---------------------------------------------------------------------------------------------
def compute(catalog: Catalog, name: str, *, model: Any, dataset: Any, input_key: Any = "input",
            keep: Sequence[Any] | Mapping[str, Any] = (), outputs: Mapping[str, str] | None = None,
            batch_size: int = 256, samples_per_shard: int | None = None, client: Any = None,
            options: ComputeOptions | None = None, views: int | None = None, augment: Any = None,
            augment_seed: int = 0) -> Version:
    """Compute Model A's outputs over ``dataset`` with Dask and commit them as one version.

    Args:
        catalog: the store the version goes to (a :class:`~featstore.FeatureStore`).
        name: the feature set (``"resnet50/imagenet-train"``).
        model: an ``nn.Module`` or a zero-argument factory that builds it on each worker.
        dataset: a map-style dataset; items may be tensors, tuples or dicts.
        input_key: which field of an item goes into A (key, index, callable, or None: the item).
        keep: per-sample fields stored beside A's outputs (``["target"]`` or ``{"label": 1}``).
        outputs: ``{output name: codec}``; A returns one tensor (one name) or a dict of them.
            Codecs: ``float32`` (exact), ``float16`` (a cast), ``bfloat16``.
        batch_size: samples per forward of A.
        samples_per_shard: rows per Zarr shard (one object); None picks ~16 MiB shards.
        client: None (an embedded LocalCluster is started and closed), a ``distributed.Client``
            or a scheduler address.
        options: :class:`ComputeOptions`.
        views: K augmented views per sample (None: the items as they are, one view). View ``v``
            of sample ``i`` is ``augment(dataset[i], torch.Generator().manual_seed(s))`` with
            ``s = version.view_seed(i, v)``; A runs on it and every stored array (outputs,
            ``keep`` fields, which may name extra fields ``augment`` returns) is stored per view.
        augment: ``fn(item, generator) -> item``; all its randomness must come from
            ``generator`` (checked: two replays must agree, else :class:`NondeterministicAugment`).
        augment_seed: the version's seed, from which every (sample, view) seed derives.

    Returns the committed :class:`Version`; if a version with the same fingerprint is already
    committed it is returned at once, without running A. If the run dies, calling ``compute``
    again recomputes only the shards without a receipt.

    >>> v = compute(store, "cnn-a/train", model=model_a, dataset=train_set, keep=["target"],
    ...             outputs={"features": "float16", "logits": "float32"})
    """
    options = options or ComputeOptions()
    t0 = time.perf_counter()
    req = _validate(name, dataset, input_key, keep, outputs, batch_size, samples_per_shard, options,
                    views, augment, augment_seed)
    parts = _fingerprint_parts(req, model, dataset, options)
    fp = fingerprint(parts)
    vid = fp[:16]
    existing = catalog.committed(name, vid)
    if existing is not None:
        log.info("version %s@%s already committed; nothing to compute", name, vid)
        return existing
    run = _run(catalog, req, vid, model, dataset, client, options)
    receipts = catalog.collect_receipts(name, vid, run.claim.layout, run.receipts, req.views)
    manifest = Manifest(
        id=vid, name=name, fingerprint=fp, fingerprint_parts=parts, layout=run.claim.layout,
        arrays=run.claim.arrays, stats=summarize((r.stats for r in receipts), run.claim.arrays),
        shards=tuple(ShardReceipt(r.index, r.start, r.stop, r.digests, view=r.view) for r in receipts),
        created_at=_dt.datetime.now(_dt.UTC).isoformat(),
        timings={**run.timings, "total_s": round(time.perf_counter() - t0, 3),
                 "shards_computed": len(run.receipts)},
        libraries=_libraries(),
        views=views_spec(req),
    )
    return catalog.commit(manifest)


@dataclass(frozen=True)
class _RunResult:
    claim: Claim
    receipts: list[ShardReceipt]
    timings: dict[str, float]


def _run(catalog: Catalog, req: _Request, vid: str, model: Any, dataset: Any, client: Any,
         options: ComputeOptions) -> _RunResult:
    """Start (or join) a cluster, probe A, claim the version folder, run the missing shards."""
    t_setup = time.perf_counter()
    # One model per compute call and worker: same weights may come with different code.
    run_key = f"{vid}-{uuid.uuid4().hex[:8]}"
    cluster = connect(client, options.n_workers, options.processes)
    try:
        print(f"featstore: Dask dashboard at {cluster.dashboard_link}", file=sys.stderr)
        dclient = cluster.client
        model_f = dclient.scatter(model, broadcast=True, hash=False)
        data_f = dclient.scatter(dataset, broadcast=True, hash=False)
        resources = task_resources(dclient)
        base = TaskSpec(catalog.storage, req.name, vid, run_key, req.input_key, req.keep, req.outputs, {},
                        Layout(req.n, 1, 1), req.batch_size, options.allow_nonfinite, options.autocast,
                        cluster.torch_threads(), f"featstore-progress-{vid}",
                        tune_allocator=options.tune_allocator, view=None if req.views is None else 0,
                        augment=req.augment, augment_seed=req.augment_seed)
        probed = _result(dclient.submit(probe, base, model_f, data_f, req.n, key=f"featstore-probe-{vid}",
                                        resources=resources, pure=False))
        claim = _claim(catalog, req, vid, probed, options)
        dtypes = {k: d for k, (_, d, _) in probed.items()} | ({} if req.views is None else {SEED_FIELD: "int64"})
        spec = TaskSpec(**{**base.__dict__, "arrays": claim.arrays, "layout": claim.layout, "dtypes": dtypes})
        todo, done = _units(claim, req.views)
        done_rows = sum(b - a for a, b in (claim.layout.shard_range(i) for _, i in done))
        log.info("computing %s@%s: %d shards to do, %d already finished", req.name, vid, len(todo), len(done))
        t_compute = time.perf_counter()
        receipts = _run_tasks(cluster, spec, model_f, data_f, todo, done_rows, resources, options,
                              req.n * (req.views or 1))
    finally:
        cluster.close()
        release_models(run_key)
    timings = {"setup_s": round(t_compute - t_setup, 3), "compute_s": round(time.perf_counter() - t_compute, 3)}
    return _RunResult(claim, receipts, timings)


def _claim(catalog: Catalog, req: _Request, vid: str, probed: Mapping[str, tuple[tuple[int, ...], str, float]],
           options: ComputeOptions) -> Claim:
    """The arrays the probe found, their layout, and the claim (which may adopt a concurrent
    run's layout and compression)."""
    arrays = _spec_arrays(probed, req.outputs, req.keep, options.compression)
    if req.views is not None:  # replay seeds: random 63-bit integers, which zstd cannot shrink
        arrays[SEED_FIELD] = ArraySpec(keep_codec(torch.int64).name, keep_codec(torch.int64).stored, (), "seed",
                                       choose_compression(options.compression, 0.0))
    row_bytes = [int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize for a in arrays.values()]
    layout = choose_layout(req.n, row_bytes, req.samples_per_shard, options.chunk_rows, options.target_shard_bytes)
    return catalog.claim(req.name, vid, layout, arrays, req.views)


Unit = tuple[int | None, int]  # (view or None, shard): the unit of tasks, receipts and resume


def _units(claim: Claim, views: int | None) -> tuple[list[Unit], list[Unit]]:
    """The (view, shard) units still to compute and those already finished."""
    n = claim.layout.n_shards
    if views is None:
        return ([(None, i) for i in range(n) if i not in claim.done], [(None, i) for i in sorted(claim.done)])
    every = [(v, i) for v in range(views) for i in range(n)]
    return [u for u in every if u not in claim.done_views], sorted(claim.done_views)


def task_groups(units: Sequence[Unit], per_task: int) -> list[tuple[int | None, list[int]]]:
    """Runs of at most ``per_task`` consecutive units of one view: one Dask task each.

    >>> task_groups([(0, 0), (0, 1), (0, 2), (1, 0)], 2)
    [(0, [0, 1]), (0, [2]), (1, [0])]
    """
    groups: list[tuple[int | None, list[int]]] = []
    for view, shard in units:
        if not groups or groups[-1][0] != view or len(groups[-1][1]) >= per_task:
            groups.append((view, []))
        groups[-1][1].append(shard)
    return groups


def _result(future: Any) -> Any:
    try:
        return future.result()
    except FeatstoreError as exc:
        exc.args = (f"{exc} [Dask task {future.key}]", *exc.args[1:])
        raise
    except Exception as exc:  # noqa: BLE001 - anything else a task raised
        raise ComputeFailed(f"compute task {future.key} failed: {type(exc).__name__}: {exc}") from exc


def _run_tasks(cluster: Cluster, spec: TaskSpec, model_f: Any, data_f: Any, todo: list[Unit], done_rows: int,
               resources: dict | None, options: ComputeOptions, total_rows: int) -> list[ShardReceipt]:
    """Submit the shard tasks (a few long ones per worker) and gather their receipts."""
    from distributed import as_completed

    from distributed import span

    if not todo:
        return []
    client = cluster.client
    n_workers = max(1, len(workers(client)))
    # Few, long tasks: the write of a task's last shard cannot overlap the next forward.
    per_task = max(1, -(-len(todo) // (2 * n_workers)))
    bar = _Progress(total_rows, done_rows, spec.name, options.progress)
    client.subscribe_topic(spec.topic, bar)
    futures = []
    try:
        with span(f"featstore-compute-{spec.name}"):
            for view, g in task_groups(todo, per_task):
                key = f"featstore-shards-{spec.vid}{'' if view is None else f'-v{view}'}-{g[0]:06d}-{g[-1]:06d}"
                futures.append(client.submit(run_shards, replace(spec, view=view), model_f, data_f, g, key=key,
                                             resources=resources, pure=False, retries=0))
            receipts = []
            for fut in as_completed(futures):
                receipts.extend(ShardReceipt.from_json(r) for r in _result(fut))
        return receipts
    except BaseException:
        for f in futures:
            f.cancel()
        raise
    finally:
        time.sleep(0.05)  # let the last progress events arrive
        client.unsubscribe_topic(spec.topic)
        bar.close()
