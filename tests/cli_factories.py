"""Import-path factories for the command-line tests (``tests.cli_factories:small_model``).

Dask worker processes started by the tests import them by path, as an operator's workers would
import ``mypkg.models:teacher``.
"""

from __future__ import annotations

import os
import time

import torch

from featstore.demo import ModelA, SyntheticImages

#: Samples of :func:`small_dataset`.
N = 1200


def small_model() -> torch.nn.Module:
    """The demo CNN, narrow, so a compute takes seconds on two cores."""
    return ModelA(width=8, features=32, classes=10)


class GatedModel(torch.nn.Module):
    """:func:`small_model`, sleeping ``delay`` per batch while the file named by
    ``$FEATSTORE_TEST_GATE`` exists: a test holds a compute open while it watches, then lets
    it finish at full speed (no race against a fixed sleep on a busy machine)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.inner = small_model()
        self.delay = delay
        self.gate = os.environ.get("FEATSTORE_TEST_GATE", "")

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.gate and os.path.exists(self.gate):
            time.sleep(self.delay)
        return self.inner(x)


def gated_model() -> torch.nn.Module:
    """1 s per batch while the gate file exists."""
    return GatedModel(1.0)


def small_dataset() -> SyntheticImages:
    """Synthetic 3x16x16 images with a target."""
    return SyntheticImages(N, size=16)


class FailingModel(torch.nn.Module):
    """:func:`small_model` that raises on every batch but the probe's first."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = small_model()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        if self.calls > 1:
            raise ValueError("broken on purpose")
        return self.inner(x)


def failing_model() -> torch.nn.Module:
    return FailingModel()
