"""The compute driver: decide the plan, run the probe and the shard tasks, commit.

The driver plans and watches: what a compute does is decided once by
:func:`~featstore.compute.decide` (:mod:`featstore.compute`), the tasks run through a
:class:`~featstore.compute.ShardRunner` (on Dask, or in this process), the version's lifecycle
(claim, receipts, commit) is :mod:`featstore.versions`'s, and what goes into Zarr
:mod:`featstore.format`'s. Reading is not this module's business: the writer and the reader
never import each other.
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
from featstore.compute._content import (ComputeReport, cheap_here, check_content, donor_for, in_process, reusing,
                                        trusted)
from featstore.compute._decision import ComputePlan, decide
from featstore.compute._layout import choose_layout
from featstore._keywords import keywords_of
from featstore.compute._request import ComputeCall
from featstore.compute._runners import Group, ShardRunner, Unit, runner_for
from featstore.compute._shard_task import REUSED, release_models
from featstore.compute._task_spec import Probe, TaskSpec
from featstore.compute._windows import may_group, window_rows
from featstore.format import ShardReceipt
from featstore.monitor import Event, is_event, run_started
from featstore.monitor import RunState
from featstore.versions import Catalog
from featstore.versions import Claim
from featstore.versions import StoredVersion
from featstore.versions import DIGEST_FIELD, content_digest

__all__ = ["choose_layout", "commit_run", "compute", "run_compute"]  # choose_layout: imported from here by tests

log = logging.getLogger("featstore")


class _Progress:
    """Terminal progress (samples/s and ETA): this run's events, folded as the dashboard folds
    them (a shard Dask reruns is not counted twice)."""

    def __init__(self, start: Event, enabled: bool) -> None:
        self.state = RunState(start["run"])
        self.state.apply(start, time.time())
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.state.samples, initial=self.state.samples_done, unit="sample",
                            unit_scale=True, desc=f"compute {start['name']}", file=sys.stderr, dynamic_ncols=True)
        self.lock = threading.Lock()

    def __call__(self, event: tuple[float, object]) -> None:
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
@keywords_of(ComputeCall)
def compute(catalog: Catalog, name: str, *args: Any, **keywords: Any) -> StoredVersion:
    """Compute Model A's outputs over ``dataset`` once and commit them as one version (in
    ``catalog``: ``store.catalog``). The keywords are
    :class:`~featstore.compute.ComputeRequest`'s, and ``client`` (:class:`~featstore.compute.ComputeCall`).

    Returns the committed :class:`Version`; if a version with the same fingerprint is already
    committed it is returned at once, without running A. If the run dies, calling ``compute``
    again recomputes only the shards without a receipt.

    >>> v = compute(store, "cnn-a/train", model=model_a, dataset=train_set, keep=["target"],
    ...             outputs={"features": "float16", "logits": "float32"})
    """
    return run_compute(catalog, name, ComputeCall(*args, **keywords)).version


def run_compute(catalog: Catalog, name: str, call: ComputeCall) -> Computed:
    """:func:`compute` of one :class:`~featstore.compute.ComputeCall`: decide, check the items
    against what is stored (:mod:`featstore.compute._content`), then (unless that version is
    committed already) run and commit it, referencing every shard the check found unchanged."""
    t0 = time.perf_counter()
    plan = decide(catalog, name, call)
    existing = catalog.committed(name, plan.vid)
    if existing is not None and (how := trusted(existing, plan)) is not None:
        log.info("version %s@%s already committed (%s); nothing to compute", name, plan.vid, how)
        return _reported(existing, ComputeReport(computed=False, check=how))
    runner: ShardRunner | None = None
    try:
        check = None
        stored = existing if existing is not None else donor_for(catalog, plan)
        if stored is not None:
            runner = None if cheap_here(call.dataset, plan.n) else runner_for(call)
            run_check = runner.check if runner is not None else in_process(
                call.dataset, plan.n, plan.options.progress)
            check = check_content(stored, plan.n, run_check, 1)
            log.info("%s: %d of %d items differ from %s", name, check.changed, plan.n, stored.ref)
            if existing is not None and check.changed == 0:
                return _reported(existing, ComputeReport(False, "digests", plan.n, 0, check_s=check.seconds))
            plan = reusing(plan, check, changed_content=existing is not None)
            again = catalog.committed(name, plan.vid)
            if again is not None:  # these very items were computed before
                return _reported(again, ComputeReport(False, "digests", plan.n, check.changed, check.first_changed,
                                                      check_s=check.seconds))
        if runner is None:
            runner = runner_for(call)
        run, runner = _run(catalog, plan, runner), None  # _run closes the runner
    finally:
        if runner is not None:
            runner.close()
    referenced = len(plan.inherited)
    timings = {**run.timings, "total_s": round(time.perf_counter() - t0, 3),
               "shards_computed": len(run.receipts) - run.reused, "shards_reused": run.reused,
               **({"shards_referenced": referenced} if referenced else {})}
    if check is not None:
        timings.update(check_s=check.seconds, items_changed=check.changed)
    version = commit_run(catalog, plan, run.claim, run.receipts, timings)
    report = ComputeReport(True, "none" if check is None else "digests", 0 if check is None else plan.n,
                           None if check is None else check.changed, () if check is None else check.first_changed,
                           len(run.receipts) - run.reused, run.reused + referenced,
                           None if plan.growth is None else plan.growth.parent.ref,
                           0.0 if check is None else check.seconds)
    return _reported(version, report)


@dataclass(frozen=True)
class Computed:
    """What :func:`run_compute` returns: the version, and what the call did to get it."""

    version: StoredVersion
    report: ComputeReport


def _reported(version: StoredVersion, report: ComputeReport) -> Computed:
    return Computed(version, report)


def commit_run(catalog: Catalog, plan: ComputePlan, claim: Claim, fresh: Sequence[ShardReceipt],
               timings: Mapping[str, float]) -> StoredVersion:
    """Commit the version a run claimed: every shard's receipt (``fresh``: this run's; the
    others are read from the store), its records, statistics and manifest. What ``compute``
    and a filling :mod:`featstore.online` reader both end with, so both commit the same version."""
    commits = catalog.commits
    receipts = commits.collect_receipts(plan.name, plan.vid, claim.layout, fresh, plan.inherited, plan.view_count)
    content = None
    if DIGEST_FIELD in claim.arrays:  # every view holds the same digests: the first view's (or the only) shards
        content = content_digest(r.digests[DIGEST_FIELD] for r in receipts if r.view in (None, 0))
    manifest = replace(plan.manifest(claim.layout, claim.arrays), stats=plan.stats(receipts, claim.arrays),
                       records=commits.write_records(plan.name, plan.vid, receipts, list(claim.arrays)),
                       created_at=_dt.datetime.now(_dt.UTC).isoformat(), timings=dict(timings),
                       libraries=_libraries(), content=content)
    return commits.commit(manifest)


@dataclass(frozen=True)
class _RunResult:
    claim: Claim
    receipts: list[ShardReceipt]
    timings: dict[str, float]
    reused: int = 0  # receipts a rerun task found finished (its first worker died)


def _run(catalog: Catalog, plan: ComputePlan, runner: ShardRunner) -> _RunResult:
    """Probe A, claim the version folder, run the missing shards (on ``runner``, which is
    closed after)."""
    t_setup = time.perf_counter()
    # One model per compute call and worker: same weights may come with different code.
    run_key = f"{plan.vid}-{uuid.uuid4().hex[:8]}"
    try:
        base = TaskSpec.of(plan, catalog.storage, run_key, threads=runner.threads,
                           serial_forward=runner.serial_forward)
        probed = runner.probe(base, plan.n)
        layout, arrays = plan.layout(probed, catalog.storage.is_local)
        # the claim may adopt a concurrent run's layout and compression, or, growing a parent,
        # must be the parent's
        claim = catalog.commits.claim(plan.name, plan.vid, layout, arrays, plan.bases, plan.view_count)
        spec = base.planned(claim.layout, claim.arrays, probed)
        todo, done = _units(claim, plan.view_count)
        log.info("computing %s@%s: %d shards to do, %d already finished", plan.name, plan.vid, len(todo), len(done))
        n_shards = claim.layout.n_shards
        start = run_started(run_key, plan.name, plan.vid, plan.n, claim.layout.samples_per_shard,
                            sorted(i if v is None else v * n_shards + i for v, i in done), catalog.url,
                            plan.view_count)
        t_compute = time.perf_counter()
        bar = _Progress(start, plan.options.progress)
        try:
            groups = _task_groups(todo, runner.workers(), _shards_per_task(spec, probed, plan.options.shards_per_task))
            got = runner.run(spec, groups, start, bar)
        finally:
            bar.close()
    finally:
        runner.close()
        release_models(run_key)
    timings = {"setup_s": round(t_compute - t_setup, 3), "compute_s": round(time.perf_counter() - t_compute, 3)}
    return _RunResult(claim, [ShardReceipt.from_json(r) for r in got], timings, sum(bool(r.get(REUSED)) for r in got))


def _units(claim: Claim, views: int | None) -> tuple[list[Unit], list[Unit]]:
    """The (view, shard) units still to compute and those already finished."""
    n = claim.layout.n_shards
    if views is None:
        return ([(None, i) for i in range(n) if i not in claim.done], [(None, i) for i in sorted(claim.done)])
    every = [(v, i) for v in range(views) for i in range(n)]
    return [u for u in every if u not in claim.done_views], sorted(claim.done_views)


def _shards_per_task(spec: TaskSpec, probed: Probe, asked: int | None) -> int | None:
    """``asked``, but where A's batches are cut by size (:mod:`featstore.compute._windows`) and
    shards are smaller than a window, the default 1 joins as many as fit in one window: the
    batches are cut from a task's samples, and more samples leave less padding."""
    if asked != 1 or not probed.sizes_vary or not may_group(spec, on_device=False):
        return asked
    return max(1, window_rows(spec) // spec.layout.samples_per_shard)


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
