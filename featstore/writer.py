"""The compute side: Dask tasks run Model A over shard-aligned ranges and commit one version.

Each task owns whole Zarr shards (no two tasks ever write the same object). Model A is built
once per worker process and kept on that worker's device. Inside a task, a background thread
compresses and writes shard k while the forward of shard k+1 runs; a task returns only small
receipts. The driver writes the manifest (the commit) once every shard has a receipt.
"""

from __future__ import annotations

import copy
import datetime as _dt
import hashlib
import logging
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import zarr

from . import allocator
from . import codecs as _codecs
from .errors import (ComputeFailed, EmptyDataset, FeatstoreError, IncompatibleFormat, InvalidInput,
                     MissingInputKey, NonFiniteOutput, OutputMismatch, StoreConflict)
from .fingerprint import dataset_digest, describe_key, fingerprint, model_digest
from .manifest import ArraySpec, Layout, Manifest, ShardReceipt
from .names import check_field, check_name
from .storage import Storage
from .store import MANIFEST, RESERVED_FIELDS, FeatureStore, Version, version_key

log = logging.getLogger("featstore")

PENDING = "_pending.json"
RECEIPTS = "_receipts"
MIN_SHARDS = 8
NONFINITE_KEPT = 1000  # sample ids with NaN/Inf recorded in the manifest, per output
_AHEAD = 4  # batches a task may run ahead of its write thread


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
        _codecs.check_compression(self.compression)


# ---------------------------------------------------------------------------------------------
# Pure helpers: selecting fields, normalising outputs, sizing the layout.
# ---------------------------------------------------------------------------------------------
def select(item: Any, key: Any, what: str) -> Any:
    """Pick ``key`` out of a dataset item (dict key, tuple index, callable, or the item itself)."""
    if key is None:
        return item
    if callable(key):
        return key(item)
    try:
        return item[key]
    except (KeyError, IndexError, TypeError):
        have = (sorted(map(str, item)) if isinstance(item, Mapping)
                else f"a {type(item).__name__} of length {len(item)}" if hasattr(item, "__len__")
                else type(item).__name__)
        raise MissingInputKey(
            f"dataset items have no {what} {key!r} (items are {have}); pass the right "
            f"{'input_key' if what == 'input' else 'keep'} (a key, an index or a callable)."
        ) from None


def normalize_keep(keep: Sequence[Any] | Mapping[str, Any]) -> dict[str, Any]:
    """``["target"]`` -> ``{"target": "target"}``; ``{"label": 1}`` stays; ints get ``field<i>``."""
    if isinstance(keep, str):
        keep = [keep]
    pairs = keep.items() if isinstance(keep, Mapping) else ((k if isinstance(k, str) else f"field{k}", k) for k in keep)
    return {check_field(name): key for name, key in pairs}


def as_outputs(out: Any, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Model A's return value as ``{output name: tensor}``."""
    if isinstance(out, torch.Tensor):
        if len(names) != 1:
            raise OutputMismatch(f"Model A returned one tensor but outputs names {list(names)}; "
                                 "return a dict with those keys or name one output.")
        return {names[0]: out}
    if isinstance(out, Mapping):
        got = set(out)
        if got != set(names):
            raise OutputMismatch(f"Model A returned keys {sorted(map(str, got))}, expected "
                                 f"{sorted(names)}; change `outputs` to match.")
        bad = [k for k, v in out.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise OutputMismatch(f"Model A's outputs {bad} are not tensors.")
        return dict(out)
    raise OutputMismatch(f"Model A returned a {type(out).__name__}; return a tensor or a dict of tensors.")


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


# ---------------------------------------------------------------------------------------------
# Worker side: one Model A per process, tasks that own whole shards.
# ---------------------------------------------------------------------------------------------
_MODELS: dict[tuple[str, str], torch.nn.Module] = {}  # insertion-ordered: oldest first
_MODELS_LOCK = threading.Lock()
_MODELS_KEPT = 2


@dataclass(frozen=True)
class TaskSpec:
    """Everything a shard task needs, small and picklable (no tensors, no secrets in logs)."""

    storage: Storage
    name: str
    vid: str
    model_key: str
    input_key: Any
    keep: dict[str, Any]
    outputs: dict[str, str]
    arrays: dict[str, ArraySpec]
    layout: Layout
    batch_size: int
    allow_nonfinite: bool
    autocast: str | None
    threads: int
    topic: str
    dtypes: dict[str, str] = field(default_factory=dict)  # per array, as the first batch had them
    tune_allocator: bool = True

    @property
    def key(self) -> str:
        return version_key(self.name, self.vid)


def worker_device() -> torch.device:
    """CUDA when this process has a GPU, else CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def worker_model(model: Any, key: str, threads: int) -> torch.nn.Module:
    """Model A for this process: built (or unpickled) once, moved to the device once."""
    device = worker_device()
    if threads > 0 and device.type == "cpu":
        # Dask pins OMP_NUM_THREADS=1 in its workers, and OpenMP's setting is per thread: set
        # it in every task, on the thread that runs it. Always: torch.get_num_threads() can
        # report the process-wide value while this executor thread's OpenMP pool has one
        # thread (measured: the forward ran ~1.6x slower in a Dask worker process).
        torch.set_num_threads(threads)
    with _MODELS_LOCK:
        cached = _MODELS.get((key, str(device)))
        if cached is None:
            # A copy of a module: an in-process worker receives the caller's own object, and
            # .eval()/.requires_grad_(False)/.to() must not change the caller's model.
            built = copy.deepcopy(model) if isinstance(model, torch.nn.Module) else model()
            cached = built.to(device).eval().requires_grad_(False)
            _MODELS[(key, str(device))] = cached
            while len(_MODELS) > _MODELS_KEPT:  # free the device memory of older runs' models
                _MODELS.pop(next(iter(_MODELS)))
        return cached


def _fetch(dataset: Any, start: int, stop: int) -> list[Any]:
    getitems = getattr(dataset, "__getitems__", None)
    if getitems is not None:
        return list(getitems(list(range(start, stop))))
    return [dataset[i] for i in range(start, stop)]


def _forward(spec: TaskSpec, model: torch.nn.Module, items: list[Any], start: int) -> tuple[dict, dict]:
    from torch.utils.data import default_collate

    device = worker_device()
    try:
        x = default_collate([select(it, spec.input_key, "input") for it in items])
        kept = {n: torch.as_tensor(default_collate([select(it, k, "field") for it in items]))
                for n, k in spec.keep.items()}
    except FeatstoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - user datasets raise anything
        raise ComputeFailed(f"collating dataset items [{start}, {start + len(items)}) failed: "
                            f"{type(exc).__name__}: {exc}") from exc
    x = x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x
    try:
        with torch.inference_mode():
            if spec.autocast:
                with torch.autocast(device.type, dtype=getattr(torch, spec.autocast)):
                    out = model(x)
            else:
                out = model(x)
    except Exception as exc:  # noqa: BLE001
        raise ComputeFailed(f"Model A raised {type(exc).__name__}: {exc} on samples "
                            f"[{start}, {start + len(items)}); fix the model or the data, then "
                            "rerun: finished shards are kept.") from exc
    return as_outputs(out, list(spec.outputs)), kept


def _check_batch(spec: TaskSpec, values: dict[str, torch.Tensor], rows: int, start: int) -> None:
    for name, t in values.items():
        want = spec.arrays[name]
        if tuple(t.shape) != (rows, *want.shape):
            raise OutputMismatch(
                f"{name!r} has shape {tuple(t.shape)} on samples [{start}, {start + rows}), but "
                f"{(rows, *want.shape)} was expected (from the first batch); Model A's output "
                "shape must not change between batches.")
        dtype = str(t.dtype).removeprefix("torch.")
        if spec.dtypes and dtype != spec.dtypes[name]:
            raise OutputMismatch(
                f"{name!r} has dtype {dtype} on samples [{start}, {start + rows}), but the first "
                f"batch had {spec.dtypes[name]}; Model A's output dtype must not change between batches.")


def _encode(spec: TaskSpec, values: dict[str, torch.Tensor], start: int) -> tuple[dict, dict]:
    encoded, stats = {}, {}
    for name, t in values.items():
        want = spec.arrays[name]
        codec = _codecs.codec_by_name(want.codec)
        bad_rows: list[int] = []
        all_finite = None
        if want.source == "output":  # one finiteness pass serves the check and the statistics
            bad = ~torch.isfinite(t).reshape(t.shape[0], -1).all(dim=1)
            all_finite = not bool(bad.any())
            bad_rows = [] if all_finite else (torch.nonzero(bad).reshape(-1) + start).tolist()
            if bad_rows and not spec.allow_nonfinite:
                raise NonFiniteOutput(
                    f"Model A produced NaN/Inf in {name!r} for {len(bad_rows)} samples (first: "
                    f"{bad_rows[:10]}); fix the model or data, or pass "
                    "ComputeOptions(allow_nonfinite=True) to store them.")
        arr = codec.encode(t)
        s = _codecs.value_stats(t, all_finite)
        if bad_rows:
            s["nonfinite_samples"] = bad_rows[:NONFINITE_KEPT]
        if codec.lossy:
            s["max_abs_error"] = _codecs.max_abs_error(codec, arr, t)
        encoded[name], stats[name] = arr, s
    return encoded, stats


def _open_arrays(spec: TaskSpec) -> dict[str, zarr.Array]:
    store = spec.storage.zarr_store(spec.key, read_only=False)
    # write_empty_chunks is a runtime setting, lost on reopen: without it an all-fill-value shard
    # is never stored, and a committed version must hold every shard object.
    return {n: zarr.open_array(store, path=n, mode="r+").with_config({"write_empty_chunks": True})
            for n in spec.arrays}


def _write_shard(spec: TaskSpec, arrays: dict[str, zarr.Array], index: int,
                 buffers: dict[str, np.ndarray], stats: dict[str, dict]) -> ShardReceipt:
    start, stop = spec.layout.shard_range(index)
    digests = {}
    for name, buf in buffers.items():
        arrays[name][start:stop] = buf
        digests[name] = hashlib.sha256(np.ascontiguousarray(buf).tobytes()).hexdigest()
    receipt = ShardReceipt(index, start, stop, digests, stats)
    # The receipt is written only after every array of the shard is stored: it is the marker.
    spec.storage.write_json(f"{spec.key}/{RECEIPTS}/{index:06d}.json", receipt.to_json())
    return receipt


def _progress(topic: str, n: int) -> None:
    try:
        from distributed import get_worker

        get_worker().log_event(topic, n)
    except (ImportError, ValueError):
        pass


def _fetch_checked(dataset: Any, b0: int, b1: int) -> list[Any]:
    try:
        return _fetch(dataset, b0, b1)
    except Exception as exc:  # noqa: BLE001
        raise ComputeFailed(f"the dataset raised {type(exc).__name__}: {exc} reading "
                            f"samples [{b0}, {b1}); finished shards are kept.") from exc


def _store_batch(spec: TaskSpec, values: dict[str, torch.Tensor], b0: int, b1: int, start: int,
                 buffers: dict[str, np.ndarray], stats: dict[str, dict]) -> None:
    """Check, encode and copy one batch into its shard's buffers (runs on the write thread)."""
    _check_batch(spec, values, b1 - b0, b0)
    enc, st = _encode(spec, values, b0)
    for n, arr in enc.items():
        buffers[n][b0 - start:b1 - start] = arr
        stats[n] = _codecs.merge_stats(stats.get(n), st[n])


def _write_checked_shard(batch_jobs: list[Future], spec: TaskSpec, arrays: dict[str, zarr.Array], index: int,
                         buffers: dict[str, np.ndarray], stats: dict[str, dict]) -> ShardReceipt:
    """Write a shard only if every one of its batches was checked and stored: the write thread
    keeps running jobs after one fails, and a shard with a failed batch (NaN, a shape change)
    holds uninitialised rows that must never get a receipt."""
    for job in batch_jobs:
        job.result()  # already done (same thread, earlier in order): re-raises a failure
    return _write_shard(spec, arrays, index, buffers, stats)


def run_shards(spec: TaskSpec, model: Any, dataset: Any, shards: Sequence[int]) -> list[dict]:
    """The Dask task: compute and store whole shards, return their receipts as JSON dicts.

    Three stages overlap, so Model A's forward is the only work on the task's own thread: a
    fetch thread reads batch i+1 from the dataset, the task runs A on batch i, and a write
    thread checks and encodes batch i-1 and compresses and writes finished shards, in order.
    At most ``_AHEAD`` batches wait for the write thread, which bounds memory to a few shards.
    """
    net = worker_model(model, spec.model_key, spec.threads)
    with allocator.tuned(spec.tune_allocator and worker_device().type == "cpu"):
        return _run_shards(spec, net, dataset, shards)


def _run_shards(spec: TaskSpec, net: torch.nn.Module, dataset: Any, shards: Sequence[int]) -> list[dict]:
    arrays = _open_arrays(spec)
    plan = []  # (shard index, batch start, batch stop, last batch of the shard)
    for index in shards:
        start, stop = spec.layout.shard_range(index)
        for b0 in range(start, stop, spec.batch_size):
            b1 = min(b0 + spec.batch_size, stop)
            plan.append((index, b0, b1, b1 == stop))
    receipts: list[dict] = []
    with ThreadPoolExecutor(1, thread_name_prefix="featstore-write") as pool, \
            ThreadPoolExecutor(1, thread_name_prefix="featstore-fetch") as fetcher:
        waiting: deque[Future] = deque()  # batch and shard jobs on the write thread, in order
        writes: deque[Future] = deque()
        buffers: dict[str, np.ndarray] = {}
        stats: dict[str, dict] = {}
        nxt = fetcher.submit(_fetch_checked, dataset, plan[0][1], plan[0][2]) if plan else None
        try:
            for k, (index, b0, b1, last) in enumerate(plan):
                items = nxt.result()
                if k + 1 < len(plan):
                    nxt = fetcher.submit(_fetch_checked, dataset, plan[k + 1][1], plan[k + 1][2])
                start, stop = spec.layout.shard_range(index)
                if b0 == start:
                    buffers = {n: np.empty((stop - start, *a.shape), dtype=a.dtype) for n, a in spec.arrays.items()}
                    stats = {}
                    batch_jobs: list[Future] = []
                outs, kept = _forward(spec, net, items, b0)
                _progress(spec.topic, b1 - b0)  # from the task's thread: Dask knows the worker there
                job = pool.submit(_store_batch, spec, {**outs, **kept}, b0, b1, start, buffers, stats)
                waiting.append(job)
                batch_jobs.append(job)
                if last:
                    fut = pool.submit(_write_checked_shard, batch_jobs, spec, arrays, index, buffers, stats)
                    waiting.append(fut)
                    writes.append(fut)
                while len(waiting) > _AHEAD or (waiting and waiting[0].done()):
                    waiting.popleft().result()  # raises the first failure, in batch order
                while writes and writes[0].done():
                    receipts.append(writes.popleft().result().to_json())
            while waiting:
                waiting.popleft().result()
            receipts.extend(f.result().to_json() for f in writes)
        except BaseException:
            for f in waiting:
                f.cancel()
            raise
    return receipts


PROBE_ROWS = 64


def probe(spec: TaskSpec, model: Any, dataset: Any, n: int) -> dict[str, tuple[tuple[int, ...], str, float]]:
    """Run A on the first samples (one small batch) on a worker.

    Returns, per array, the per-sample shape and dtype every batch must keep and the share of
    bytes zstd saves on this batch as stored (what ``compression="auto"`` decides on).
    """
    net = worker_model(model, spec.model_key, spec.threads)
    outs, kept = _forward(spec, net, _fetch(dataset, 0, min(n, spec.batch_size, PROBE_ROWS)), 0)
    out = {}
    for name, t in {**outs, **kept}.items():
        try:
            codec = _codecs.output_codec(spec.outputs[name]) if name in outs else _codecs.keep_codec(t.dtype)
            saving = _codecs.zstd_saving(codec.cast(t))
        except InvalidInput:  # an unstorable dtype: the driver reports it with the array's name
            saving = 1.0
        out[name] = (tuple(t.shape[1:]), str(t.dtype).removeprefix("torch."), saving)
    return out


# ---------------------------------------------------------------------------------------------
# Driver side.
# ---------------------------------------------------------------------------------------------
@dataclass
class _Cluster:
    client: Any
    owned: list = field(default_factory=list)
    in_process: bool = False  # an embedded cluster whose worker is a thread of this process

    def close(self) -> None:
        for obj in reversed(self.owned):
            obj.close()


def _connect(client: Any, options: ComputeOptions) -> _Cluster:
    from distributed import Client, LocalCluster

    if client is None:
        gpus = torch.cuda.device_count()
        n = options.n_workers or max(gpus, 1)
        cores = os.cpu_count() or 1
        processes = bool(gpus) if options.processes is None else options.processes
        cluster = LocalCluster(
            n_workers=n, threads_per_worker=1, processes=processes,
            # The dashboard on loopback only: it shows task names and can run code.
            dashboard_address="127.0.0.1:8787", silence_logs=logging.ERROR,
            resources={"GPU": 1} if gpus else None,
            memory_limit=0,
            # env= is for worker processes only (an in-process worker keeps this process's)
            **({"env": {"OMP_NUM_THREADS": str(max(1, cores // n))}, "host": "127.0.0.1"} if processes else {}),
        )
        c = Client(cluster)
        return _Cluster(c, [cluster, c], in_process=not processes)
    if isinstance(client, str):
        c = Client(client)
        return _Cluster(c, [c])
    return _Cluster(client)


def _workers(client: Any) -> dict[str, dict]:
    try:
        return client.scheduler_info(n_workers=-1)["workers"]
    except TypeError:  # older distributed lists every worker by default
        return client.scheduler_info()["workers"]


def _has_gpu_resource(client: Any) -> bool:
    return any("GPU" in (w.get("resources") or {}) for w in _workers(client).values())


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
        codec = _codecs.output_codec(codec_name)
        arrays[name] = ArraySpec(codec.name, codec.stored, shape, "output",
                                 _codecs.choose_compression(compression, saving))
    for name in keep:
        shape, dtype, saving = probed[name]
        codec = _codecs.keep_codec(getattr(torch, dtype))
        arrays[name] = ArraySpec(codec.name, codec.stored, shape, "keep",
                                 _codecs.choose_compression(compression, saving))
    return arrays


def _prepare(storage: Storage, key: str, layout: Layout,
             arrays: dict[str, ArraySpec]) -> tuple[Layout, dict[str, ArraySpec], set[int]]:
    """Claim the version folder (or join the run that claimed it); return the layout and arrays
    to use and the shards already finished.

    Never deletes anything: a concurrent compute of the same fingerprint may be writing here or
    may just have committed. The first run creates ``_pending.json`` (create-if-absent) and so
    fixes the layout; every later run (a resume, or a concurrent run) adopts that layout: same
    fingerprint, same content, the layout only cuts it into shards. Shards with a receipt are
    skipped; the rest may be written by several runs at once, with the same bytes.
    """
    from .storage import canonical_json

    pending = _json_roundtrip({"layout": layout.__dict__, "arrays": {n: a.__dict__ for n, a in arrays.items()}})
    founder = storage.create(f"{key}/{PENDING}", canonical_json(pending))
    claimed = pending if founder else storage.read_json(f"{key}/{PENDING}")
    if claimed is None:  # removed by a run that committed in between: that commit will be adopted
        claimed = pending
    def sans_compression(specs: Any) -> Any:
        return {n: {k: v for k, v in a.items() if k != "compression"} for n, a in (specs or {}).items()}

    if sans_compression(claimed.get("arrays")) != sans_compression(pending["arrays"]):
        raise StoreConflict(
            f"{storage.child_url(key)} is being (or was) computed with other arrays "
            f"({sorted(claimed.get('arrays') or {})}) for the same fingerprint; wait for that run, "
            "or delete the uncommitted version folder if no run is alive, then rerun.")
    try:
        claimed_layout = Layout(**{k: int(v) for k, v in claimed["layout"].items()})
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise IncompatibleFormat(f"{storage.child_url(key)}/{PENDING} is malformed ({exc}); delete the "
                                 "uncommitted version folder and rerun.") from exc
    # "auto" compression is decided on the probe batch; a resume adopts the founder's choice
    # (a GPU's nondeterminism could tip a borderline array the other way).
    arrays = {n: replace(a, compression=str(claimed["arrays"][n].get("compression", "zstd")))
              for n, a in arrays.items()}
    if claimed_layout != layout:
        log.warning("%s: another run fixed the layout (%d samples per shard); using it instead of %d",
                    key, claimed_layout.samples_per_shard, layout.samples_per_shard)
        layout = claimed_layout
    try:
        group = zarr.open_group(storage.zarr_store(key, read_only=False), mode="a")
    except zarr.errors.ContainsGroupError:  # a concurrent run created it between look and create
        group = zarr.open_group(storage.zarr_store(key, read_only=False), mode="r+")
    for name, a in arrays.items():
        shape = (layout.n_samples, *a.shape)
        try:
            existing = group[name]
        except KeyError:
            existing = None
        if existing is not None:
            if existing.shape == shape and existing.shards == (layout.samples_per_shard, *a.shape):
                continue  # created by the founder or an earlier run: identical metadata
            raise StoreConflict(f"array {name!r} under {storage.child_url(key)} has another layout "
                                "than its claim; if no compute of it is running, delete that "
                                "uncommitted version folder and rerun.")
        try:
            group.create_array(
                name, shape=shape, dtype=a.dtype,
                chunks=(layout.chunk_rows, *a.shape), shards=(layout.samples_per_shard, *a.shape),
                compressors=_codecs.zarr_codecs(a.compression), fill_value=0,
                config={"write_empty_chunks": True},
                dimension_names=("sample", *(f"{name}_{i}" for i in range(1, 1 + len(a.shape)))),
                attributes={"featstore": {"codec": a.codec, "source": a.source}},
            )
        except zarr.errors.ContainsArrayError:
            pass  # a concurrent run created it a moment ago, from the same claim
    done = set()
    for entry in storage.list_dirs(f"{key}/{RECEIPTS}"):
        obj = storage.read_json(f"{key}/{RECEIPTS}/{entry}") if entry.endswith(".json") else None
        if obj is None:
            continue
        r = ShardReceipt.from_json(obj)
        if (r.start, r.stop) == layout.shard_range(r.index) and set(r.digests) == set(arrays):
            done.add(r.index)
    return layout, arrays, done


def _json_roundtrip(obj: Any) -> Any:
    import json

    return json.loads(json.dumps(obj))


def _libraries() -> dict[str, str]:
    import dask
    import fsspec

    from . import __version__

    return {"featstore": __version__, "torch": torch.__version__, "zarr": zarr.__version__,
            "numpy": np.__version__, "dask": dask.__version__, "fsspec": fsspec.__version__,
            "python": sys.version.split()[0]}


def compute(store: FeatureStore, name: str, *, model: Any, dataset: Any, input_key: Any = "input",
            keep: Sequence[Any] | Mapping[str, Any] = (), outputs: Mapping[str, str] | None = None,
            batch_size: int = 256, samples_per_shard: int | None = None, client: Any = None,
            options: ComputeOptions | None = None) -> Version:
    """Compute Model A's outputs over ``dataset`` with Dask and commit them as one version.

    Args:
        store: where the version goes.
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

    Returns the committed :class:`Version`; if a version with the same fingerprint is already
    committed it is returned at once, without running A. If the run dies, calling ``compute``
    again recomputes only the shards without a receipt.
    """
    options = options or ComputeOptions()
    t0 = time.perf_counter()
    check_name(name)
    if outputs is None:
        outputs = {"features": "float32"}
    if not isinstance(outputs, Mapping) or not outputs:
        raise InvalidInput("outputs must be a non-empty dict like {'features': 'float16'}.")
    outputs = {check_field(k): _codecs.output_codec(v).name for k, v in outputs.items()}
    keep_map = normalize_keep(keep)
    clash = (set(outputs) & set(keep_map)) | ((set(outputs) | set(keep_map)) & set(RESERVED_FIELDS))
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
    first = dataset[0]
    select(first, input_key, "input")
    for k in keep_map.values():
        select(first, k, "keep field")

    mdigest = model_digest(model, options.model_id)
    parts = {
        "model": mdigest,
        "dataset": dataset_digest(dataset, options.dataset_id),
        "input_key": describe_key(input_key),
        "keep": {k: describe_key(v) for k, v in keep_map.items()},
        "outputs": outputs,
        # Compression never changes the values, but it changes the stored bytes (and digests).
        "codecs": {"chunk": f"{options.compression}(zstd level {_codecs.ZSTD_LEVEL})+crc32c", "schema": 1},
        "autocast": options.autocast,
    }
    fp = fingerprint(parts)
    vid = fp[:16]
    key = version_key(name, vid)
    storage = store.storage
    existing = store._manifest(name, vid)
    if existing is not None:
        log.info("version %s@%s already committed; nothing to compute", name, vid)
        return Version(storage, existing)

    t_setup = time.perf_counter()
    # One model per compute call and worker: same weights may come with different code.
    run_key = f"{vid}-{uuid.uuid4().hex[:8]}"
    cluster = _connect(client, options)
    try:
        dclient = cluster.client
        link = dclient.dashboard_link
        if cluster.owned:  # our own dashboard listens on loopback only
            link = re.sub(r"//[^/:]+", "//127.0.0.1", link, count=1)
        print(f"featstore: Dask dashboard at {link}", file=sys.stderr)
        # Dask pins OMP_NUM_THREADS=1 in its workers; our own cluster gives torch its share.
        # An in-process worker keeps this process's torch threads as they are (threads=0).
        threads = (max(1, (os.cpu_count() or 1) // max(1, len(_workers(dclient))))
                   if cluster.owned and not cluster.in_process else 0)
        topic = f"featstore-progress-{vid}"
        model_f = dclient.scatter(model, broadcast=True, hash=False)
        data_f = dclient.scatter(dataset, broadcast=True, hash=False)
        base = TaskSpec(storage, name, vid, run_key, input_key, keep_map, outputs, {}, Layout(n, 1, 1),
                        batch_size, options.allow_nonfinite, options.autocast,
                        threads, topic, tune_allocator=options.tune_allocator)
        resources = {"GPU": 1} if _has_gpu_resource(dclient) else None
        probed = _result(dclient.submit(probe, base, model_f, data_f, n, key=f"featstore-probe-{vid}",
                                        resources=resources, pure=False))
        arrays = _spec_arrays(probed, outputs, keep_map, options.compression)
        row_bytes = [int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize for a in arrays.values()]
        layout = choose_layout(n, row_bytes, samples_per_shard, options.chunk_rows, options.target_shard_bytes)
        layout, arrays, done = _prepare(storage, key, layout, arrays)  # may adopt a concurrent run's layout
        spec = TaskSpec(**{**base.__dict__, "arrays": arrays, "layout": layout,
                           "dtypes": {k: d for k, (_, d, _) in probed.items()}})
        todo = [i for i in range(layout.n_shards) if i not in done]
        done_rows = sum(b - a for a, b in map(layout.shard_range, done))
        log.info("computing %s@%s: %d shards to do, %d already finished", name, vid, len(todo), len(done))
        t_compute = time.perf_counter()
        receipts = _run(dclient, spec, model_f, data_f, todo, done_rows, resources, options)
    finally:
        cluster.close()
        with _MODELS_LOCK:  # an in-process worker cached A in this process: release it
            for k in [k for k in _MODELS if k[0] == run_key]:
                del _MODELS[k]
    t_written = time.perf_counter()

    all_receipts = _collect_receipts(storage, key, layout, arrays, receipts)
    stats = {}
    for a in arrays:
        merged = None
        for r in all_receipts:
            merged = _codecs.merge_stats(merged, r.stats[a])
        stats[a] = _codecs.finalize_stats(merged)
    manifest = Manifest(
        id=vid, name=name, fingerprint=fp, fingerprint_parts=parts, layout=layout, arrays=arrays,
        stats=stats, shards=tuple(r.__class__(r.index, r.start, r.stop, r.digests) for r in all_receipts),
        created_at=_dt.datetime.now(_dt.UTC).isoformat(),
        timings={"setup_s": round(t_compute - t_setup, 3), "compute_s": round(t_written - t_compute, 3),
                 "total_s": round(time.perf_counter() - t0, 3), "shards_computed": len(receipts)},
        libraries=_libraries(),
    )
    storage.sync(key)  # the data must be durable before the commit makes it visible
    try:
        storage.create_json(f"{key}/{MANIFEST}", manifest.to_json())
    except StoreConflict:
        winner = store._manifest(name, vid)
        if winner is None or winner.fingerprint != fp:
            raise
        return Version(storage, winner)  # an identical concurrent run committed first: adopt it
    # _pending.json stays: deleting it would let a late concurrent run re-claim a committed folder.
    return Version(storage, manifest)


def _result(future: Any) -> Any:
    try:
        return future.result()
    except FeatstoreError as exc:
        exc.args = (f"{exc} [Dask task {future.key}]", *exc.args[1:])
        raise
    except Exception as exc:  # noqa: BLE001 - anything else a task raised
        raise ComputeFailed(f"compute task {future.key} failed: {type(exc).__name__}: {exc}") from exc


def _run(client: Any, spec: TaskSpec, model_f: Any, data_f: Any, todo: list[int], done_rows: int,
         resources: dict | None, options: ComputeOptions) -> list[ShardReceipt]:
    from distributed import as_completed

    try:
        from distributed import span
    except ImportError:  # pragma: no cover - older distributed
        import contextlib

        span = lambda *_: contextlib.nullcontext()  # noqa: E731

    if not todo:
        return []
    n_workers = max(1, len(_workers(client)))
    # Few, long tasks: the write of a task's last shard cannot overlap the next forward.
    per_task = max(1, -(-len(todo) // (2 * n_workers)))
    groups = [todo[i:i + per_task] for i in range(0, len(todo), per_task)]
    bar = _Progress(spec.layout.n_samples, done_rows, spec.name, options.progress)
    client.subscribe_topic(spec.topic, bar)
    futures = []
    try:
        with span(f"featstore-compute-{spec.name}"):
            for g in groups:
                key = f"featstore-shards-{spec.vid}-{g[0]:06d}-{g[-1]:06d}"
                futures.append(client.submit(run_shards, spec, model_f, data_f, g, key=key,
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


def _collect_receipts(storage: Storage, key: str, layout: Layout, arrays: Mapping[str, ArraySpec],
                      fresh: list[ShardReceipt]) -> list[ShardReceipt]:
    by_index = {r.index: r for r in fresh}
    for i in range(layout.n_shards):
        if i not in by_index:
            obj = storage.read_json(f"{key}/{RECEIPTS}/{i:06d}.json")
            if obj is None:
                raise ComputeFailed(f"shard {i} of {key} has no receipt after the run; rerun compute.")
            by_index[i] = ShardReceipt.from_json(obj)
    return [by_index[i] for i in range(layout.n_shards)]
