"""Small deterministic Model A's and datasets for the tests (importable by Dask workers)."""

from __future__ import annotations

import os

import torch
from torch import nn


class TinyA(nn.Module):
    """A deterministic linear+ReLU model returning two outputs."""

    def __init__(self, d_in: int = 12, d_feat: int = 8, d_logits: int = 5, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.f = nn.Linear(d_in, d_feat)
        self.h = nn.Linear(d_feat, d_logits)

    def forward(self, x):
        f = torch.relu(self.f(x))
        return {"features": f, "logits": self.h(f)}


class VectorData(torch.utils.data.Dataset):
    """Items ``{"input": float32[d], "target": int64}``, item i fixed by (seed, i)."""

    def __init__(self, n: int, d: int = 12, seed: int = 0, log: str | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, d, generator=g)
        self.y = torch.randint(0, 5, (n,), generator=g)
        self.log = log

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()} {i}\n")
        return {"input": self.x[i], "target": self.y[i]}


class SlowData(VectorData):
    """VectorData that sleeps per item: gives a kill test time to strike mid-run."""

    def __init__(self, n: int, delay: float, **kw) -> None:
        super().__init__(n, **kw)
        self.delay = delay

    def __getitem__(self, i):
        import time

        time.sleep(self.delay)
        return super().__getitem__(i)


class CountingA(TinyA):
    """TinyA that appends one line to ``path`` per forward call (works across processes)."""

    def __init__(self, path: str, **kw) -> None:
        super().__init__(**kw)
        self.path = path

    def forward(self, x):
        with open(self.path, "a") as f:
            f.write(f"{len(x)}\n")
        return super().forward(x)


class ShapeShift(nn.Module):
    """Output width changes for batches that contain sample ids >= ``at`` (input[:, 0] is the id)."""

    def __init__(self, at: int, dtype_change: bool = False) -> None:
        super().__init__()
        self.at, self.dtype_change = at, dtype_change
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        late = bool((x[:, 0] >= self.at).any())
        if late and self.dtype_change:
            return (x[:, :4] * self.w).double()
        return x[:, : (3 if late else 4)] * self.w


class NaNAt(nn.Module):
    """Identity on 4 columns, with NaN written into sample ``at``."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        out = x[:, :4] * self.w
        return torch.where((x[:, :1] == self.at), torch.full_like(out, float("nan")), out)


class Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        raise RuntimeError("boom from Model A")


class IdData(torch.utils.data.Dataset):
    """Items ``{"input": [id, id+0.5, ...]}`` so a model can see which sample it runs on."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return {"input": torch.arange(6, dtype=torch.float32) * 0.5 + i}


class FailsAt(VectorData):
    """VectorData whose item ``bad`` raises, as a broken file in a real dataset would."""

    def __init__(self, n: int, bad: int, **kw) -> None:
        super().__init__(n, **kw)
        self.bad = bad

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"cannot decode item {i}")
        return super().__getitem__(i)
