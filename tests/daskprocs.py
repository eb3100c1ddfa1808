"""A real Dask cluster of command-line programs on loopback: ``dask scheduler --preload
featstore.dashboard`` and ``dask worker`` processes, as an operator would start them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def dask_command() -> list[str]:
    """The ``dask`` program of this Python environment."""
    exe = Path(sys.executable).parent / "dask"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "dask"]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the checkout first on PYTHONPATH (featstore and the
    tests' factories importable in every child)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


@dataclass
class DaskProcs:
    """The scheduler's address and dashboard, and the processes (stopped by :meth:`close`)."""

    address: str
    dashboard: str
    scheduler: subprocess.Popen
    workers: list[subprocess.Popen] = field(default_factory=list)

    def get(self, path: str, timeout: float = 60) -> str:
        with urllib.request.urlopen(self.dashboard + path, timeout=timeout) as r:
            return r.read().decode()

    def kill_worker(self, i: int = 0) -> None:
        """SIGKILL one worker process (no nanny restarts it)."""
        self.workers[i].send_signal(signal.SIGKILL)
        self.workers[i].wait(10)

    def close(self) -> None:
        for p in [*self.workers, self.scheduler]:
            if p.poll() is None:
                p.terminate()
        for p in [*self.workers, self.scheduler]:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def start(tmp: Path, n_workers: int = 2, env: dict[str, str] | None = None, timeout: float = 300) -> DaskProcs:
    """Start the scheduler (with featstore's preload) and ``n_workers`` one-thread workers."""
    env = env or child_env()
    info = tmp / "scheduler.json"
    log = open(tmp / "scheduler.log", "wb")  # noqa: SIM115 - lives as long as the process
    sched = subprocess.Popen(
        [*dask_command(), "scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address",
         "127.0.0.1:0", "--preload", "featstore.dashboard", "--scheduler-file", str(info)],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    deadline = time.monotonic() + timeout
    while not info.exists() or not info.read_text().strip():
        if sched.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"dask scheduler did not start: {(tmp / 'scheduler.log').read_text()[-2000:]}")
        time.sleep(0.2)
    meta = json.loads(info.read_text())
    procs = DaskProcs(meta["address"], f"http://127.0.0.1:{meta['services']['dashboard']}", sched)
    for i in range(n_workers):
        wlog = open(tmp / f"worker{i}.log", "wb")  # noqa: SIM115
        procs.workers.append(subprocess.Popen(
            [*dask_command(), "worker", meta["address"], "--nthreads", "1", "--no-nanny",
             "--host", "127.0.0.1", "--no-dashboard", "--name", f"w{i}", "--memory-limit", "0"],
            env=env, stdout=wlog, stderr=subprocess.STDOUT, cwd=tmp))
    _wait_workers(procs, n_workers, deadline, tmp)
    return procs


def _wait_workers(procs: DaskProcs, n: int, deadline: float, tmp: Path) -> None:
    while True:
        try:
            if json.loads(procs.get("/json/counts.json")).get("workers", 0) >= n:
                return
        except OSError:
            pass
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs.workers):
            procs.close()
            logs = "\n".join(p.read_text()[-1500:] for p in sorted(tmp.glob("*.log")))
            raise RuntimeError(f"dask workers did not connect:\n{logs}")
        time.sleep(0.3)
