"""What the dashboard knows about computes: :mod:`featstore.monitor` folded into run states.

Pure bookkeeping (no Dask, no Bokeh), so it is tested on its own and shared by the dashboard
page and the Prometheus collector in :mod:`featstore.dashboard`. Samples are counted per shard,
so a shard that starts again (its worker died, Dask retried the task) is not counted twice.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TypedDict

from featstore.monitor._events import Event, is_event

#: Seconds of history the recent rate (and so the ETA) is measured over.
RATE_WINDOW_S = 20.0
#: Finished runs kept on the page (running ones are always kept).
KEEP_FINISHED = 8

TODO, RUNNING, DONE = "todo", "running", "done"


@dataclass
class WorkerStats:
    """One worker's share of one run, and its device as the worker reported it."""

    samples: int = 0
    first: float = 0.0
    last: float = 0.0
    device: dict[str, object] = field(default_factory=dict)  # DeviceInfo's keys, as reported


class RunSnapshot(TypedDict):
    """One run as the page and ``/metrics`` show it (:meth:`RunState.snapshot`)."""

    run: str
    name: str
    version: str
    status: str
    error: str
    samples: int
    samples_done: int
    rate: float
    eta_s: float
    bytes_written: int
    shards_done: int
    shards_running: int
    shards_todo: int
    nonfinite: int
    max_abs_error: float
    elapsed_s: float
    workers: dict[str, dict[str, object]]  # per worker: samples, rate and its device's keys


@dataclass
class RunState:
    """One compute run, as its events told it."""

    run: str
    name: str = "?"
    version: str = "?"
    samples: int = 0
    samples_per_shard: int = 1
    views: int = 1  # augmented views: shards are numbered view-major over every view's shards
    url: str = ""
    started: float = 0.0
    ended: float | None = None
    status: str = "running"
    error: str = ""
    shard_state: list[str] = field(default_factory=list)
    shard_samples: list[int] = field(default_factory=list)
    bytes_written: int = 0
    nonfinite: int = 0
    max_abs_error: float = 0.0
    workers: dict[str, WorkerStats] = field(default_factory=dict)
    history: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=4096))  # (time, samples done)

    def apply(self, msg: Event, now: float) -> None:
        """Fold one event into the state."""
        kind = msg["kind"]
        if kind == "run":
            self._start(msg, now)
        elif kind == "end":
            self.status, self.error, self.ended = str(msg.get("status", "?")), str(msg.get("error", "")), now
        elif kind in ("batch", "shard-start", "shard"):
            self._shard_event(kind, msg, now)
        self.history.append((now, self.samples_done))

    def _start(self, msg: Event, now: float) -> None:
        self.name, self.version, self.url = str(msg["name"]), str(msg["version"]), str(msg.get("url", ""))
        self.views = max(1, int(msg.get("views", 1)))
        self.samples, self.started = int(msg["samples"]) * self.views, now
        self.samples_per_shard = max(1, int(msg["samples_per_shard"]))
        n = self.views * -(-self.view_samples // self.samples_per_shard)
        self.shard_state, self.shard_samples = [TODO] * n, [0] * n
        for i in msg.get("shards_done", ()):
            if 0 <= int(i) < n:
                self.shard_state[int(i)], self.shard_samples[int(i)] = DONE, self.shard_len(int(i))

    @property
    def view_samples(self) -> int:
        """Samples per view (all of them without views)."""
        return self.samples // self.views

    def shard_len(self, i: int) -> int:
        """Samples in shard ``i`` (of its view, with views)."""
        i %= -(-self.view_samples // self.samples_per_shard) or 1
        return max(0, min(self.samples_per_shard, self.view_samples - i * self.samples_per_shard))

    def _shard_event(self, kind: str, msg: Event, now: float) -> None:
        i = int(msg.get("shard", -1))
        if not 0 <= i < len(self.shard_state):
            return
        w = self.workers.setdefault(str(msg.get("worker", "?")), WorkerStats(first=now))
        w.last = now
        if kind == "shard-start":
            self.shard_state[i], self.shard_samples[i] = RUNNING, 0  # a retried shard starts over
            w.device = {k: v for k, v in msg.items() if k.startswith(("device", "gpu"))}
        elif kind == "batch":
            n = int(msg["samples"])
            self.shard_samples[i] = min(self.shard_len(i), self.shard_samples[i] + n)
            w.samples += n
        elif self.shard_state[i] != DONE:
            self.shard_state[i], self.shard_samples[i] = DONE, self.shard_len(i)
            self.bytes_written += int(msg.get("bytes", 0))
            self.nonfinite += int(msg.get("nonfinite", 0))
            self.max_abs_error = max(self.max_abs_error, float(msg.get("max_abs_error", 0.0)))

    @property
    def samples_done(self) -> int:
        return sum(self.shard_samples)

    def counts(self) -> dict[str, int]:
        """Shards done, in flight and to do."""
        return {s: self.shard_state.count(s) for s in (DONE, RUNNING, TODO)}

    def rate(self, now: float) -> float:
        """Samples per second over the last :data:`RATE_WINDOW_S` (0 before two events)."""
        end = self.ended or now
        recent = [(t, d) for t, d in self.history if t >= end - RATE_WINDOW_S] or list(self.history)[-2:]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return 0.0
        return max(0.0, (recent[-1][1] - recent[0][1]) / (end - recent[0][0]))

    def eta_s(self, now: float) -> float:
        """Seconds left at the recent rate: 0 when finished, ``inf`` while unknown."""
        left = self.samples - self.samples_done
        if self.ended is not None or left <= 0:
            return 0.0
        r = self.rate(now)
        return left / r if r > 0 else math.inf

    def snapshot(self, now: float) -> RunSnapshot:
        """Everything the page and /metrics show, as plain values."""
        c = self.counts()
        return {
            "run": self.run, "name": self.name, "version": self.version, "status": self.status,
            "error": self.error, "samples": self.samples, "samples_done": self.samples_done,
            "rate": self.rate(now), "eta_s": self.eta_s(now), "bytes_written": self.bytes_written,
            "shards_done": c[DONE], "shards_running": c[RUNNING], "shards_todo": c[TODO],
            "nonfinite": self.nonfinite, "max_abs_error": self.max_abs_error,
            "elapsed_s": (self.ended or now) - self.started,
            "workers": {a: {"samples": w.samples, "rate": w.samples / max(w.last - w.first, 1e-9)
                            if w.last > w.first else 0.0, **w.device} for a, w in self.workers.items()},
        }


class Monitor:
    """Every recent run, fed with events in arrival order (one scheduler's view)."""

    def __init__(self, keep_finished: int = KEEP_FINISHED) -> None:
        self.runs: OrderedDict[str, RunState] = OrderedDict()
        self.keep_finished = keep_finished
        self.events = 0

    def apply(self, msg: object, now: float | None = None) -> None:
        """Fold one event in; anything that is not one of ours is ignored."""
        if not is_event(msg):
            return
        now = time.time() if now is None else now
        state = self.runs.get(msg["run"])
        if state is None:
            state = self.runs[msg["run"]] = RunState(msg["run"], started=now)
            self._forget_old()
        state.apply(msg, now)
        self.events += 1

    def _forget_old(self) -> None:
        finished = [k for k, s in self.runs.items() if s.ended is not None]
        for k in finished[:max(0, len(finished) - self.keep_finished)]:
            del self.runs[k]

    def snapshots(self, now: float | None = None) -> list[RunSnapshot]:
        """Newest run first."""
        now = time.time() if now is None else now
        return [s.snapshot(now) for s in reversed(self.runs.values())]
