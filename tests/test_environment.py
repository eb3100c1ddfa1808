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
    # Dask sets MALLOC_TRIM_THRESHOLD_ in its workers itself (featstore.allocator keeps it).
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


def test_dask_workers_see_the_pinned_environment(dask_client):
    assert all(env == expected() for env in dask_client.run(environment).values())


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_see_the_pinned_environment(context):
    if context not in multiprocessing.get_all_start_methods():
        pytest.skip(f"this platform has no {context!r} start method")
    got = list(DataLoader(Env(), batch_size=None, num_workers=2, multiprocessing_context=context, timeout=120))
    assert len(got) == 2 and all(env == expected() for env in got)
