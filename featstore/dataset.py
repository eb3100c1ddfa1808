"""FeatureDataset: a torch ``IterableDataset`` over one pinned version.

Each (rank, DataLoader worker) pair reads only its own span of the epoch's plan
(:mod:`featstore.plan`), with reads issued ahead on a thread pool so S3 latency hides behind
Model B's step, and yields ready batches: ``{array: tensor, ..., "index": tensor}``. The store is
opened lazily inside each worker process, so it is safe under fork and spawn.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .errors import InvalidInput
from .plan import PARTITIONS, ConsumerPlan, Piece, consumer_plan, round_robin_consumed, window_permutation
from .store import Version


@dataclass(frozen=True)
class ReaderOptions:
    """How a :class:`FeatureDataset` batches, shuffles and splits an epoch.

    Attributes:
        batch_size: samples per yielded batch (use ``DataLoader(batch_size=None)``).
        shuffle: permute shards and rows each epoch.
        seed: with the epoch, fixes the order: same seed and epoch, same batches.
        drop_last: drop each consumer's last incomplete batch.
        partition: ``"even"`` (every sample exactly once; consumers differ by at most one
            sample), ``"pad"`` (each consumer gets ``ceil(N/C)``: a few samples repeat) or
            ``"drop"`` (each gets ``floor(N/C)``). None: ``"even"`` for one rank, ``"pad"`` for
            several, so every DDP rank yields the same number of batches.
        shuffle_window: samples permuted together (spans several chunks and shards); None:
            four shards.
        prefetch: shard pieces read ahead, concurrently.
        fields: the arrays to read (None: all).
    """

    batch_size: int = 256
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False
    partition: str | None = None
    shuffle_window: int | None = None
    prefetch: int = 4
    fields: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise InvalidInput(f"batch_size must be a positive int, got {self.batch_size!r}.")
        if self.partition is not None and self.partition not in PARTITIONS:
            raise InvalidInput(f"partition must be one of {PARTITIONS} or None, got {self.partition!r}.")
        if self.prefetch < 1:
            raise InvalidInput("prefetch must be at least 1.")


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class FeatureDataset(IterableDataset):
    """Stream one committed version into Model B's training loop.

    >>> ds = store.dataset("cnn-a/train", batch_size=256, shuffle=True, seed=0)
    >>> loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    >>> for epoch in range(3):
    ...     ds.set_epoch(epoch)
    ...     for batch in loader:
    ...         batch["features"].shape, batch["index"].shape   # [256, 512], [256]

    Rank and world size come from ``torch.distributed`` when it is initialised at construction
    (or at :meth:`set_epoch`), else from ``rank=``/``world_size=`` (default 0 and 1).
    """

    def __init__(self, version: Version, *, rank: int | None = None, world_size: int | None = None,
                 options: ReaderOptions | None = None, **option_fields: Any) -> None:
        super().__init__()
        self.version = version
        self.options = replace(options or ReaderOptions(), **option_fields)
        fields = self.options.fields or tuple(version.manifest.arrays)
        missing = sorted(set(fields) - set(version.manifest.arrays))
        if missing:
            raise InvalidInput(f"version {version.id} has no arrays {missing}; it has "
                               f"{sorted(version.manifest.arrays)}.")
        self.fields = tuple(fields)
        self._explicit = (rank, world_size)
        self.rank, self.world_size = self._rank_world()
        self.epoch = 0
        self._resume: dict[str, int] | None = None
        self._yielded = 0

    def _rank_world(self) -> tuple[int, int]:
        rank, world = self._explicit
        if rank is None or world is None:
            drank, dworld = _dist_rank_world()
            rank = drank if rank is None else rank
            world = dworld if world is None else world
        if not 0 <= rank < world:
            raise InvalidInput(f"rank {rank} is out of range for world_size {world}.")
        return rank, world

    @property
    def partition(self) -> str:
        return self.options.partition or ("even" if self.world_size == 1 else "pad")

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (it changes the order); call before iterating each epoch."""
        self.epoch = int(epoch)
        self.rank, self.world_size = self._rank_world()

    # -- the plan -----------------------------------------------------------------------
    def _window(self) -> int:
        return self.options.shuffle_window or 4 * self.version.manifest.layout.samples_per_shard

    def plan(self, worker: int = 0, num_workers: int = 0) -> ConsumerPlan:
        """This rank's plan for one DataLoader worker (``num_workers=0``: the main process)."""
        w = max(1, num_workers)
        return consumer_plan(
            self.version.manifest.layout.shard_sizes(), seed=self.options.seed, epoch=self.epoch,
            shuffle=self.options.shuffle, consumers=self.world_size * w,
            cid=self.rank * w + worker, partition=self.partition, window=self._window(),
        )  # type: ignore[arg-type]

    def batches_per_rank(self, num_workers: int = 0) -> int:
        """How many batches this rank yields this epoch with ``num_workers`` DataLoader workers."""
        return sum(self.plan(w, num_workers).n_batches(self.options.batch_size, self.options.drop_last)
                   for w in range(max(1, num_workers)))

    # -- resume -------------------------------------------------------------------------
    def state_dict(self, batches_seen: int | None = None) -> dict[str, Any]:
        """Where this rank is in the epoch, to resume with :meth:`load_state_dict`.

        ``batches_seen`` is the number of batches the training loop consumed this epoch; without
        it, the batches this process yielded are used (right for ``num_workers=0``).
        """
        return {
            "version": self.version.id, "name": self.version.name, "epoch": self.epoch,
            "batches_seen": self._yielded if batches_seen is None else int(batches_seen),
            "options": asdict(self.options), "world_size": self.world_size, "rank": self.rank,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume mid-epoch: the next iteration skips the batches already seen (without reading
        them). Batch size, seed, world size and DataLoader workers must match the saved run."""
        if state["version"] != self.version.id:
            raise InvalidInput(f"the state is for version {state['version']}, this dataset reads "
                               f"{self.version.id}; open the pinned version with store.open("
                               f"'{state['name']}@{state['version']}').")
        saved = ReaderOptions(**{k: tuple(v) if k == "fields" and v else v for k, v in state["options"].items()})
        if (saved.batch_size, saved.seed, saved.shuffle, state["world_size"]) != (
                self.options.batch_size, self.options.seed, self.options.shuffle, self.world_size):
            raise InvalidInput("batch_size, seed, shuffle and world_size must match the saved state.")
        self.epoch = int(state["epoch"])
        self._resume = {"epoch": self.epoch, "batches_seen": int(state["batches_seen"])}

    def _role_and_skip(self, worker: int, num_workers: int) -> tuple[int, int]:
        """Which consumer this worker plays, and how many of its batches to skip.

        DataLoader always starts its round-robin at worker 0; after ``k`` batches the original
        run would next have read from worker ``k % W``, so on resume worker ``w`` plays the role
        of worker ``(w + k) % W`` and the batch order continues exactly where it stopped.
        """
        if not self._resume or self._resume["epoch"] != self.epoch:
            return worker, 0
        w = max(1, num_workers)
        seen = self._resume["batches_seen"]
        counts = [self.plan(i, num_workers).n_batches(self.options.batch_size, self.options.drop_last)
                  for i in range(w)]
        role = (worker + seen) % w
        return role, round_robin_consumed(seen, counts)[role]

    # -- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 0)
        role, skipped = self._role_and_skip(worker, num_workers)
        plan = self.plan(role, num_workers)
        if info is None:
            self._yielded = skipped
        cid = self.rank * max(1, num_workers) + role
        for batch in self._batches(plan, cid, skipped * self.options.batch_size):
            if info is None:
                self._yielded += 1
            yield batch
        if info is None:
            self._resume = None

    def _read_piece(self, piece: Piece) -> dict[str, np.ndarray]:
        start = piece.shard * self.version.manifest.layout.samples_per_shard
        return {f: self.version.read_rows(f, start + piece.lo, start + piece.hi) for f in self.fields}

    def _windows(self, plan: ConsumerPlan, skip: int) -> Iterator[tuple[int, int, dict[str, np.ndarray]]]:
        """Read windows ahead on a thread pool; yield (window index, rows to drop, arrays)."""
        spp = self.version.manifest.layout.samples_per_shard
        todo: list[tuple[int, int, tuple[Piece, ...]]] = []
        pos = 0
        for wi, window in enumerate(plan.windows):
            size = sum(p.size for p in window)
            if pos + size > skip:
                todo.append((wi, max(0, skip - pos), window))
            pos += size
        with ThreadPoolExecutor(self.options.prefetch, thread_name_prefix="featstore-read") as pool:
            queue: deque[tuple[int, int, tuple[Piece, ...], list[Future]]] = deque()
            in_flight = 0
            it = iter(todo)

            def fill() -> None:
                nonlocal in_flight
                while in_flight < self.options.prefetch:
                    nxt = next(it, None)
                    if nxt is None:
                        return
                    wi, drop, window = nxt
                    queue.append((wi, drop, window, [pool.submit(self._read_piece, p) for p in window]))
                    in_flight += len(window)

            fill()
            while queue:
                wi, drop, window, futs = queue.popleft()
                parts = [f.result() for f in futs]
                in_flight -= len(window)
                fill()
                arrays = {f: parts[0][f] if len(parts) == 1 else np.concatenate([p[f] for p in parts])
                          for f in self.fields}
                arrays["index"] = np.concatenate(
                    [np.arange(p.shard * spp + p.lo, p.shard * spp + p.hi, dtype=np.int64) for p in window])
                yield wi, drop, arrays

    def _batches(self, plan: ConsumerPlan, cid: int, skip: int) -> Iterator[dict[str, torch.Tensor]]:
        bs = self.options.batch_size
        carry: dict[str, np.ndarray] | None = None
        for wi, drop, arrays in self._windows(plan, skip):
            n = len(arrays["index"])
            if self.options.shuffle:
                perm = window_permutation(self.options.seed, self.epoch, cid, wi, n)[drop:]
                arrays = {k: v[perm] for k, v in arrays.items()}
            elif drop:
                arrays = {k: v[drop:] for k, v in arrays.items()}
            n -= drop
            pos = 0
            if carry is not None:
                need = bs - len(carry["index"])
                take = min(need, n)
                carry = {k: np.concatenate([carry[k], arrays[k][:take]]) for k in arrays}
                pos = take
                if len(carry["index"]) == bs:
                    yield self._to_tensors(carry)
                    carry = None
            while n - pos >= bs:
                yield self._to_tensors({k: v[pos:pos + bs] for k, v in arrays.items()})
                pos += bs
            if pos < n:
                carry = {k: v[pos:] for k, v in arrays.items()}
        if carry is not None and not self.options.drop_last:
            yield self._to_tensors(carry)

    def _to_tensors(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        out = {f: self.version.decode(f, arrays[f]) for f in self.fields}
        out["index"] = torch.from_numpy(np.ascontiguousarray(arrays["index"]))
        return out

    def __repr__(self) -> str:
        return (f"FeatureDataset({self.version.name}@{self.version.id}, rank={self.rank}/"
                f"{self.world_size}, {self.options})")
