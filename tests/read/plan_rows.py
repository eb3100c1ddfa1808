"""Shares expanded into rows, and a job's consumed order: what the plan tests compare.

A row is one int, ``stream * STREAM + sample`` (sample: the stream's global sample id, shard by
shard), so a multiset of rows is a ``Counter`` of ints.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from featstore.read.plans._assignment import UniformShards
from featstore.read.plans._elastic import EpochOrder, ResumeState, Segment, Split, progress, resume
from featstore.read.plans._mixture import Mixture
from featstore.read.plans._slices import Share, window_order

STREAM = 10**9


def layouts(order: EpochOrder) -> list[UniformShards]:
    src = order.source
    return [s.layout for s in src.streams] if isinstance(src, Mixture) else [src]


def share_rows(share: Share, order: EpochOrder, epoch: int) -> np.ndarray:
    """The rows a share yields, in order: each window's rows stream by stream, taken in the
    window's order (not through slice_rows, which the tests check against this)."""
    spp = [lay.per_shard for lay in layouts(order)]
    out = []
    for s in share.slices:
        ids = np.concatenate([np.arange(p.shard * spp[k] + p.lo, p.shard * spp[k] + p.hi) + k * STREAM
                              for k, run in enumerate(s.window.runs) for p in run] or [np.zeros(0, np.int64)])
        out.append(ids[window_order(s.window, order.seed, epoch, order.shuffle)[s.rows.start:s.rows.stop]])
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def every_row(order: EpochOrder) -> Counter:
    """Each sample of every stream once."""
    return Counter(k * STREAM + i for k, lay in enumerate(layouts(order)) for i in range(lay.n_samples))


def resumed_shares(state: ResumeState, split: Split) -> dict[tuple[int, int], Share]:
    """What each (rank, worker) of ``split`` yields resuming ``state``."""
    return {(r, w): resume(state, split, r, w).share
            for r, w in itertools.product(range(split.world), range(split.per_rank))}


def batches(rows: np.ndarray, split: Split) -> list[np.ndarray]:
    """One consumer's rows cut into batches as the reader does."""
    bs = split.batch_size
    out = [rows[i:i + bs] for i in range(0, len(rows), bs)]
    return out[:-1] if out and split.drop_last and len(out[-1]) < bs else out


def rank_batches(per_worker: Sequence[list[np.ndarray]]) -> list[np.ndarray]:
    """A rank's batches in DataLoader order: its workers in turn, skipping the exhausted."""
    out: list[np.ndarray] = []
    for j in range(max((len(b) for b in per_worker), default=0)):
        out += [b[j] for b in per_worker if j < len(b)]
    return out


def consumed_order(rows: dict[tuple[int, int], np.ndarray], split: Split) -> list[list[np.ndarray]]:
    """Each rank's batches in the order its loop consumes them (``rows``: per (rank, worker))."""
    return [rank_batches([batches(rows[(r, w)], split) for w in range(split.per_rank)]) for r in range(split.world)]


def job_order(per_rank: list[list[np.ndarray]]) -> np.ndarray:
    """The job's consumed rows, step by step (all ranks' batches of step 0, then step 1...)."""
    steps = max((len(b) for b in per_rank), default=0)
    parts = [b[j] for j in range(steps) for b in per_rank if j < len(b)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def rank_totals(order: EpochOrder, sp: Split) -> np.ndarray:
    """Each rank's batches in a whole epoch under ``sp``."""
    return progress(order, (Segment(sp, 0),))[0].counts.reshape(sp.world, sp.per_rank).sum(axis=1)


def count_pieces(monkeypatch: Any, module: Any) -> list[int]:
    """Record how many pieces each call of ``module.uniform_span_pieces`` builds (the real
    function runs): what a plan costs, counted rather than timed."""
    built: list[int] = []
    real = module.uniform_span_pieces

    def counting(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        built.append(len(out))
        return out

    monkeypatch.setattr(module, "uniform_span_pieces", counting)
    return built
