"""The compute driver: validate the call, fingerprint it, run the shard tasks on Dask, commit.

The driver plans and watches; the work happens in :mod:`featstore.compute` (inside Dask tasks),
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
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import zarr

from featstore._version import __version__
from featstore.monitor._events import TOPIC, is_event, run_ended, run_started
from featstore.codecs._chunking import MIN_SHARE, dividing_chunk, nearest_multiples
from featstore.compute._cluster import Cluster, connect, task_resources, workers
from featstore.codecs._dense import keep_codec, output_codec
from featstore.errors import ComputeFailed, FeatstoreError, InvalidInput, OutputMismatch
from featstore.format._arrays import choose_compression
from featstore.format._manifests import ArraySpec, Layout, Manifest, ShardReceipt
from featstore.monitor._run_state import RunState
from featstore.codecs._parts import PartsCodec, is_parts_codec, part_array, parts_codec
from featstore.codecs._ragged import TOKEN_LENGTH, TOKEN_START, Tokens, token_layout
from featstore.compute._shard_task import PROBE_TOKENS, REUSED, probe, release_models, run_shards
from featstore.compute._task_spec import TaskSpec
from featstore.versions._catalog import Catalog, Ref
from featstore.versions._commits import Claim
from featstore.versions._committed import StoredVersion
from featstore.versions._keys import version_key, view_key
from featstore.versions._receipts import ReceiptRuns
from featstore.versions._views import SEED_FIELD

from featstore.compute._options import (MIN_SHARDS, ComputeOptions, default_shard_bytes)

from featstore.compute._decision import ComputePlan, decide


log = logging.getLogger("featstore")

def choose_layout(n: int, row_bytes: Sequence[int], samples_per_shard: int | None,
                  chunk_rows: int | None, target_shard_bytes: int) -> Layout:
    """Rows per shard and per chunk: about ``target_shard_bytes`` per shard, at least
    ``MIN_SHARDS`` shards when N allows (so readers have something to spread), 1 MiB chunks.

    An explicit ``samples_per_shard`` is kept exactly: the inner chunk is chosen to divide it
    (:mod:`featstore.codecs`), and a value that no sensible chunk divides, or that an explicit
    ``chunk_rows`` does not divide, is refused naming values that work.

    >>> choose_layout(10_000, [64], 500, None, 2**24).samples_per_shard
    500
    """
    widest = max(max(row_bytes), 1)
    total = max(sum(row_bytes), 1)
    if (samples_per_shard is not None and samples_per_shard < 1) or (chunk_rows is not None and chunk_rows < 1):
        raise InvalidInput("samples_per_shard and chunk_rows must be positive integers.")
    target = 1 << max(4, min(14, (2**20 // widest).bit_length() - 1))
    if samples_per_shard is None:
        by_bytes = max(1, target_shard_bytes // total)
        spread = -(-n // MIN_SHARDS)
        chunk_rows = min(chunk_rows or target, max(1, min(by_bytes, spread)))
        samples_per_shard = -(-max(1, min(by_bytes, spread)) // chunk_rows) * chunk_rows
        return Layout(n_samples=n, samples_per_shard=samples_per_shard, chunk_rows=chunk_rows)
    if chunk_rows is None:
        chunk_rows = dividing_chunk(samples_per_shard, target, widest)
        if chunk_rows is None:
            lo, hi = nearest_multiples(samples_per_shard, target)
            raise InvalidInput(
                f"samples_per_shard={samples_per_shard} cannot be cut into equal inner chunks of about "
                f"{target} rows (~1 MiB of the widest array): it has no divisor between {target // MIN_SHARE} "
                f"and {target}, and a single chunk would be {samples_per_shard * widest / 2**20:.0f} MiB. Use "
                f"{lo} or {hi} (multiples of {target}), or give ComputeOptions(chunk_rows=...) a number of "
                f"rows that divides {samples_per_shard}.")
    elif samples_per_shard % min(chunk_rows, samples_per_shard):
        lo, hi = nearest_multiples(samples_per_shard, chunk_rows)
        raise InvalidInput(f"samples_per_shard={samples_per_shard} is not a multiple of chunk_rows={chunk_rows} "
                           f"(a shard holds whole chunks): use {lo} or {hi}, or a chunk_rows that divides "
                           f"{samples_per_shard}.")
    return Layout(n_samples=n, samples_per_shard=samples_per_shard, chunk_rows=min(chunk_rows, samples_per_shard))


class _Progress:
    """Terminal progress (samples/s and ETA): this run's events, folded as the dashboard folds
    them (a shard Dask reruns is not counted twice)."""

    def __init__(self, start: dict[str, Any], enabled: bool) -> None:
        self.state = RunState(start["run"])
        self.state.apply(start, time.time())
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.state.samples, initial=self.state.samples_done, unit="sample",
                            unit_scale=True, desc=f"compute {start['name']}", file=sys.stderr, dynamic_ncols=True)
        self.lock = threading.Lock()

    def __call__(self, event: Any) -> None:
        _, msg = event
        if not is_event(msg) or msg["run"] != self.state.run:
            return
        with self.lock:
            self.state.apply(msg, time.time())
            if self.bar is not None:
                self.bar.update(self.state.samples_done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _spec_arrays(probed: Mapping[str, tuple[tuple[int, ...], str, float]], outputs: Mapping[str, str],
                 keep: Mapping[str, Any], compression: str, local: bool) -> dict[str, ArraySpec]:
    arrays = {}
    for name, codec_name in outputs.items():
        shape, dtype, saving = probed[name]
        if not getattr(torch, dtype).is_floating_point:
            raise OutputMismatch(f"output {name!r} is {dtype}; Model A outputs must be floating point.")
        if is_parts_codec(codec_name):
            arrays.update(_part_specs(name, parts_codec(codec_name), probed, compression))
            continue
        codec = output_codec(codec_name)
        arrays[name] = ArraySpec(codec.name, codec.stored, shape, "output",
                                 choose_compression(compression, saving, local))
    for name in keep:
        shape, dtype, saving = probed[name]
        codec = keep_codec(getattr(torch, dtype))
        arrays[name] = ArraySpec(codec.name, codec.stored, shape, "keep",
                                 choose_compression(compression, saving, local))
    return arrays


def _part_specs(name: str, codec: PartsCodec, probed: Mapping[str, tuple[tuple[int, ...], str, float]],
                compression: str) -> dict[str, ArraySpec]:
    """The arrays of an output stored in parts; raises here, before anything is written, when
    the codec cannot store the output the probe saw (K larger than the class count, ...)."""
    shape = probed[name][0]
    out = {}
    for ps in codec.parts(shape, name):
        key = part_array(name, ps.part)
        saving = probed[key][2] if key in probed else 1.0
        out[key] = ArraySpec(codec.name, ps.dtype, ps.shape, "output", choose_compression(compression, saving),
                             output=name, part=ps.part, params=codec.params(shape))
    return out


def _libraries() -> dict[str, str]:
    from importlib.metadata import version

    # by metadata, not by import: a filling reader commits in a training process, where importing
    # dask only for its version string cost 0.6 s
    return {"featstore": __version__, "torch": torch.__version__, "zarr": zarr.__version__,
            "numpy": np.__version__, "dask": version("dask"), "fsspec": version("fsspec"),
            "python": sys.version.split()[0]}


# ---------------------------------------------------------------------------------------------
# The driver.
# ---------------------------------------------------------------------------------------------
def compute(catalog: Catalog, name: str, *, model: Any, dataset: Any, input_key: Any = "input",
            keep: Sequence[Any] | Mapping[str, Any] = (), outputs: Mapping[str, str] | None = None,
            batch_size: int = 256, samples_per_shard: int | None = None, client: Any = None,
            options: ComputeOptions | None = None, extends: Ref | None = None,
            views: int | None = None, augment: Any = None, augment_seed: int | None = 0,
            tokens: Tokens | None = None, views_of: Ref | None = None) -> StoredVersion:
    """Compute Model A's outputs over ``dataset`` with Dask and commit them as one version.

    Args:
        catalog: the catalog of the store the version goes to (``store.catalog``).
        name: the feature set (``"resnet50/imagenet-train"``).
        model: an ``nn.Module`` or a zero-argument factory that builds it on each worker.
        dataset: a map-style dataset; items may be tensors, tuples or dicts.
        input_key: which field of an item goes into A (key, index, callable, or None: the item).
        keep: per-sample fields stored beside A's outputs (``["target"]`` or ``{"label": 1}``).
        outputs: ``{output name: codec}``; A returns one tensor (one name) or a dict of them.
            Codecs: ``float32`` (exact), ``float16`` (a cast), ``bfloat16``; soft labels
            stored sparsely ``topk:K[@T]``, ``topp:P:MIN_K[:CAP][@T]``, ``sample:S[@T]``, and
            ``int8`` (per-sample absmax) for dense outputs: see :mod:`featstore.codecs`
            and :mod:`featstore.kd`.
        batch_size: samples per forward of A.
        samples_per_shard: rows per Zarr shard (one object), kept exactly as given (the inner
            chunk is picked to divide it; a value no sensible chunk divides is refused, naming
            values that work); None picks ~16 MiB shards (64 MiB on an object store).
        client: None (an embedded LocalCluster is started and closed), a ``distributed.Client``
            or a scheduler address.
        options: :class:`ComputeOptions`.
        extends: ``"name@id"`` (or a :class:`Version`) of a version over the first
            ``len(parent)`` samples of ``dataset``, computed with the same model and outputs:
            only the new samples are computed (plus the parent's last, partial shard), and the
            new version references the parent's shards without copying them. The dataset's
            digest over the shared range must match the parent's (:class:`DatasetMismatch`).
            Not supported together with views (yet): either side having views raises
            :class:`InvalidInput`.
        views: K augmented views per sample (None: the items as they are, one view). View ``v``
            of sample ``i`` is ``augment(dataset[i], torch.Generator().manual_seed(s))`` with
            ``s = version.view_seed(i, v)``; A runs on it and every stored array (outputs,
            ``keep`` fields, which may name extra fields ``augment`` returns) is stored per view.
        augment: ``fn(item, generator) -> item``; all its randomness must come from
            ``generator`` (checked: two replays must agree, else :class:`NondeterministicAugment`).
        augment_seed: the version's seed, from which every (sample, view) seed derives (None: 0,
            or with ``views_of`` that version's).
        tokens: :class:`~featstore.ragged.Tokens` for per-token outputs of token sequences (a
            language model's logits, ``[B, L, ...]``): only each sample's real tokens (the
            mask's) are stored, as flat token rows plus the per-sample ``token_start`` and
            ``token_length`` arrays, with the output's codec applied per token; batches carry
            them flat with ``"<name>.offsets"`` (see :mod:`featstore.ragged`).
        views_of: ``"name@id"`` (or a :class:`Version`) of a version whose views this Model A
            runs on: the same K, seeds and augment (``views``/``augment_seed`` are taken from it;
            ``augment`` must be the same function) on the same dataset, in the same shards, so
            the two versions can be read together on the same rows (``store.dataset({"a": ...,
            "b": ...})``). A version without views: the same samples in the same order. A
            different dataset, augment, count or seed is :class:`VersionsMisaligned`, naming what
            differs. The link is part of the fingerprint (``fingerprint_parts["views_of"]``).

    Returns the committed :class:`Version`; if a version with the same fingerprint is already
    committed it is returned at once, without running A. If the run dies, calling ``compute``
    again recomputes only the shards without a receipt.

    >>> v = compute(store, "cnn-a/train", model=model_a, dataset=train_set, keep=["target"],
    ...             outputs={"features": "float16", "logits": "float32"})
    """
    options = options or ComputeOptions()
    t0 = time.perf_counter()
    plan = decide(catalog, name, model=model, dataset=dataset, input_key=input_key, keep=keep, outputs=outputs,
                  batch_size=batch_size, samples_per_shard=samples_per_shard, options=options, extends=extends,
                  views=views, augment=augment, augment_seed=augment_seed, tokens=tokens, views_of=views_of)
    existing = catalog.committed(name, plan.vid)
    if existing is not None:
        log.info("version %s@%s already committed; nothing to compute", name, plan.vid)
        return existing
    run = _run(catalog, plan, model, dataset, client, options)
    return commit_run(catalog, plan, run.claim, run.receipts,
                      {**run.timings, "total_s": round(time.perf_counter() - t0, 3),
                       "shards_computed": len(run.receipts) - run.reused, "shards_reused": run.reused})


def commit_run(catalog: Catalog, plan: ComputePlan, claim: Claim, fresh: Sequence[ShardReceipt],
               timings: Mapping[str, Any]) -> StoredVersion:
    """Commit the version a run claimed: every shard's receipt (``fresh``: this run's; the
    others are read from the store), its records, statistics and manifest. What ``compute``
    and a filling :mod:`featstore.online` reader both end with, so both commit the same version."""
    name = plan.req.name
    receipts = catalog.commits.collect_receipts(name, plan.vid, claim.layout, fresh, plan.inherited, plan.req.views)
    manifest = Manifest(
        id=plan.vid, name=name, fingerprint=plan.fingerprint, fingerprint_parts=dict(plan.parts), layout=claim.layout,
        arrays=claim.arrays, stats=plan.stats(receipts, claim.arrays),
        records=catalog.commits.write_records(name, plan.vid, receipts, list(claim.arrays)),
        bases=plan.bases, dataset_sample=plan.dataset_sample,
        created_at=_dt.datetime.now(_dt.UTC).isoformat(),
        timings=dict(timings),
        libraries=_libraries(),
        views=plan.views,
    )
    return catalog.commits.commit(manifest)



@dataclass(frozen=True)
class _RunResult:
    claim: Claim
    receipts: list[ShardReceipt]
    timings: dict[str, float]
    reused: int = 0  # receipts a rerun task found finished (its first worker died)


def _run(catalog: Catalog, plan: ComputePlan, model: Any, dataset: Any, client: Any,
         options: ComputeOptions) -> _RunResult:
    """Start (or join) a cluster, probe A, claim the version folder, run the missing shards."""
    req, vid = plan.req, plan.vid
    t_setup = time.perf_counter()
    # One model per compute call and worker: same weights may come with different code.
    run_key = f"{vid}-{uuid.uuid4().hex[:8]}"
    cluster = connect(client, options.n_workers, options.processes, options.connect_timeout)
    try:
        print(f"featstore: Dask dashboard at {cluster.dashboard_link}", file=sys.stderr)
        page = cluster.page_link()
        print(f"featstore: progress page at {page}" if page else "featstore: for featstore's dashboard page, "
              "start the scheduler with `dask scheduler --preload featstore.dashboard`", file=sys.stderr)
        dclient = cluster.client
        inputs = [model, dataset, *(dclient.scatter(x, broadcast=True, hash=False) for x in (model, dataset))]
        model_f, data_f = inputs[2:]
        resources = task_resources(dclient)
        base = TaskSpec(catalog.storage, req.name, vid, run_key, req.input_key, req.keep, req.outputs, {},
                        Layout(req.n, 1, 1), req.batch_size, options.allow_nonfinite, options.autocast,
                        cluster.torch_threads(), TOPIC,
                        tune_allocator=options.tune_allocator, serial_forward=cluster.serial_forward,
                        collate=options.collate, view=None if req.views is None else 0,
                        augment=req.augment, augment_seed=req.augment_seed, tokens=req.tokens, ragged=req.ragged)
        probed = _result(dclient.submit(probe, base, model_f, data_f, req.n, key=f"featstore-probe-{run_key}",
                                        resources=resources, pure=False))
        claim = _claim(catalog, plan, probed, options)
        dtypes = {k: d for k, (_, d, _) in probed.items()} | ({} if req.views is None else {SEED_FIELD: "int64"})
        spec = TaskSpec(**{**base.__dict__, "arrays": claim.arrays, "layout": claim.layout, "dtypes": dtypes})
        todo, done = _units(claim, req.views)
        log.info("computing %s@%s: %d shards to do, %d already finished", req.name, vid, len(todo), len(done))
        n_shards = claim.layout.n_shards
        start = run_started(run_key, req.name, vid, req.n, claim.layout.samples_per_shard,
                            sorted(i if v is None else v * n_shards + i for v, i in done), catalog.url, req.views)
        t_compute = time.perf_counter()
        receipts, reused = _run_tasks(cluster, spec, inputs, todo, start, resources, options)
    finally:
        cluster.close()
        release_models(run_key)
    timings = {"setup_s": round(t_compute - t_setup, 3), "compute_s": round(time.perf_counter() - t_compute, 3)}
    return _RunResult(claim, receipts, timings, reused)


def _claim(catalog: Catalog, plan: ComputePlan, probed: Mapping[str, tuple[tuple[int, ...], str, float]],
           options: ComputeOptions) -> Claim:
    """The arrays the probe found, their layout, and the claim (which may adopt a concurrent
    run's layout and compression, or, growing a parent, must be the parent's)."""
    layout, arrays = planned_arrays(catalog, plan, probed, options)
    return catalog.commits.claim(plan.req.name, plan.vid, layout, arrays, plan.bases, plan.req.views)


def planned_arrays(catalog: Catalog, plan: ComputePlan, probed: Mapping[str, tuple[tuple[int, ...], str, float]],
                   options: ComputeOptions) -> tuple[Layout, dict[str, ArraySpec]]:
    """The layout and arrays a run claims for what the probe found (before any claim adopts
    another run's): ``compute`` and the online reader (:mod:`featstore.online`) plan the
    same version."""
    req = plan.req
    probed = dict(probed)
    per_sample = probed.pop(PROBE_TOKENS, ((), "", 0.0))[2]  # mean real tokens per sample
    arrays = _spec_arrays(probed, req.outputs, req.keep, options.compression, catalog.storage.is_local)
    if req.tokens is not None:
        for f, dtype in ((TOKEN_START, torch.int64), (TOKEN_LENGTH, torch.int32)):
            arrays[f] = ArraySpec(keep_codec(dtype).name, keep_codec(dtype).stored, (), "tokens",
                                  choose_compression(options.compression, probed[f][2], catalog.storage.is_local))
    if req.views is not None:  # replay seeds: random 63-bit integers, which zstd cannot shrink
        arrays[SEED_FIELD] = ArraySpec(keep_codec(torch.int64).name, keep_codec(torch.int64).stored, (), "seed",
                                       choose_compression(options.compression, 0.0, catalog.storage.is_local))
    arrays = plan.arrays(arrays)
    ragged = {n for n, a in arrays.items() if (a.output or n) in req.ragged}
    row_bytes = {n: int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize for n, a in arrays.items()}
    # a per-token array's bytes per sample: its token row times the probe's mean tokens
    per_sample_bytes = [max(1, round(b * per_sample)) if n in ragged else b for n, b in row_bytes.items()]
    target = options.target_shard_bytes or default_shard_bytes(catalog.storage.is_local)
    layout = replace(choose_layout(req.n, per_sample_bytes, req.samples_per_shard, plan.chunk_rows(options), target),
                     spread=plan.spread(options))
    if req.tokens is not None:
        arrays = {n: replace(a, tokens=token_layout(layout.samples_per_shard, req.tokens.max_tokens, row_bytes[n]))
                  if n in ragged else a for n, a in arrays.items()}
    return layout, arrays


Unit = tuple[int | None, int]  # (view or None, shard): the unit of tasks, receipts and resume
Group = tuple[int | None, list[int]]  # one task's shards, all of one view


def _units(claim: Claim, views: int | None) -> tuple[list[Unit], list[Unit]]:
    """The (view, shard) units still to compute and those already finished."""
    n = claim.layout.n_shards
    if views is None:
        return ([(None, i) for i in range(n) if i not in claim.done], [(None, i) for i in sorted(claim.done)])
    every = [(v, i) for v in range(views) for i in range(n)]
    return [u for u in every if u not in claim.done_views], sorted(claim.done_views)


class _ViewRuns:
    """:class:`ReceiptRuns` per view's receipts folder (one folder without views)."""

    def __init__(self, spec: TaskSpec) -> None:
        self.spec, self.runs = spec, {}

    def add(self, receipts: Any) -> None:
        """One task's receipts (a task's shards are all of one view), folded as they come."""
        by_view: dict[int | None, list[ShardReceipt]] = {}
        for r in receipts:
            by_view.setdefault(r.view, []).append(r)
        for view, rs in by_view.items():
            if view not in self.runs:
                home = view_key(version_key(self.spec.name, self.spec.vid), view)
                self.runs[view] = ReceiptRuns(self.spec.storage, home)
            self.runs[view].add(rs)


def _result(future: Any) -> Any:
    try:
        return future.result()
    except FeatstoreError as exc:
        exc.args = (f"{exc} [Dask task {future.key}]", *exc.args[1:])
        raise
    except Exception as exc:  # noqa: BLE001 - anything else a task raised
        raise ComputeFailed(f"compute task {future.key} failed: {type(exc).__name__}: {exc}") from exc


#: Rounds of resubmission after Dask lost the scattered Model A or dataset with a dead worker.
LOST_DATA_ROUNDS = 3


def _task_groups(todo: Sequence[Unit], n_workers: int, shards_per_task: int | None) -> list[Group]:
    """Shards per task: ``shards_per_task`` each, or (None) a few long tasks, two per worker;
    a task's shards all belong to one view.

    >>> _task_groups([(0, 0), (0, 1), (0, 2), (1, 0)], 1, 2)
    [(0, [0, 1]), (0, [2]), (1, [0])]
    """
    per_task = shards_per_task or max(1, -(-len(todo) // (2 * max(1, n_workers))))
    groups: list[Group] = []
    for view, shard in todo:
        if not groups or groups[-1][0] != view or len(groups[-1][1]) >= per_task:
            groups.append((view, []))
        groups[-1][1].append(shard)
    return groups


def _task_key(run_key: str, group: Group, round_: int) -> str:
    """``featstore-shards-<vid>-<run>[-v<view>]-<first>[-<last>][-retry<n>]``.

    One task prefix ("featstore-shards"), so Dask shows one progress bar per compute. The run
    token matters: Dask returns a key's result from memory if a future of an earlier run still
    holds it (an exception's traceback is enough), and a rerun after ``gc`` deleted that
    shard's objects would then commit a shard that is no longer stored.
    """
    view, shards = group
    return (f"featstore-shards-{run_key}{'' if view is None else f'-v{view}'}-{shards[0]:06d}"
            + (f"-{shards[-1]:06d}" if len(shards) > 1 else "") + (f"-retry{round_}" if round_ else ""))


def _run_tasks(cluster: Cluster, spec: TaskSpec, inputs: list, todo: list[Unit], start: dict[str, Any],
               resources: dict | None, options: ComputeOptions) -> tuple[list[ShardReceipt], int]:
    """Submit the shard tasks (one per shard by default) and gather their receipts; also
    return how many of them a rerun task found already finished (its worker died). The run's
    start and end go out as events (for the terminal bar and the dashboard page).

    ``inputs`` is ``[model, dataset, model future, dataset future]``. A worker that dies takes
    its tasks with it (Dask reruns them elsewhere) and, when it held the only copy (Dask's
    memory manager keeps one copy of scattered data), the scattered Model A or dataset: the
    tasks that needed it are cancelled. Those are scattered again and their shard groups
    resubmitted, up to :data:`LOST_DATA_ROUNDS` times; shards already finished are never
    recomputed (each task skips shards that have a receipt).
    """
    client = cluster.client
    groups = _task_groups(todo, len(workers(client)), options.shards_per_task)
    bar = _Progress(start, options.progress)
    client.subscribe_topic(TOPIC, bar)
    client.log_event(TOPIC, start)
    receipts: list[ShardReceipt] = []
    reused, status, error = 0, "failed", ""
    try:
        for round_ in range(LOST_DATA_ROUNDS + 1):
            if not groups:
                break
            if round_:
                log.warning("%s: a Dask worker died with Model A or the dataset; resubmitting %d "
                            "shard tasks (finished shards are kept)", spec.name, len(groups))
                inputs[2:] = [client.scatter(x, broadcast=True, hash=False) for x in inputs[:2]]
            got, groups = _gather_round(client, spec, inputs[2], inputs[3], groups, resources, round_)
            receipts += [ShardReceipt.from_json(r) for r in got]
            reused += sum(bool(r.get(REUSED)) for r in got)
        status = "written"
        return receipts, reused
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        client.log_event(TOPIC, run_ended(start["run"], status, error))
        time.sleep(0.05)  # let the last progress events arrive
        client.unsubscribe_topic(TOPIC)
        bar.close()


def _gather_round(client: Any, spec: TaskSpec, model_f: Any, data_f: Any, groups: list[Group],
                  resources: dict | None, round_: int) -> tuple[list[dict], list[Group]]:
    """Run ``groups`` once; return the receipts (JSON) and the groups whose inputs were lost."""
    from distributed import as_completed, span

    futures = {}
    try:
        with span("featstore", f"{spec.name}@{spec.vid}"):
            for g in groups:
                futures[client.submit(run_shards, replace(spec, view=g[0]), model_f, data_f, g[1],
                                      key=_task_key(spec.model_key, g, round_),
                                      resources=resources, pure=False, retries=0)] = g
            got, lost = [], []
            runs = _ViewRuns(spec)
            for fut in as_completed(futures):
                if fut.cancelled() and round_ < LOST_DATA_ROUNDS:  # its scattered inputs died with a worker
                    lost.append(futures[fut])
                    continue
                done = _result(fut)
                got += done
                runs.add(ShardReceipt.from_json(r) for r in done if not r.get(REUSED))
        return got, lost
    except BaseException:
        for f in futures:
            f.cancel()
        raise
