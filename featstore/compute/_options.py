"""The options of a compute that are not about the data: :class:`ComputeOptions` (progress,
cluster, shard sizes, compression, retries...), and the default shard sizes by store kind.
Imports neither torch nor Dask: the command line builds its help from these defaults."""

from __future__ import annotations

from dataclasses import dataclass

from featstore.errors import InvalidInput
from featstore._user_types import Collate


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
            With ``client="in-process"`` (no Dask: the shard tasks run in the calling process
            one after the other, the same version byte for byte) ``n_workers``, ``processes``,
            ``shards_per_task`` and ``connect_timeout`` do not apply.
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
            (measured 2.5x on the demo CNN); see :mod:`featstore.compute`.
        shards_per_task: shards each Dask task computes. 1 (the default): Dask's progress bars
            and task stream move once per shard and a lost worker costs one shard; the fetch,
            forward and write stages still overlap inside the task (compute time measured
            unchanged, see docs/monitoring.md). None: a few long tasks (two per worker). Where
            batches are cut by size (``group_by_length``), the default 1 joins shards smaller than
            a window (32 batches) into one task, up to one window.
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
        group_by_length: where A's inputs differ in size and a ``collate`` pads them (token
            sequences), cut the batches from samples ordered by size within windows of a task's
            samples (up to 32 batches), as sentence-transformers' ``encode`` and Hugging Face's
            ``group_by_length`` do, so a batch pads to a length near its samples' own; the
            outputs are stored in sample order all the same. Per-token outputs (``tokens=``) keep
            sample order. False: batches of consecutive samples (a Model A whose output for a
            sample depends on the other samples of its batch). Not part of the fingerprint: the
            values are the same up to floating-point rounding.
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
    collate: Collate | None = None
    spread_prefixes: int | None = None
    connect_timeout: float = 5.0
    group_by_length: bool = True

    def __post_init__(self) -> None:
        from featstore.format import check_compression, check_spread  # zarr: where options are checked, not for --help

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
