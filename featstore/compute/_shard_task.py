"""What runs inside a Dask task: Model A once per worker, and the shard pipeline.

A task owns whole Zarr shards (no two tasks ever write the same object). Three stages overlap,
so Model A's forward is the only work on the task's own thread: a fetch thread reads and
collates batch i+1 from the dataset, the task runs A on batch i, and a write thread checks and
encodes batch i-1 and compresses and writes finished shards, in order. On a GPU the input goes
host->device from pinned memory and the outputs come back on a side stream into pinned buffers
(:mod:`featstore.compute`), so the copies overlap the next forward too; each task runs on the
device :mod:`featstore.compute` picks for its worker. A task returns only small receipts (as
JSON dicts) and reports progress as it goes: :mod:`featstore.monitor` per shard and per batch
(what the terminal bar and the dashboard page show), and its time split into ``forward``,
``fetch``, ``encode`` and ``write`` through ``distributed.metrics.context_meter`` (Dask's Fine
Performance Metrics). Nothing here knows about the driver, the cluster, the commit or what
displays the events: it builds on :mod:`featstore.format` and :mod:`featstore.versions` only.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
import zarr

from featstore._json import JSONObject
from featstore._user_types import MapDataset, ModelSpec
from featstore.monitor import DeviceInfo, Event, batch_done, shard_started, shard_written
from featstore.compute._malloc import tuned as tuned_allocator
from featstore.codecs import keep_codec, output_codec
from featstore.compute._devices import task_device
from featstore.errors import InvalidInput
from featstore.format import zstd_saving
from featstore.format import chunk_key
from featstore.format import ShardReceipt
from featstore.codecs import PartsCodec, is_parts_codec, part_array, parts_codec
from featstore.codecs import TOKEN_START, TopK, pack, pack_topk
from featstore.compute._transfer import HostBatch, Offloader
from featstore._user_code import build_model
from featstore.versions import object_key
from featstore.versions import read_receipts
from featstore.versions import ViewDataset

from featstore.compute._batches import TOKEN_MASK
from featstore.compute._shard_rows import BatchSpan, ShardRows, collate_inputs, forward, read_inputs
from featstore.compute._shard_writing import encodes_on_device, open_arrays, topk_codec, write_shard
from featstore.compute._task_spec import ArrayProbe, Probe, TaskSpec
from featstore.compute._windows import (Batch, Window, fetch_window, in_sample_order, may_group, plan_windows,
                                        probe_inputs, window_samples, window_shards)

if TYPE_CHECKING:
    from distributed import Worker

R = TypeVar("R")


_AHEAD = 4  # batches a task may run ahead of its write thread
#: Rows of the probe batch: enough to learn output shapes and zstd's saving, cheap to run.
PROBE_ROWS = 64

# ---------------------------------------------------------------------------------------------
# One Model A per worker process.
# ---------------------------------------------------------------------------------------------
_MODELS: dict[tuple[str, str], torch.nn.Module] = {}  # insertion-ordered: oldest first
_MODELS_LOCK = threading.Lock()
_MODELS_KEPT = 2
#: Taken around Model A's forward when ``TaskSpec.serial_forward``: the embedded CPU worker runs
#: two shard tasks at once so that one's fetch and write fill the other's gaps, but two forwards
#: at once would only fight over the cores torch already uses.
_FORWARD_TURN = threading.Lock()


def _as_seen(spec: TaskSpec, dataset: MapDataset) -> MapDataset:
    """The dataset as Model A sees it: with views, each item augmented with its view seed."""
    if spec.view is None or spec.augment is None:  # (a spec with a view always has its augment)
        return dataset
    return ViewDataset(dataset, spec.augment, spec.augment_seed, spec.view)


def worker_model(model: ModelSpec, key: str, threads: int, device: torch.device) -> torch.nn.Module:
    """Model A for this process on ``device``: built (or unpickled) once, moved there once."""
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
            built = copy.deepcopy(model) if isinstance(model, torch.nn.Module) else build_model(model)
            cached = built.to(device).eval().requires_grad_(False)
            _MODELS[(key, str(device))] = cached
            while len(_MODELS) > _MODELS_KEPT:  # free the device memory of older runs' models
                _MODELS.pop(next(iter(_MODELS)))
        return cached


#: Where a task's progress events go when it runs outside Dask (the in-process runner's bar).
EventSink = Callable[[Event], None]


class _Reporter:
    """A task's progress events (see :mod:`featstore.monitor`): to ``events`` where given (a
    task run in the driver's process), else to the Dask worker's topic; silent otherwise.

    Made on the task's thread, where Dask knows the worker; ``send`` works from any thread.
    """

    def __init__(self, spec: TaskSpec, events: EventSink | None = None) -> None:
        self.events = events
        self.worker: Worker | None = None
        if events is None:
            try:
                from distributed import get_worker

                self.worker = get_worker()
            except (ImportError, ValueError):
                pass
        self.address = getattr(self.worker, "address", "local")
        self.run, self.topic = spec.model_key, spec.topic
        self.unit = spec.unit

    def send(self, msg: Event) -> None:
        if self.events is not None:
            self.events(msg)
        elif self.worker is not None:
            try:
                self.worker.log_event(self.topic, msg)
            except RuntimeError:  # the worker's loop is closing: progress is best effort
                pass


def device_info() -> DeviceInfo:
    """What this worker computes on, for the dashboard: CPU, or the GPU's name and memory
    (and utilisation where NVML is installed)."""
    if not torch.cuda.is_available():
        return {"device": "cpu", "device_name": f"CPU, {torch.get_num_threads()} torch threads"}
    i = torch.cuda.current_device()
    info: DeviceInfo = {"device": "cuda", "device_name": torch.cuda.get_device_name(i),
                        "gpu_mem": int(torch.cuda.memory_allocated(i)),
                        "gpu_mem_total": int(torch.cuda.get_device_properties(i).total_memory)}
    try:
        info["gpu_util"] = int(torch.cuda.utilization(i))
    except (ImportError, ModuleNotFoundError, RuntimeError):  # no pynvml / NVML
        pass
    return info


def _meter(label: str) -> AbstractContextManager[object]:
    """Dask's Fine Performance Metrics: time under ``label`` for the running task (a no-op
    outside Dask)."""
    try:
        from distributed.metrics import context_meter
    except ImportError:
        return contextlib.nullcontext()
    return context_meter.meter(label)


def _metered(label: str, fn: Callable[..., R], *args: object) -> R:
    with _meter(label):
        return fn(*args)


def _in_task_context(pool: ThreadPoolExecutor, label: str, fn: Callable[..., R], *args: object) -> Future[R]:
    """Run ``fn`` on ``pool`` metered as ``label``, in a copy of the task thread's context, so
    Dask books its time to this task (context variables do not cross threads by themselves)."""
    return pool.submit(contextvars.copy_context().run, _metered, label, fn, *args)


def _shard_event(report: _Reporter, receipt: ShardReceipt, nbytes: int) -> Event:
    stats = receipt.stats or {}
    return shard_written(
        report.run, report.address, report.unit(receipt.index), nbytes,
        sum(int(s.get("nan", 0)) + int(s.get("inf", 0)) for s in stats.values()),
        max((float(s.get("max_abs_error", 0.0)) for s in stats.values()), default=0.0))


def _write_checked_shard(batch_jobs: list[Future[Any]], arrays: dict[str, zarr.Array[Any]], rows: ShardRows,
                         report: _Reporter) -> ShardReceipt:
    """Write a shard only if every one of its batches was checked and stored: the write thread
    keeps running jobs after one fails, and a shard with a failed batch (NaN, a shape change)
    holds uninitialised rows that must never get a receipt."""
    for job in batch_jobs:
        job.result()  # already done (same thread, earlier in order): re-raises a failure
    receipt = write_shard(rows.spec, arrays, rows.index, rows.buffers, rows.stats)
    report.send(_shard_event(report, receipt, rows.stored_bytes()))
    return receipt


def run_shards(spec: TaskSpec, model: ModelSpec, dataset: MapDataset, shards: Sequence[int],
               events: EventSink | None = None) -> list[JSONObject]:
    """The shard task: compute and store whole shards, return their receipts as JSON dicts (in a
    Dask worker, or in the driver's process with ``events`` taking its progress events).

    Three stages overlap, so Model A's forward is the only work on the task's own thread: a
    fetch thread reads batch i+1 from the dataset, the task runs A on batch i, and a write
    thread checks and encodes batch i-1 and compresses and writes finished shards, in order.
    At most ``_AHEAD`` batches wait for the write thread, which bounds memory to a few shards.
    """
    # Dask reruns a task whose worker died (a killed process, a lost node): the shards that
    # worker finished have receipts already, and only the others are computed again.
    reused = finished_shards(spec, shards)
    todo = [i for i in shards if i not in reused]
    if not todo:
        return [{**r.to_json(), REUSED: True} for r in reused.values()]
    with task_device() as device:
        net = worker_model(model, spec.model_key, spec.threads, device)
        tune = spec.tune_allocator and device.type == "cpu"
        _WARM.hold(tune)
        try:
            with tuned_allocator(tune):
                computed = _run_shards(spec, net, _as_seen(spec, dataset), todo, device, _Reporter(spec, events))
        finally:
            _WARM.linger()
    return computed + [{**r.to_json(), REUSED: True} for r in reused.values()]


#: Marks a receipt a task found on storage instead of computing it (never stored).
REUSED = "reused"


def finished_shards(spec: TaskSpec, shards: Sequence[int]) -> dict[int, ShardReceipt]:
    """The receipts already on storage for ``shards`` that match this run's layout and arrays,
    and whose shard objects are all stored.

    A receipt alone is not enough: a task of an earlier run that outlived its driver can write
    a receipt after ``gc`` deleted that shard's objects.
    """
    found = read_receipts(spec.storage, spec.key, shards)
    return {i: r for i, r in found.items()
            if (r.start, r.stop) == spec.layout.shard_range(i) and set(r.digests) == set(spec.arrays)
            and all(spec.storage.exists(object_key(spec.key, chunk_key(a, i, len(s.shape)), spec.layout.spread))
                    for a, s in spec.arrays.items())}


class _WarmHeap:
    """Keeps :func:`featstore.compute.tuned` on between the shard tasks of this process.

    A compute is one task per shard: without this, every task's end would return the warm heap
    to the OS (``malloc_trim``) and the next task would map and zero its activations afresh.
    The hold ends ``LINGER_S`` after the last task, or at once by :func:`release_models`.
    """

    LINGER_S = 5.0

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stack: contextlib.ExitStack | None = None
        self.gen = 0  # which linger timer may still release

    def hold(self, enabled: bool) -> None:
        with self.lock:
            self.gen += 1
            if enabled and self.stack is None:
                self.stack = contextlib.ExitStack()
                self.stack.enter_context(tuned_allocator(True))

    def linger(self) -> None:
        with self.lock:
            if self.stack is None:
                return
            gen = self.gen
        timer = threading.Timer(self.LINGER_S, self.release, args=(gen,))
        timer.daemon = True
        timer.start()

    def release(self, gen: int | None = None) -> None:
        with self.lock:
            if self.stack is None or (gen is not None and gen != self.gen):
                return  # a task started since: it keeps the heap warm
            stack, self.stack = self.stack, None
        stack.close()


_WARM = _WarmHeap()


def _run_shards(spec: TaskSpec, net: torch.nn.Module, dataset: MapDataset, shards: Sequence[int],
                device: torch.device, report: _Reporter) -> list[JSONObject]:
    arrays = open_arrays(spec)
    on_device = encodes_on_device(device)
    windows = plan_windows(spec, shards, may_group(spec, on_device))
    cuda = device.type == "cuda"
    offload = Offloader(device)
    receipts: list[JSONObject] = []
    if not windows:
        return receipts
    dev_info = device_info()
    with ThreadPoolExecutor(1, thread_name_prefix="featstore-write") as pool, \
            ThreadPoolExecutor(1, thread_name_prefix="featstore-fetch") as fetcher:
        waiting: deque[Future[Any]] = deque()  # batch, window and shard jobs on the write thread, in order
        writes: deque[Future[Any]] = deque()
        shard_rows: dict[int, ShardRows] = {}  # the shards being computed, started at their first batch
        jobs: dict[int, list[Future[Any]]] = {}  # per shard, the write thread's jobs that store its rows
        nxt = _in_task_context(fetcher, "fetch", fetch_window, spec, dataset, windows[0], cuda)
        try:
            for k, window in enumerate(windows):
                batches = nxt.result()
                if k + 1 < len(windows):
                    nxt = _in_task_context(fetcher, "fetch", fetch_window, spec, dataset, windows[k + 1], cuda)
                for s in window.spans:
                    if s.first:
                        shard_rows[s.shard], jobs[s.shard] = ShardRows.start(spec, s.shard), []
                        report.send(shard_started(report.run, report.address, report.unit(s.shard), dev_info))
                by_size: list[tuple[np.ndarray, HostBatch]] = []
                for batch in batches:
                    span = batch.span
                    with _FORWARD_TURN if spec.serial_forward else contextlib.nullcontext(), _meter("forward"):
                        if span is None:
                            values = _forward_by_size(spec, net, window, batch, device)
                        else:
                            values, stored_at = shard_rows[span.shard].forward(net, batch.x, batch.kept, span.b0,
                                                                               span.b1, device, on_device)
                    host = offload.to_host(values)  # on CUDA: starts the copies, returns at once
                    if span is None:
                        assert batch.positions is not None, "a batch has a span or positions"
                        by_size.append((batch.positions, host))
                        owners, counts = np.unique(window_shards(window)[batch.positions], return_counts=True)
                        for shard, count in zip(owners.tolist(), counts.tolist(), strict=True):
                            report.send(batch_done(report.run, report.address, report.unit(shard), count))
                        continue
                    report.send(batch_done(report.run, report.address, report.unit(span.shard), span.b1 - span.b0))
                    waiting.append(job := _in_task_context(pool, "encode", shard_rows[span.shard].store, host,
                                                           stored_at))
                    jobs[span.shard].append(job)
                if by_size:
                    waiting.append(job := _in_task_context(pool, "encode", _store_window, window, by_size,
                                                           {s.shard: shard_rows[s.shard] for s in window.spans}))
                    for s in window.spans:
                        jobs[s.shard].append(job)
                for s in window.spans:
                    if s.last:
                        fut = _in_task_context(pool, "write", _write_checked_shard, jobs.pop(s.shard), arrays,
                                               shard_rows.pop(s.shard), report)
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


def _forward_by_size(spec: TaskSpec, net: torch.nn.Module, window: Window, batch: Batch,
                     device: torch.device) -> dict[str, torch.Tensor]:
    """A on a batch cut by size: its outputs and kept fields, in the batch's order."""
    assert batch.positions is not None, "a batch cut by size has its positions"
    samples = sorted(window_samples(window)[batch.positions].tolist())
    named = ", ".join(map(str, samples[:8])) + (", ..." if len(samples) > 8 else "")
    outs = forward(spec, net, batch.x, samples[0], len(samples), device, f"{named} (batched by size)")
    dense = {n: t for n, t in outs.items() if isinstance(t, torch.Tensor)}
    # an engine's top-k (TopK) comes only with per-token outputs, which are never cut by size
    assert len(dense) == len(outs), "batches cut by size hold no engine top-k (may_group)"
    return {**dense, **batch.kept}


def _store_window(window: Window, batches: list[tuple[np.ndarray, HostBatch]],
                  shard_rows: dict[int, ShardRows]) -> None:
    """Store a window whose batches were cut by size (on the write thread): its values back in
    sample order, each span into its shard's rows."""
    spans = window.spans
    values = in_sample_order(window, batches, f"[{spans[0].b0}, {spans[-1].b1})")
    at = 0
    for s in spans:
        part = {name: v[at:at + s.b1 - s.b0] for name, v in values.items()}
        shard_rows[s.shard].store(HostBatch(part), BatchSpan(s.b0, s.b1))
        at += s.b1 - s.b0


def probe(spec: TaskSpec, model: ModelSpec, dataset: MapDataset, n: int, on: torch.device | None = None) -> Probe:
    """Run A on the first samples (one small batch) on a worker, or on device ``on`` (the
    teacher in the loop's, outside Dask): per array, the per-sample shape and dtype every batch
    must keep and the share of bytes zstd saves on this batch as stored (what
    ``compression="auto"`` decides on); with per-token outputs, the mean real tokens per sample.
    """
    rows = min(n, spec.batch_size, PROBE_ROWS)
    with task_device() if on is None else contextlib.nullcontext(on) as device:
        net = worker_model(model, spec.model_key, spec.threads, device)
        inputs, vary = probe_inputs(spec, read_inputs(_as_seen(spec, dataset), 0, rows, spec.digests),
                                    may_group(spec, encodes_on_device(device)))
        x, kept = collate_inputs(spec, inputs, 0, pinned=False)
        named = None if len(inputs.items) == rows else f"among [0, {rows}) (the probe's smallest)"
        outs = forward(spec, net, x, 0, rows, device, named)
        rows = len(inputs.items)
    out: dict[str, ArrayProbe] = {}
    tokens = 0.0
    if spec.tokens is not None:
        mask = kept.pop(TOKEN_MASK)
        outs = {n: (t if n not in spec.ragged else pack_topk(t, mask, n) if isinstance(t, TopK)
                    else pack(t.cpu(), mask, n)[0]) for n, t in outs.items()}
        tokens = float(mask.sum()) / max(rows, 1)
        kept[TOKEN_START] = torch.zeros(rows, dtype=torch.int64)
    for name, t in {**outs, **kept}.items():
        if isinstance(t, TopK):  # an engine's top-k: what the codec refuses is said here, whole
            out.update(_probe_topk(name, spec.outputs[name], t))
            continue
        if name in outs and is_parts_codec(spec.outputs[name]):
            out.update(_probe_parts(name, parts_codec(spec.outputs[name]), t))
        try:
            codec = output_codec(spec.outputs[name]) if name in outs else keep_codec(t.dtype)
            saving = zstd_saving(codec.cast(t))
        except InvalidInput:  # an unstorable dtype: the driver reports it with the array's name
            saving = 1.0
        out[name] = ArrayProbe(tuple(t.shape[1:]), str(t.dtype).removeprefix("torch."), saving)
    return Probe(out, tokens, vary)


def _probe_topk(name: str, codec: str, t: TopK) -> dict[str, ArrayProbe]:
    """The probe of an output an engine ranked (:class:`TopK`): its parts as :func:`_probe_parts`
    gives them, and the dense output it stands for; :class:`InvalidInput` where its codec cannot
    store it (not a top-k codec, K past the engine's k, another temperature)."""
    parts, _ = topk_codec(codec, name, t).encode(t, 0, name)
    return {**{part_array(name, p): ArrayProbe(tuple(a.shape[1:]), str(a.dtype), zstd_saving(a))
               for p, a in parts.items()},
            name: ArrayProbe(tuple(t.shape[1:]), "float32", 1.0)}


def _probe_parts(name: str, codec: PartsCodec, t: torch.Tensor) -> dict[str, ArrayProbe]:
    """zstd's saving on each part of an output stored in parts (none where the codec cannot
    encode the probe batch: the driver raises that error with the whole story)."""
    try:
        parts, _ = codec.encode(t, 0, name)
    except InvalidInput:
        return {}
    return {part_array(name, p): ArrayProbe(tuple(a.shape[1:]), str(a.dtype), zstd_saving(a)) for p, a in parts.items()}


def release_models(run_key: str) -> None:
    """Drop this process's cached Model A of one compute run (an in-process worker cached it
    in the caller's process; its memory is the caller's again), and its warm heap."""
    _WARM.release()
    with _MODELS_LOCK:
        for k in [k for k in _MODELS if k[0] == run_key]:
            del _MODELS[k]
