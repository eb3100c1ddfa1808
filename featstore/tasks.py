"""What runs inside a Dask task: Model A once per worker, and the shard pipeline.

A task owns whole Zarr shards (no two tasks ever write the same object). Three stages overlap,
so Model A's forward is the only work on the task's own thread: a fetch thread reads batch i+1
from the dataset, the task runs A on batch i, and a write thread checks and encodes batch i-1
and compresses and writes finished shards, in order. A task returns only small receipts (as
JSON dicts) and reports progress as it goes. Nothing here knows about the driver, the cluster
or the commit: it builds on :mod:`featstore.format` and :mod:`featstore.versions` only.
"""

from __future__ import annotations

import copy
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zarr

from .allocator import tuned as tuned_allocator
from .codecs import codec_by_name, keep_codec, output_codec
from .errors import ComputeFailed, FeatstoreError, InvalidInput, MissingInputKey, NonFiniteOutput, OutputMismatch
from .format import open_for_write, shard_digest, zstd_saving
from .manifest import ArraySpec, Layout, ShardReceipt
from .stats import NONFINITE_KEPT, max_abs_error, merge_stats, value_stats
from .storage import Storage
from .versions import version_key, view_key, write_receipt
from .views import SEED_FIELD, ViewDataset, view_seeds

_AHEAD = 4  # batches a task may run ahead of its write thread
#: Rows of the probe batch: enough to learn output shapes and zstd's saving, cheap to run.
PROBE_ROWS = 64


# ---------------------------------------------------------------------------------------------
# Selecting fields of dataset items and normalising Model A's outputs (pure).
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


# ---------------------------------------------------------------------------------------------
# One Model A per worker process.
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
    view: int | None = None  # the augmented view these shards belong to (None: no views)
    augment: Any = None  # fn(item, generator) -> item, with views
    augment_seed: int = 0

    @property
    def key(self) -> str:
        """The group the shards are written to: the version's, or its view's."""
        return view_key(version_key(self.name, self.vid), self.view)


def _as_seen(spec: TaskSpec, dataset: Any) -> Any:
    """The dataset as Model A sees it: with views, each item augmented with its view seed."""
    if spec.view is None:
        return dataset
    return ViewDataset(dataset, spec.augment, spec.augment_seed, spec.view)


def _seed_field(spec: TaskSpec, b0: int, b1: int) -> dict[str, torch.Tensor]:
    """With views, each row's replay seed, stored beside the outputs (plain Zarr readers and
    other tools can replay a view without featstore)."""
    if spec.view is None:
        return {}
    return {SEED_FIELD: torch.from_numpy(view_seeds(spec.augment_seed, spec.view, np.arange(b0, b1)))}


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
        codec = codec_by_name(want.codec)
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
        s = value_stats(t, all_finite)
        if bad_rows:
            s["nonfinite_samples"] = bad_rows[:NONFINITE_KEPT]
        if codec.lossy:
            s["max_abs_error"] = max_abs_error(codec, arr, t)
        encoded[name], stats[name] = arr, s
    return encoded, stats


def _open_arrays(spec: TaskSpec) -> dict[str, zarr.Array]:
    return open_for_write(spec.storage.zarr_store(spec.key, read_only=False), spec.arrays)


def _write_shard(spec: TaskSpec, arrays: dict[str, zarr.Array], index: int,
                 buffers: dict[str, np.ndarray], stats: dict[str, dict]) -> ShardReceipt:
    start, stop = spec.layout.shard_range(index)
    digests = {}
    for name, buf in buffers.items():
        arrays[name][start:stop] = buf
        digests[name] = shard_digest(buf)
    receipt = ShardReceipt(index, start, stop, digests, stats, view=spec.view)
    # The receipt is written only after every array of the shard is stored: it is the marker.
    write_receipt(spec.storage, spec.key, receipt)
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
        stats[n] = merge_stats(stats.get(n), st[n])


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
    with tuned_allocator(spec.tune_allocator and worker_device().type == "cpu"):
        return _run_shards(spec, net, _as_seen(spec, dataset), shards)


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
                job = pool.submit(_store_batch, spec, {**outs, **kept, **_seed_field(spec, b0, b1)},
                                  b0, b1, start, buffers, stats)
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
    outs, kept = _forward(spec, net, _fetch(_as_seen(spec, dataset), 0, min(n, spec.batch_size, PROBE_ROWS)), 0)
    out = {}
    for name, t in {**outs, **kept}.items():
        try:
            codec = output_codec(spec.outputs[name]) if name in outs else keep_codec(t.dtype)
            saving = zstd_saving(codec.cast(t))
        except InvalidInput:  # an unstorable dtype: the driver reports it with the array's name
            saving = 1.0
        out[name] = (tuple(t.shape[1:]), str(t.dtype).removeprefix("torch."), saving)
    return out


def release_models(run_key: str) -> None:
    """Drop this process's cached Model A of one compute run (an in-process worker cached it
    in the caller's process; its memory is the caller's again)."""
    with _MODELS_LOCK:
        for k in [k for k in _MODELS if k[0] == run_key]:
            del _MODELS[k]
