"""Where a compute's probe and shard tasks run: the seam between the driver and Dask.

A :class:`ShardRunner` runs the probe and the shard tasks (:func:`featstore.compute.run_shards`,
the same function either way) and hands back their receipts; the driver plans, claims and
commits around it. Two runners:

- :class:`DaskRunner` (the default): the tasks on a Dask cluster, the embedded one or the
  user's, with Model A and the dataset scattered once, progress events on the scheduler's topic
  (the terminal bar and the dashboard page), and the shard groups whose scattered inputs died
  with a worker resubmitted.
- :class:`InProcessRunner` (``client="in-process"``): the same task function called in this
  process, one task after the other, with no cluster and no scheduler; its progress events go
  straight to the terminal bar.
"""

from __future__ import annotations

import logging
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from featstore._json import JSONObject
from featstore._user_types import MapDataset, ModelSpec
from featstore.compute._cluster import Cluster, ClusterSpec, connect, task_resources, workers
from featstore.compute._content import ShardCheck, check_shards, collect_checks, in_process
from featstore.compute._options import ComputeOptions
from featstore.compute._request import IN_PROCESS, ComputeCall
from featstore.compute._shard_task import REUSED, probe, run_shards
from featstore.compute._task_spec import Probe, TaskSpec
from featstore.errors import ComputeFailed, FeatstoreError
from featstore.format import ShardReceipt
from featstore.monitor import TOPIC, Event, run_ended
from featstore.versions import version_key, view_key
from featstore.versions import StoredVersion
from featstore.versions import ReceiptRuns

if TYPE_CHECKING:
    from distributed import Future

log = logging.getLogger("featstore")
R = TypeVar("R")

Unit = tuple[int | None, int]  # (view or None, shard): the unit of tasks, receipts and resume
Group = tuple[int | None, list[int]]  # one task's shards, all of one view
#: A progress event as Dask's topic hands it to a subscriber: ``(time, message)`` (anyone may
#: log on the topic: the subscriber checks that a message is one of featstore's events).
Progress = Callable[[tuple[float, object]], None]


class ShardRunner(Protocol):
    """Runs a compute's probe and its shard tasks (see the module's docstring)."""

    #: Torch threads per task (0: leave the process's setting as it is).
    threads: int
    #: Whether the tasks of one process take turns at Model A's forward.
    serial_forward: bool

    def workers(self) -> int:
        """How many tasks can run at once (what the shards are grouped into tasks by)."""
        ...

    def probe(self, spec: TaskSpec, n: int) -> Probe:
        """Model A on the first samples (:func:`featstore.compute.probe`)."""
        ...

    def run(self, spec: TaskSpec, groups: list[Group], start: Event, progress: Progress) -> list[JSONObject]:
        """Run every group's shard task (``start``: the run's start event, sent first; the end
        event is sent last, whatever happens); the receipts (JSON), as the tasks return them."""
        ...

    def check(self, stored: StoredVersion, groups: list[list[int]]) -> list[ShardCheck]:
        """Digest the dataset's items of every group of shards and compare them with ``stored``'s
        (:func:`~featstore.compute._content.check_shards`, without Model A), with progress."""
        ...

    def close(self) -> None:
        """Release what the runner started (an embedded cluster)."""
        ...


def runner_for(call: ComputeCall) -> ShardRunner:
    """``call.client``'s runner: in-process for ``"in-process"``, else Dask (connecting or
    starting the cluster now: :class:`~featstore.ClusterUnavailable` here, before any claim)."""
    if isinstance(call.client, str) and call.client == IN_PROCESS:
        return InProcessRunner(call.model, call.dataset, call.compute_options)
    return DaskRunner(call.model, call.dataset, call.compute_options, call.client)


class _ViewRuns:
    """:class:`ReceiptRuns` per view's receipts folder (one folder without views): receipts are
    compacted into runs as tasks finish, so the commit reads a few objects, not one per shard."""

    def __init__(self, spec: TaskSpec) -> None:
        self.spec = spec
        self.runs: dict[int | None, ReceiptRuns] = {}

    def add(self, receipts: list[JSONObject]) -> None:
        """One task's receipts (a task's shards are all of one view), folded as they come."""
        by_view: dict[int | None, list[ShardReceipt]] = {}
        for r in receipts:
            if not r.get(REUSED):
                receipt = ShardReceipt.from_json(r)
                by_view.setdefault(receipt.view, []).append(receipt)
        for view, rs in by_view.items():
            if view not in self.runs:
                home = view_key(version_key(self.spec.name, self.spec.vid), view)
                self.runs[view] = ReceiptRuns(self.spec.storage, home)
            self.runs[view].add(rs)


def task_key(run_key: str, group: Group, round_: int) -> str:
    """``featstore-shards-<vid>-<run>[-v<view>]-<first>[-<last>][-retry<n>]``.

    One task prefix ("featstore-shards"), so Dask shows one progress bar per compute. The run
    token matters: Dask returns a key's result from memory if a future of an earlier run still
    holds it (an exception's traceback is enough), and a rerun after ``gc`` deleted that
    shard's objects would then commit a shard that is no longer stored.
    """
    view, shards = group
    return (f"featstore-shards-{run_key}{'' if view is None else f'-v{view}'}-{shards[0]:06d}"
            + (f"-{shards[-1]:06d}" if len(shards) > 1 else "") + (f"-retry{round_}" if round_ else ""))


def _task_failed(exc: Exception, key: str) -> ComputeFailed:
    """An error a task raised that is not featstore's (a featstore error is raised as it is)."""
    return ComputeFailed(f"compute task {key} failed: {type(exc).__name__}: {exc}")


class InProcessRunner:
    """The shard tasks called in this process, one after the other (no Dask): the same task
    function as on a cluster, so the same version and the same bytes."""

    threads = 0  # this process's torch threads, as the caller set them
    serial_forward = False  # one task at a time

    def __init__(self, model: ModelSpec, dataset: MapDataset, options: ComputeOptions) -> None:
        self.model, self.dataset, self.options = model, dataset, options

    def workers(self) -> int:
        return 1

    def check(self, stored: StoredVersion, groups: list[list[int]]) -> list[ShardCheck]:
        n = len(self.dataset)
        return in_process(self.dataset, n, self.options.progress)(stored, groups)

    def probe(self, spec: TaskSpec, n: int) -> Probe:
        return probe(spec, self.model, self.dataset, n)

    def run(self, spec: TaskSpec, groups: list[Group], start: Event, progress: Progress) -> list[JSONObject]:
        events = lambda msg: progress((time.time(), msg))  # noqa: E731
        events(start)
        status, error = "failed", ""
        got: list[JSONObject] = []
        runs = _ViewRuns(spec)
        try:
            for group in groups:
                key = task_key(spec.model_key, group, 0)
                try:
                    done = run_shards(replace(spec, view=group[0]), self.model, self.dataset, group[1], events)
                except FeatstoreError:
                    raise
                except Exception as exc:  # noqa: BLE001 - raised as the Dask runner raises a task's error
                    raise _task_failed(exc, key) from exc
                got += done
                runs.add(done)
            status = "written"
            return got
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            events(run_ended(start["run"], status, error))

    def close(self) -> None:
        pass


#: Rounds of resubmission after Dask lost the scattered Model A or dataset with a dead worker.
LOST_DATA_ROUNDS = 3


class DaskRunner:
    """The shard tasks on a Dask cluster (see the module's docstring)."""

    def __init__(self, model: ModelSpec, dataset: MapDataset, options: ComputeOptions, client: ClusterSpec) -> None:
        self.model, self.dataset, self.options = model, dataset, options
        self.cluster: Cluster = connect(client, options.n_workers, options.processes, options.connect_timeout)
        try:
            print(f"featstore: Dask dashboard at {self.cluster.dashboard_link}", file=sys.stderr)
            page = self.cluster.page_link()
            print(f"featstore: progress page at {page}" if page else "featstore: for featstore's dashboard page, "
                  "start the scheduler with `dask scheduler --preload featstore.dashboard`", file=sys.stderr)
            self.client = self.cluster.client
            self._inputs: dict[str, Future[Any]] = {}  # "model", "dataset": scattered on first use
            self.resources = task_resources(self.client)
        except BaseException:
            self.cluster.close()
            raise
        self.threads = self.cluster.torch_threads()
        self.serial_forward = self.cluster.serial_forward

    @property
    def inputs(self) -> list[Future[Any]]:
        """Model A and the dataset on every worker (futures), sent once for every task."""
        return [self._scattered("model"), self._scattered("dataset")]

    def _scattered(self, what: str) -> Future[Any]:
        """``what`` (``"model"`` or ``"dataset"``) on every worker, scattered on first use (a
        content check that finds nothing changed never sends Model A)."""
        if what not in self._inputs:
            x = self.model if what == "model" else self.dataset
            self._inputs[what] = self.client.scatter(x, broadcast=True, hash=False)
        return self._inputs[what]

    def workers(self) -> int:
        return len(workers(self.client))

    def probe(self, spec: TaskSpec, n: int) -> Probe:
        future = self.client.submit(probe, spec, *self.inputs, n, key=f"featstore-probe-{spec.model_key}",
                                    resources=self.resources, pure=False)
        return _result(future)

    def run(self, spec: TaskSpec, groups: list[Group], start: Event, progress: Progress) -> list[JSONObject]:
        """Submit the shard tasks and gather their receipts. The run's start and end go out as
        events (for the terminal bar and the dashboard page).

        A worker that dies takes its tasks with it (Dask reruns them elsewhere) and, when it
        held the only copy (Dask's memory manager keeps one copy of scattered data), the
        scattered Model A or dataset: the tasks that needed it are cancelled. Those are scattered
        again and their shard groups resubmitted, up to :data:`LOST_DATA_ROUNDS` times; shards
        already finished are never recomputed (each task skips shards that have a receipt).
        """
        client = self.client
        client.subscribe_topic(TOPIC, progress)
        client.log_event(TOPIC, start)
        got: list[JSONObject] = []
        status, error = "failed", ""
        try:
            for round_ in range(LOST_DATA_ROUNDS + 1):
                if not groups:
                    break
                if round_:
                    log.warning("%s: a Dask worker died with Model A or the dataset; resubmitting %d "
                                "shard tasks (finished shards are kept)", spec.name, len(groups))
                    self._inputs.clear()  # scattered again on use
                done, groups = self._round(spec, groups, round_)
                got += done
            status = "written"
            return got
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            client.log_event(TOPIC, run_ended(start["run"], status, error))
            time.sleep(0.05)  # let the last progress events arrive
            client.unsubscribe_topic(TOPIC)

    def _round(self, spec: TaskSpec, groups: Sequence[Group], round_: int) -> tuple[list[JSONObject], list[Group]]:
        """Run ``groups`` once; return the receipts (JSON) and the groups whose inputs were lost."""
        from distributed import as_completed, span

        futures = {}
        try:
            with span("featstore", f"{spec.name}@{spec.vid}"):
                for g in groups:
                    futures[self.client.submit(run_shards, replace(spec, view=g[0]), *self.inputs, g[1],
                                               key=task_key(spec.model_key, g, round_),
                                               resources=self.resources, pure=False, retries=0)] = g
                got: list[JSONObject] = []
                lost: list[Group] = []
                runs = _ViewRuns(spec)
                for fut in as_completed(futures):
                    if fut.cancelled() and round_ < LOST_DATA_ROUNDS:  # its scattered inputs died with a worker
                        lost.append(futures[fut])
                        continue
                    done = _result(fut)
                    got += done
                    runs.add(done)
            return got, lost
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    def check(self, stored: StoredVersion, groups: list[list[int]]) -> list[ShardCheck]:
        """One task per group, the dataset scattered once; a progress bar over the items as the
        tasks finish (they show on the dashboard as ``featstore-check-...``)."""
        from distributed import as_completed

        n = len(self.dataset)
        dataset = self._scattered("dataset")
        futures = [self.client.submit(check_shards, stored, dataset, g, n, pure=False,
                                      key=f"featstore-check-{stored.id}-{uuid.uuid4().hex[:8]}-{g[0]:06d}")
                   for g in groups]
        try:
            return collect_checks(stored, n, self.options.progress, (_result(f) for f in as_completed(futures)))
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    def close(self) -> None:
        self.cluster.close()


def _result(future: Future[R]) -> R:
    """A Dask future's result; what its task raised as the driver raises it."""
    try:
        return future.result()
    except FeatstoreError as exc:
        exc.args = (f"{exc} [Dask task {future.key}]", *exc.args[1:])
        raise
    except Exception as exc:  # noqa: BLE001 - anything else a task raised
        raise _task_failed(exc, str(future.key)) from exc
