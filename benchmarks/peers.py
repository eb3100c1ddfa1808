"""Parent side of the LitData / Mosaic Streaming rows: find the peers' Python, run the child."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

PEERS_ENV = "FEATSTORE_BENCH_PEERS_PYTHON"
DEFAULT_PEERS_PYTHON = ".venv-peers/bin/python"
SETUP = ("python3 -m venv .venv-peers && .venv-peers/bin/pip install torch==2.13.0 numpy boto3 && "
         ".venv-peers/bin/pip install --no-deps litdata==0.2.76 mosaicml-streaming==0.13.0 'transformers<5' && "
         ".venv-peers/bin/pip install lightning-utilities filelock 'numpy<2.2' 'xxhash<4' zstd zstandard "
         "python-snappy brotli tqdm catalogue pillow huggingface-hub==0.36.0 safetensors "
         "'tokenizers>=0.22,<=0.23.0' regex pyyaml packaging")


def peers_python() -> str | None:
    """The peers' interpreter (``$FEATSTORE_BENCH_PEERS_PYTHON`` or ``.venv-peers/bin/python``)."""
    path = os.environ.get(PEERS_ENV, DEFAULT_PEERS_PYTHON)
    return path if os.path.exists(path) else None


def run_peers(data_dir: str, workdir: str, repeats: int, endpoint: str | None, workers: list[int],
              threads: int, timeout: float = 1800) -> dict[str, Any]:
    """Run :mod:`benchmarks.peers_child` in the peers' environment; ``{"unavailable": why}`` when
    there is none, else the child's JSON (a peer that failed carries its error text)."""
    spec = {"data": data_dir, "workdir": workdir, "repeats": repeats, "endpoint": endpoint,
            "workers": workers, "threads": threads}
    return run_child("benchmarks.peers_child", spec, timeout)


def run_child(module: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """``module`` run with ``spec`` (its ``workdir`` gets the spec file) in the peers' environment:
    its last stdout line as JSON, or ``{"unavailable": why}`` without the environment or output."""
    py = peers_python()
    if py is None:
        return {"unavailable": f"no peers environment: set {PEERS_ENV} or create it with `{SETUP}`"}
    workdir = spec["workdir"]
    spec_path = os.path.join(workdir, "peers-spec.json")
    os.makedirs(workdir, exist_ok=True)
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    proc = subprocess.run([py, "-m", module, spec_path], capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"unavailable": f"the peers' process failed (exit {proc.returncode}): {proc.stderr[-2000:]}"}
    return json.loads(lines[-1])
