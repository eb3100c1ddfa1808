"""The pieces of ``featstore demo``: a small frozen CNN (Model A), a synthetic image dataset and
an MLP (Model B). Importable, so tests, examples and benchmarks use the same workload."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset


class SyntheticImages(Dataset):
    """Deterministic random images with a label that depends on them (so B can learn).

    Items are ``{"input": float32 [3, S, S], "target": int64}``; item ``i`` is the same in
    every process, computed from ``seed`` and ``i`` alone.
    """

    def __init__(self, n: int, size: int = 32, classes: int = 10, seed: int = 0) -> None:
        self.n, self.size, self.classes, self.seed = n, size, classes, seed
        g = torch.Generator().manual_seed(seed)
        self.prototypes = torch.randn(classes, 3, size, size, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        target = int(torch.randint(self.classes, (1,), generator=g))
        x = self.prototypes[target] + 1.5 * torch.randn(3, self.size, self.size, generator=g)
        return {"input": x, "target": torch.tensor(target)}

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        return [self[i] for i in indices]


class ModelA(nn.Module):
    """A small frozen CNN: a conv backbone giving ``features``, a linear head giving ``logits``."""

    def __init__(self, width: int = 32, features: int = 128, classes: int = 1000, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.backbone = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1, stride=2), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(8 * width, features), nn.ReLU(),
        )
        self.head = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        f = self.backbone(x)
        return {"features": f, "logits": self.head(f)}


def model_b(features: int = 128, classes: int = 10, hidden: int = 256) -> nn.Module:
    """Model B: an MLP probe on A's features."""
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))
