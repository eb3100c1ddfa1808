"""Models, datasets and factories that make the mistakes a new user makes (tests/cli/test_mistakes.py).

Importable by path (``tests.mistakes:broken_model``), so the command line and Dask worker
processes build them as an operator's workers would build ``mypkg.models:teacher``.
"""

from __future__ import annotations

import torch
from torch import nn

#: Items of every dataset here; sample ``BAD`` is the one a faulty model or dataset trips on.
N, BAD = 24, 5


class Vectors(torch.utils.data.Dataset):
    """Items ``{"input": float32[4] (input[0] is the sample index), "target": int64}``."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"input": torch.tensor([float(i), 1.0, 2.0, 3.0]), "target": torch.tensor(i % 3)}


def vectors() -> Vectors:
    return Vectors()


class Float64At(nn.Module):
    """float64 outputs: ``value`` for sample ``at`` (input[0] == at), ``base`` elsewhere."""

    def __init__(self, value: float = 1e300, at: int = BAD, base: float = 1.0) -> None:
        super().__init__()
        self.value, self.at, self.base = value, at, base
        self.w = nn.Parameter(torch.ones(2, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hit = (x[:, :1] == self.at).to(torch.float64)
        return (hit * self.value + (1 - hit) * self.base) * self.w


class Wrap(nn.Module):
    """Model A whose forward calls a plain function held as an attribute (the fingerprint cannot
    see a function's code)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.lin(x))


class RandomItems(Vectors):
    """A dataset whose ``__getitem__`` draws from the global RNG: a new digest every read."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(i)
        return {**item, "input": item["input"] + torch.rand(4)}


class IndexErrorAt(Vectors):
    """``__getitem__`` raises ``IndexError`` for indices ``>= BAD`` although ``len`` is ``N``."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i >= BAD:
            raise IndexError(f"list index out of range (row {i})")
        return super().__getitem__(i)


class RaisesAt(Vectors):
    """``__getitem__`` raises ``ValueError`` for the last sample (which the fingerprint reads)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i == self.n - 1:
            raise ValueError(f"corrupt record {i}")
        return super().__getitem__(i)


def raising_items() -> RaisesAt:
    return RaisesAt()


class Images(Vectors):
    """Items whose input is a PIL image (what torchvision datasets return without a transform)."""

    def __getitem__(self, i: int):
        from PIL import Image

        return {"input": Image.new("RGB", (4, 4)), "target": torch.tensor(i % 3)}


class StringField(Vectors):
    """Items with a string field (a file name)."""

    def __getitem__(self, i: int):
        return {**super().__getitem__(i), "path": f"img-{i}.png"}


class RaggedField(Vectors):
    """Items with a field whose shape changes from sample to sample."""

    def __getitem__(self, i: int):
        return {**super().__getitem__(i), "boxes": torch.zeros(i % 3 + 1, 4)}


def broken_model() -> nn.Module:
    raise RuntimeError("weights file teacher.pt not found")


def broken_dataset() -> Vectors:
    raise FileNotFoundError("no such folder: /data/train")


def cuda_model() -> nn.Module:
    """A factory that puts Model A on CUDA itself (fails where there is no CUDA)."""
    return nn.Linear(4, 2).to("cuda")


def linear() -> nn.Module:
    return nn.Linear(4, 2)
