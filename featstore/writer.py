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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
import zarr

from ._version import __version__
from .events import TOPIC, is_event, run_ended, run_started
from .chunking import MIN_SHARE, dividing_chunk, nearest_multiples
from .cluster import Cluster, connect, task_resources, workers
from .codecs import keep_codec, output_codec
from .errors import ComputeFailed, EmptyDataset, FeatstoreError, InvalidInput, OutputMismatch
from .fingerprint import dataset_digest, describe_key, fingerprint, model_digest, sampled_digest
from .format import RESERVED_FIELDS, check_compression, choose_compression, chunk_label
from .incremental import Growth, plan_growth
from .manifest import ArraySpec, Layout, Manifest, ShardReceipt, ViewsSpec, check_spread
from .monitor import RunState
from .names import check_field, check_name
from .partcodecs import PartsCodec, check_output_codec, is_parts_codec, part_array, parts_codec
from .ragged import TOKEN_FIELDS, TOKEN_LENGTH, TOKEN_START, Tokens, token_layout
from .stats import summarize
from .tasks import PROBE_TOKENS, REUSED, TaskSpec, collate_batch, probe, release_models, run_shards
from .usercode import dataset_length, read_item
from .versions import Catalog, Claim, ReceiptRuns, Version, version_key, view_key
from .views import SEED_FIELD, SEED_POLICY, VIEW_FIELD, check_replayable, replay, view_seed

log = logging.getLogger("featstore")

MIN_SHARDS = 8
#: Default uncompressed bytes per shard, by store kind (see ComputeOptions.target_shard_bytes).
LOCAL_SHARD_BYTES = 16 * 2**20
OBJECT_STORE_SHARD_BYTES = 64 * 2**20


def default_shard_bytes(is_local: bool) -> int:
    """16 MiB shards on a local disk, 64 MiB on an object store."""
    return LOCAL_SHARD_BYTES if is_local else OBJECT_STORE_SHARD_BYTES


@dataclass(frozen=True)
class ComputeOptions:
    """Less common knobs of :func:`compute`, grouped so the call stays short.

    Attributes:
        dataset_id: names the dataset's exact contents; replaces the sampled content digest.
        model_id: names Model A exactly (weights and code); replaces both digests in the
            fingerprint, and spares building a factory locally to digest it.
        allow_nonfinite: store NaN/Inf instead of raising :class:`NonFiniteOutput`.
        autocast: ``"float16"``/``"bfloat16"`` to run A under ``torch.autocast`` (part of the
            fingerprint, since it changes the outputs).
        target_shard_bytes: uncompressed bytes per shard when ``samples_per_shard`` is None;
            None picks by store kind: 16 MiB on a local disk, 64 MiB on an object store (S3,
            GCS, ...), where each request costs ~10-30 ms and a prefix serves ~5,500 GET/s, so
            bigger objects mean fewer requests (readers fetch the inner chunks they need by
            range, so their memory does not grow with the shard). See docs/scale.md.
        chunk_rows: rows per Zarr chunk inside a shard (None: about 1 MiB of the widest array,
            a divisor of an explicit ``samples_per_shard``; given, it must divide it).
        progress: show a terminal progress bar.
        n_workers: workers of the embedded LocalCluster (None: one per GPU, else one).
        processes: whether the embedded LocalCluster's workers are processes. None: processes
            when the machine has GPUs (one per GPU), else one worker thread in this process,
            which measured 1.4-1.9x faster compute on a 2-core CPU machine (no worker start-up,
            no pickling of A and the dataset, and a faster forward than in a worker process).
        compression: ``"zstd"``, ``"none"`` or ``"auto"``: zstd for each array where it saves
            at least 10% of the bytes on the probe batch (fp16 features, labels), none where it
            does not (float32 logits are nearly incompressible, and zstd would slow every read
            ~10x for a few percent of storage). On a local store "auto" asks zstd to save 50%:
            there the reader gathers uncompressed arrays in place from the page cache, and CPU,
            not bytes, is what it spends. The choice is recorded per array in the manifest.
        tune_allocator: on CPU workers with glibc, keep freed memory for reuse while a shard
            task runs instead of mapping and zeroing fresh pages for every activation tensor
            (measured 2.5x on the demo CNN); see :mod:`featstore.allocator`.
        shards_per_task: shards each Dask task computes. 1 (the default): Dask's progress bars
            and task stream move once per shard and a lost worker costs one shard; the fetch,
            forward and write stages still overlap inside the task (compute time measured
            unchanged, see docs/monitoring.md). None: a few long tasks (two per worker).
        collate: builds Model A's input batch from the list of a batch's inputs (what
            ``input_key`` selects), e.g. padding token sequences of different lengths and adding
            an attention mask; None: ``torch.utils.data.default_collate``. Part of the
            fingerprint (by source). A's outputs must still have one per-sample shape, so pad to
            a fixed length, or store them per token with ``compute(..., tokens=Tokens(...))``.
        spread_prefixes: spread the version's shard objects over this many top-level prefixes
            of the store (1 to 256), ``<store>/_spread/<hh>/<version folder>/<array>/c/<shard>/0``,
            so that S3, which serves about 5,500 GET/s per partitioned prefix, can serve N times
            that for one version (docs/scale.md, "Requests per S3 prefix"). Metadata, receipts
            and the manifest stay in the version's folder. None or 1: every object in the
            version's folder, as before. Not part of the fingerprint (the values are the same):
            the first run of a version fixes it and a resume adopts it, and ``extends=`` keeps
            the parent's. Plain Zarr then opens the version through ``version.zarr_store()``.
        connect_timeout: seconds to wait for the Dask scheduler named by ``client="tcp://..."``
            before :class:`~featstore.ClusterUnavailable` (Dask's own default is 30 s; a scheduler
            that is up answers in well under a second, so a few seconds is plenty on a network
            that works). Raise it for a scheduler that is still starting.
    """

    dataset_id: str | None = None
    model_id: str | None = None
    allow_nonfinite: bool = False
    autocast: str | None = None
    target_shard_bytes: int | None = None
    chunk_rows: int | None = None
    progress: bool = True
    n_workers: int | None = None
    processes: bool | None = None
    compression: str = "auto"
    tune_allocator: bool = True
    shards_per_task: int | None = 1
    collate: Callable[[list[Any]], Any] | None = None
    spread_prefixes: int | None = None
    connect_timeout: float = 5.0

    def __post_init__(self) -> None:
        check_compression(self.compression)
        if isinstance(self.connect_timeout, bool) or not isinstance(self.connect_timeout, (int, float)) \
                or not self.connect_timeout > 0:
            raise InvalidInput(f"connect_timeout must be a positive number of seconds, got {self.connect_timeout!r}.")
        try:
            check_spread(self.spread_prefixes)
        except ValueError as exc:
            raise InvalidInput(f"{exc}; pick the number of prefixes your read rate needs (docs/scale.md, "
                               "'Requests per S3 prefix'), or leave it out for one.") from None
        if self.shards_per_task is not None and (not isinstance(self.shards_per_task, int)
                                                 or self.shards_per_task < 1):
            raise InvalidInput(f"shards_per_task must be a positive int or None, got {self.shards_per_task!r}.")


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
    tokens: Tokens | None = None
    ragged: tuple[str, ...] = ()  # the per-token outputs


def normalize_keep(keep: Sequence[Any] | Mapping[str, Any]) -> dict[str, Any]:
    """``["target"]`` -> ``{"target": "target"}``; ``{"label": 1}`` stays; ints get ``field<i>``."""
    if isinstance(keep, str):
        keep = [keep]
    pairs = keep.items() if isinstance(keep, Mapping) else ((k if isinstance(k, str) else f"field{k}", k) for k in keep)
    return {check_field(name): key for name, key in pairs}


def _validate(name: str, dataset: Any, input_key: Any, keep: Sequence[Any] | Mapping[str, Any],
              outputs: Mapping[str, str] | None, batch_size: int, samples_per_shard: int | None,
              options: "ComputeOptions", views: int | None = None, augment: Any = None,
              augment_seed: int = 0, tokens: Tokens | None = None) -> _Request:
    """Check every argument before anything runs; bad input raises with what to change."""
    check_name(name)
    if outputs is None:
        outputs = {"features": "float32"}
    if not isinstance(outputs, Mapping) or not outputs:
        raise InvalidInput("outputs must be a non-empty dict like {'features': 'float16'}.")
    outputs = {check_field(k): check_output_codec(v) for k, v in outputs.items()}
    keep_map = normalize_keep(keep)
    reserved = set(RESERVED_FIELDS) | ({VIEW_FIELD, SEED_FIELD} if views is not None else set()) | set(TOKEN_FIELDS)
    if tokens is not None and not isinstance(tokens, Tokens):
        raise InvalidInput("tokens= takes featstore.Tokens(mask=fn, max_tokens=N), e.g. "
                           "Tokens(mask=lambda x: x['attention_mask'], max_tokens=512).")
    ragged = tokens.ragged_outputs(list(outputs)) if tokens is not None else ()
    clash = (set(outputs) & set(keep_map)) | ((set(outputs) | set(keep_map)) & reserved)
    if clash:
        raise InvalidInput(f"array names {sorted(clash)} are used twice or reserved; rename them.")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidInput(f"batch_size must be a positive int, got {batch_size!r}.")
    if options.autocast not in (None, "float16", "bfloat16"):
        raise InvalidInput("ComputeOptions.autocast must be None, 'float16' or 'bfloat16'.")
    n = dataset_length(dataset)
    if n == 0:
        raise EmptyDataset("the dataset is empty; there is nothing to compute. Check its path or filter.")
    first = _first_seen(dataset, n, views, augment, augment_seed)
    # What a task would do with the first item, here, before anything runs: a missing field, or
    # items that cannot be batched (PIL images, strings), fail now, naming the field and the fix.
    collate_batch([first], input_key, keep_map, options.collate, 0)
    return _Request(name, n, input_key, keep_map, outputs, batch_size, samples_per_shard,
                    views, augment, augment_seed, tokens, ragged)


def _first_seen(dataset: Any, n: int, views: int | None, augment: Any, augment_seed: int) -> Any:
    """The first item as Model A will see it, after checking the views arguments; with views,
    ``augment`` is replayed twice on two items and must give the same bytes both times."""
    if views is None:
        if augment is not None:
            raise InvalidInput("augment= needs views=K (K augmented views per sample are computed and "
                               "stored); for one augmented view pass views=1.")
        return read_item(dataset, 0)
    if isinstance(views, bool) or not isinstance(views, int) or views < 1:
        raise InvalidInput(f"views must be a positive int (augmented views per sample), got {views!r}.")
    if not callable(augment):
        raise InvalidInput("views=K needs augment=fn, where fn(item, generator) -> item draws all its "
                           "randomness from the torch.Generator it is given.")
    if isinstance(augment_seed, bool) or not isinstance(augment_seed, int):
        raise InvalidInput(f"augment_seed must be an int, got {augment_seed!r}.")
    check_replayable(dataset, augment, augment_seed, sorted({0, n // 2}))
    return replay(augment, read_item(dataset, 0), view_seed(augment_seed, 0, 0))


def views_spec(req: _Request) -> ViewsSpec | None:
    """The views part of the fingerprint and the manifest (None without views)."""
    if req.views is None:
        return None
    return ViewsSpec(req.views, req.augment_seed, SEED_POLICY, describe_key(req.augment))


def _fingerprint_parts(req: _Request, model: Any, dataset: Any, options: "ComputeOptions") -> dict[str, Any]:
    """Everything that decides the stored bytes (see the README section on fingerprints)."""
    return {
        **model_digest(model, options.model_id),  # "model" (weights) and "model_code"
        "dataset": dataset_digest(dataset, options.dataset_id),
        "input_key": describe_key(req.input_key),
        "keep": {k: describe_key(v) for k, v in req.keep.items()},
        "outputs": req.outputs,
        # Compression never changes the values, but it changes the stored bytes (and digests).
        "codecs": {"chunk": chunk_label(options.compression), "schema": 1},
        "autocast": options.autocast,
        # only when set, so every fingerprint computed before collate existed stays the same
        **({"collate": describe_key(options.collate)} if options.collate is not None else {}),
        # Only with views, so versions without them keep their ids.
        **({} if req.views is None else {"views": asdict(views_spec(req))}),
        **({} if req.tokens is None else {"tokens": {"mask": describe_key(req.tokens.mask), "outputs": list(req.ragged),
                                                     "max_tokens": req.tokens.max_tokens}}),
    }


def choose_layout(n: int, row_bytes: Sequence[int], samples_per_shard: int | None,
                  chunk_rows: int | None, target_shard_bytes: int) -> Layout:
    """Rows per shard and per chunk: about ``target_shard_bytes`` per shard, at least
    ``MIN_SHARDS`` shards when N allows (so readers have something to spread), 1 MiB chunks.

    An explicit ``samples_per_shard`` is kept exactly: the inner chunk is chosen to divide it
    (:mod:`featstore.chunking`), and a value that no sensible chunk divides, or that an explicit
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
            options: ComputeOptions | None = None, extends: str | Version | None = None,
            views: int | None = None, augment: Any = None, augment_seed: int = 0,
            tokens: Tokens | None = None) -> Version:
    """Compute Model A's outputs over ``dataset`` with Dask and commit them as one version.

    Args:
        catalog: the store the version goes to (a :class:`~featstore.FeatureStore`).
        name: the feature set (``"resnet50/imagenet-train"``).
        model: an ``nn.Module`` or a zero-argument factory that builds it on each worker.
        dataset: a map-style dataset; items may be tensors, tuples or dicts.
        input_key: which field of an item goes into A (key, index, callable, or None: the item).
        keep: per-sample fields stored beside A's outputs (``["target"]`` or ``{"label": 1}``).
        outputs: ``{output name: codec}``; A returns one tensor (one name) or a dict of them.
            Codecs: ``float32`` (exact), ``float16`` (a cast), ``bfloat16``; soft labels
            stored sparsely ``topk:K[@T]``, ``topp:P:MIN_K[:CAP][@T]``, ``sample:S[@T]``, and
            ``int8`` (per-sample absmax) for dense outputs: see :mod:`featstore.partcodecs`
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
        augment_seed: the version's seed, from which every (sample, view) seed derives.
        tokens: :class:`~featstore.ragged.Tokens` for per-token outputs of token sequences (a
            language model's logits, ``[B, L, ...]``): only each sample's real tokens (the
            mask's) are stored, as flat token rows plus the per-sample ``token_start`` and
            ``token_length`` arrays, with the output's codec applied per token; batches carry
            them flat with ``"<name>.offsets"`` (see :mod:`featstore.ragged`).

    Returns the committed :class:`Version`; if a version with the same fingerprint is already
    committed it is returned at once, without running A. If the run dies, calling ``compute``
    again recomputes only the shards without a receipt.

    >>> v = compute(store, "cnn-a/train", model=model_a, dataset=train_set, keep=["target"],
    ...             outputs={"features": "float16", "logits": "float32"})
    """
    options = options or ComputeOptions()
    t0 = time.perf_counter()
    parent = catalog.open(extends) if extends is not None else None
    _check_views_extends(parent, views)
    if parent is not None:
        spp = parent.manifest.layout.samples_per_shard
        if samples_per_shard not in (None, spp):
            raise InvalidInput(f"extends={parent.ref!r} keeps the parent's {spp} samples per shard; "
                               f"leave samples_per_shard out (got {samples_per_shard}).")
        samples_per_shard = spp
        _check_parent_spread(parent, options)
    req = _validate(name, dataset, input_key, keep, outputs, batch_size, samples_per_shard, options,
                    views, augment, augment_seed, tokens)
    parts = _fingerprint_parts(req, model, dataset, options)
    growth = None if parent is None else plan_growth(parent, dataset, parts, req.n)
    if growth is not None:
        parts = {**parts, "extends": parent.fingerprint}
    fp = fingerprint(parts)
    vid = fp[:16]
    existing = catalog.committed(name, vid)
    if existing is not None:
        log.info("version %s@%s already committed; nothing to compute", name, vid)
        return existing
    run = _run(catalog, req, vid, model, dataset, client, options, growth)
    return commit_run(catalog, req, parts, fp, run.claim, run.receipts, dataset,
                      {**run.timings, "total_s": round(time.perf_counter() - t0, 3),
                       "shards_computed": len(run.receipts) - run.reused, "shards_reused": run.reused}, growth)


def commit_run(catalog: Catalog, req: _Request, parts: Mapping[str, Any], fp: str, claim: Claim,
               fresh: Sequence[ShardReceipt], dataset: Any, timings: Mapping[str, Any],
               growth: Growth | None = None) -> Version:
    """Commit the version a run claimed: every shard's receipt (``fresh``: this run's; the
    others are read from the store), its records, statistics and manifest. What ``compute``
    and a filling :mod:`featstore.online` reader both end with, so both commit the same version."""
    name, vid = req.name, fp[:16]
    inherited = growth.inherited_receipts() if growth is not None else ()
    receipts = catalog.collect_receipts(name, vid, claim.layout, fresh, inherited, req.views)
    own = receipts[growth.first_own:] if growth is not None else receipts
    manifest = Manifest(
        id=vid, name=name, fingerprint=fp, fingerprint_parts=dict(parts), layout=claim.layout,
        arrays=claim.arrays, stats=_stats(growth, inherited, own, claim.arrays),
        records=catalog.write_records(name, vid, receipts, list(claim.arrays)),
        bases=growth.bases if growth is not None else (),
        dataset_sample=_dataset_sample(parts, dataset),
        created_at=_dt.datetime.now(_dt.UTC).isoformat(),
        timings=dict(timings),
        libraries=_libraries(),
        views=views_spec(req),
    )
    return catalog.commit(manifest)


def _check_parent_spread(parent: Version, options: ComputeOptions) -> None:
    """A child reads its parent's shards where the parent's spread put them, with its own
    spread: so it keeps the parent's (leave ``spread_prefixes`` out, or give the same)."""
    spread = parent.manifest.layout.spread
    if options.spread_prefixes not in (None, spread):
        raise InvalidInput(f"extends={parent.ref!r} keeps the parent's spread over {spread} prefixes; leave "
                           f"ComputeOptions.spread_prefixes out (got {options.spread_prefixes}).")


def _check_views_extends(parent: Version | None, views: int | None) -> None:
    """Views and ``extends`` do not combine yet: refuse before anything runs."""
    if parent is None:
        return
    if views is not None:
        raise InvalidInput(f"views= together with extends= is not supported yet; compute the version with "
                           f"views without extends (a full compute), or extend {parent.ref} without views.")
    if parent.views is not None:
        raise InvalidInput(f"{parent.ref} has augmented views; extends= of a version with views is not "
                           "supported yet. Compute the bigger dataset without extends.")


def _dataset_sample(parts: Mapping[str, Any], dataset: Any) -> str | None:
    """The sampled content digest (already in the fingerprint unless a dataset_id replaced it)."""
    digest = parts["dataset"].get("digest")
    if digest is not None:
        return digest
    try:
        return sampled_digest(dataset)
    except InvalidInput:  # items featstore cannot digest: such a version cannot be extended
        return None


def _stats(growth: Growth | None, inherited: Sequence[ShardReceipt], own: Sequence[ShardReceipt],
           arrays: Mapping[str, ArraySpec]) -> dict[str, dict]:
    """The manifest's statistics: the whole version's, inherited shards included."""
    if growth is None:
        return summarize((r.stats for r in own), arrays)
    return growth.summarize(inherited, own, arrays)


@dataclass(frozen=True)
class _RunResult:
    claim: Claim
    receipts: list[ShardReceipt]
    timings: dict[str, float]
    reused: int = 0  # receipts a rerun task found finished (its first worker died)


def _run(catalog: Catalog, req: _Request, vid: str, model: Any, dataset: Any, client: Any,
         options: ComputeOptions, growth: Growth | None = None) -> _RunResult:
    """Start (or join) a cluster, probe A, claim the version folder, run the missing shards."""
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
        claim = _claim(catalog, req, vid, probed, options, growth)
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


def _claim(catalog: Catalog, req: _Request, vid: str, probed: Mapping[str, tuple[tuple[int, ...], str, float]],
           options: ComputeOptions, growth: Growth | None = None) -> Claim:
    """The arrays the probe found, their layout, and the claim (which may adopt a concurrent
    run's layout and compression, or, growing a parent, must be the parent's)."""
    layout, arrays = planned_arrays(catalog, req, probed, options, growth)
    return catalog.claim(req.name, vid, layout, arrays, growth.bases if growth is not None else (), req.views)


def planned_arrays(catalog: Catalog, req: _Request, probed: Mapping[str, tuple[tuple[int, ...], str, float]],
                   options: ComputeOptions, growth: Growth | None = None) -> tuple[Layout, dict[str, ArraySpec]]:
    """The layout and arrays a run claims for what the probe found (before any claim adopts
    another run's): ``compute`` and the :mod:`featstore.online` reader plan the same version."""
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
    if growth is not None:
        arrays = growth.adopt_arrays(arrays)
    ragged = {n for n, a in arrays.items() if (a.output or n) in req.ragged}
    row_bytes = {n: int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize for n, a in arrays.items()}
    # a per-token array's bytes per sample: its token row times the probe's mean tokens
    per_sample_bytes = [max(1, round(b * per_sample)) if n in ragged else b for n, b in row_bytes.items()]
    target = options.target_shard_bytes or default_shard_bytes(catalog.storage.is_local)
    chunk_rows = growth.layout.chunk_rows if growth is not None else options.chunk_rows
    spread = growth.layout.spread if growth is not None else check_spread(options.spread_prefixes)
    layout = replace(choose_layout(req.n, per_sample_bytes, req.samples_per_shard, chunk_rows, target), spread=spread)
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
