"""The benchmark's Model B and its training loop, with torch and numpy only.

Kept free of featstore imports so the peers' child process (a separate virtual environment with
LitData and Mosaic Streaming, but no zarr) trains exactly the same B the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

FEATURES = 512
LOGITS = 1000
CLASSES = 10
EPOCHS = 3
BATCH = 256
DISTILL_T = 2.0


class ModelB(nn.Module):
    """An MLP student: a class head on A's features plus a 1000-way head distilled from A's logits."""

    def __init__(self, hidden: int = 256, seed: int = 1) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU())
        self.cls = nn.Linear(hidden, CLASSES)
        self.distill = nn.Linear(hidden, LOGITS)

    def forward(self, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(f)
        return self.cls(h), self.distill(h)


@dataclass(frozen=True)
class TrainResult:
    """One 3-epoch training run: wall time, last epoch's accuracy, steps taken."""

    seconds: float
    accuracy: float
    steps: int


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # features (any float), logits, target


def train(batches: Callable[[int], Iterable[Batch]], epochs: int = EPOCHS, seed: int = 1,
          max_steps: int | None = None) -> TrainResult:
    """Train a fresh B with Adam on ``batches(epoch)``; the clock covers reading and training.

    ``max_steps`` stops early (used where a row is run on a subset and extrapolated).
    """
    net = ModelB(seed=seed)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    ce = nn.CrossEntropyLoss()
    kl = nn.KLDivLoss(reduction="batchmean", log_target=True)
    steps = correct = total = 0
    t0 = time.perf_counter()
    for epoch in range(epochs):
        correct = total = 0
        for f, logits, y in batches(epoch):
            out, dist = net(f.float())
            teacher = torch.log_softmax(logits.float() / DISTILL_T, dim=1)
            loss = ce(out, y) + kl(torch.log_softmax(dist / DISTILL_T, dim=1), teacher)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            correct += int((out.argmax(1) == y).sum())
            total += len(y)
            steps += 1
            if max_steps is not None and steps >= max_steps:
                return TrainResult(time.perf_counter() - t0, correct / max(total, 1), steps)
    return TrainResult(time.perf_counter() - t0, correct / max(total, 1), steps)


def read_only(batches: Iterable[Batch]) -> tuple[float, int]:
    """Drain one epoch without training (the reader's own rate): (seconds, samples)."""
    n = 0
    t0 = time.perf_counter()
    for f, logits, y in batches:
        n += len(y)
        # touch the decoded values as training would (a float copy), so lazy readers pay too
        f.float()
        logits.float()
    return time.perf_counter() - t0, n
