"""The suite's environment (tests/conftest.py) reaches every process that runs featstore code:
the test process, the Dask worker processes, and DataLoader workers (fork and spawn)."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from .conftest import CLEARED, PINNED

WATCHED = (*CLEARED, *PINNED)


def environment() -> dict[str, str | None]:
    """The watched variables as this process sees them (MALLOC_* under one key)."""
    env = {k: os.environ.get(k) for k in WATCHED}
    # Dask sets MALLOC_TRIM_THRESHOLD_ in its workers itself (featstore.compute keeps it).
    env["MALLOC_*"] = ",".join(sorted(k for k in os.environ
                                      if k.startswith("MALLOC_") and k != "MALLOC_TRIM_THRESHOLD_"))
    return env


class Env(IterableDataset):
    def __iter__(self):
        yield environment()


def expected() -> dict[str, str | None]:
    return {**{k: None for k in CLEARED}, **PINNED, "MALLOC_*": ""}


def test_test_process_sees_the_pinned_environment():
    assert environment() == expected()
    assert torch.get_num_threads() == 1


#: A shell that sets what the suite must not inherit, and what it pins to other values. Written
#: out here (not taken from conftest's lists), so a variable conftest stops handling fails.
HOSTILE = {"AWS_MAX_ATTEMPTS": "9", "AWS_RETRY_MODE": "adaptive", "MALLOC_ARENA_MAX": "2",
           "MALLOC_TOP_PAD_": "1", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "AWS_PROFILE": "someone",
           "AWS_SESSION_TOKEN": "token", "AWS_ENDPOINT_URL": "http://192.0.2.1", "HTTPS_PROXY": "http://192.0.2.1:3128",
           "https_proxy": "http://192.0.2.1:3128", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1", "OMP_NUM_THREADS": "7",
           "AWS_ACCESS_KEY_ID": "a-real-key", "AWS_SECRET_ACCESS_KEY": "a-real-secret",
           "AWS_CONFIG_FILE": "/root/.aws/config", "NO_PROXY": ""}
WANT = {"AWS_MAX_ATTEMPTS": None, "AWS_RETRY_MODE": None, "MALLOC_ARENA_MAX": None, "MALLOC_TOP_PAD_": None,
        "GLIBC_TUNABLES": None, "AWS_PROFILE": None, "AWS_SESSION_TOKEN": None, "AWS_ENDPOINT_URL": None,
        "HTTPS_PROXY": None, "https_proxy": None, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": None, "OMP_NUM_THREADS": "1",
        "AWS_ACCESS_KEY_ID": "testing-key", "AWS_SECRET_ACCESS_KEY": "testing-secret",
        "AWS_CONFIG_FILE": os.devnull, "NO_PROXY": "127.0.0.1,localhost"}


def test_conftest_overrides_a_hostile_shell():
    """A fresh process started from a shell that sets all of HOSTILE, importing torch first (as
    a pytest plugin would) and then the suite's conftest: the variables are cleared or pinned
    for it and its children, and torch runs one thread."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    code = ("import json, os, torch; import tests.conftest; "
            f"print(json.dumps({{k: os.environ.get(k) for k in {sorted(WANT)!r}}} | "
            "{'threads': torch.get_num_threads()}))")
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, **HOSTILE, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=repo, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.splitlines()[-1]) == {**WANT, "threads": 1}


def test_dask_workers_see_the_pinned_environment(dask_client):
    assert all(env == expected() for env in dask_client.run(environment).values())


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_see_the_pinned_environment(context):
    if context not in multiprocessing.get_all_start_methods():
        pytest.skip(f"this platform has no {context!r} start method")
    got = list(DataLoader(Env(), batch_size=None, num_workers=2, multiprocessing_context=context, timeout=120))
    assert len(got) == 2 and all(env == expected() for env in got)
