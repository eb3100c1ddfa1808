"""Small deterministic Model A's and datasets for the tests (importable by Dask workers).

Floats are not bit-reproducible across processes, thread counts, batch shapes or CPUs: a sum of
products is rounded differently when a kernel splits it differently. The tests compare A's
outputs computed inside Dask workers with references computed elsewhere (the test process, a
killed and resumed run, another machine's CI), so :class:`TinyA` and :class:`VectorData` compute
*exactly*: inputs and weights are dyadic rationals on a coarse grid (multiples of 2**-6, bounded),
so every product and every partial sum is exactly representable in float32 and the result is the
same in any summation order (:func:`check_exact` proves the bound). Models without that property
are compared with a stated tolerance (:func:`assert_close_across_processes`).
"""

from __future__ import annotations

import os

import torch
from torch import nn

#: Inputs and weights are multiples of 2**-GRID_BITS; inputs are clipped to [-X_MAX, X_MAX].
GRID_BITS, X_MAX = 6, 3.0


def on_grid(t: torch.Tensor, bits: int = GRID_BITS) -> torch.Tensor:
    """``t`` rounded to the nearest multiple of ``2**-bits``."""
    return torch.round(t * 2.0**bits) / 2.0**bits


def check_exact(layers: list[nn.Linear], x_max: float, bits: int = GRID_BITS) -> None:
    """Assert that a stack of on-grid Linear(+ReLU) layers on on-grid inputs bounded by ``x_max``
    computes every partial sum exactly in float32 (24-bit significand)."""
    bound, step = x_max, 2.0**-bits  # |activation| bound and the grid its values lie on
    for lin in layers:
        w = lin.weight.detach().abs()
        bound = float((w.sum(dim=1) * bound + lin.bias.detach().abs()).max())
        step *= 2.0**-bits
        assert bound / step < 2**24, "partial sums would round: choose a coarser grid"


def assert_close_across_processes(got: torch.Tensor, ref: torch.Tensor) -> None:
    """A's outputs computed in another process (a Dask worker: other thread count, other batch
    shape, maybe another CPU kernel) equal ``ref`` up to float32 rounding, not bit for bit:
    featstore stores exactly what A produced, but A itself is not bit-reproducible."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


class TinyA(nn.Module):
    """A deterministic linear+ReLU model returning two outputs, exact on :class:`VectorData`."""

    def __init__(self, d_in: int = 12, d_feat: int = 8, d_logits: int = 5, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.f = nn.Linear(d_in, d_feat)
        self.h = nn.Linear(d_feat, d_logits)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(on_grid(p))
        check_exact([self.f, self.h], X_MAX)

    def forward(self, x):
        f = torch.relu(self.f(x))
        return {"features": f, "logits": self.h(f)}


class VectorData(torch.utils.data.Dataset):
    """Items ``{"input": float32[d], "target": int64}``, item i fixed by (seed, i); inputs on
    the exact grid of :class:`TinyA`."""

    def __init__(self, n: int, d: int = 12, seed: int = 0, log: str | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = on_grid(torch.randn(n, d, generator=g).clamp(-X_MAX, X_MAX))
        self.y = torch.randint(0, 5, (n,), generator=g)
        self.log = log

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()} {i}\n")
        return {"input": self.x[i], "target": self.y[i]}


class MultiA(nn.Module):
    """One output per storage codec: dense float32/float16/bfloat16/int8 features and the sparse
    soft-label codecs of a 12-class head (see ``MULTI_OUTPUTS``)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.a = TinyA(d_logits=12, seed=seed)

    def forward(self, x):
        out = self.a(x)
        f, logits = out["features"], out["logits"]
        return {"f32": f, "f16": f, "bf16": f, "i8": f, "topk": logits, "topp": logits, "sample": logits}


#: MultiA's outputs, one per codec.
MULTI_OUTPUTS = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "i8": "int8", "topk": "topk:3@2",
                 "topp": "topp:0.9:2:6", "sample": "sample:4"}


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


class RaisesFrom(nn.Module):
    """Identity on 4 columns of :class:`IdData`'s input until a batch holds sample ``at`` or a later
    one: then it raises (a probe of the first samples passes; the epoch's later batches fail)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        if bool((x[:, 0] >= self.at).any()):
            raise RuntimeError(f"boom from Model A at sample {self.at} or later")
        return x[:, :4] * self.w


class Tile(nn.Module):
    """Model A whose one output is its input tiled ``reps`` times: wide rows, exact values."""

    def __init__(self, reps: int) -> None:
        super().__init__()
        self.reps = reps
        self.w = nn.Parameter(torch.ones(1))  # something to digest

    def forward(self, x):
        return {"features": x.repeat(1, self.reps)}


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


class _OnGridLinear(nn.Module):
    """``Linear(12, 4)`` with on-grid weights (seed 0): exact on :class:`VectorData`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(12, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(on_grid(p))


class ReluLin(_OnGridLinear):
    """Same weights as :class:`DoubleLin`, other code."""

    def forward(self, x):
        return torch.relu(self.lin(x))


class DoubleLin(_OnGridLinear):
    """Same weights as :class:`ReluLin`, other code."""

    def forward(self, x):
        return self.lin(x) * 2


class GrowingData(torch.utils.data.Dataset):
    """Items like VectorData's, but item i depends on (seed, i) only: ``GrowingData(150)``
    starts with the 100 items of ``GrowingData(100)`` (a dataset that grows at the end)."""

    def __init__(self, n: int, d: int = 12, seed: int = 0) -> None:
        self.n, self.d, self.seed = n, d, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return {"input": torch.randn(self.d, generator=g), "target": torch.randint(0, 5, (), generator=g)}


class TokenSeqs(torch.utils.data.Dataset):
    """Token sequences of varying lengths (``lo``..``hi`` tokens), each with a label."""

    def __init__(self, n: int = 60, vocab: int = 97, lo: int = 3, hi: int = 12, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = [torch.randint(1, vocab, (int(torch.randint(lo, hi + 1, (), generator=g)),), generator=g)
                      for _ in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return {"input": self.items[i], "target": i % 3}


class TinyLM(nn.Module):
    """A toy causal language model: per-token logits ``[B, L, vocab]`` (position-dependent
    through a cumulative mean, so padding never changes a real token's output)."""

    def __init__(self, vocab: int = 97, dim: int = 16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.emb(x["ids"]).cumsum(1) / torch.arange(1, x["ids"].shape[1] + 1).reshape(1, -1, 1)
        return self.head(h) * 3


def drop_a_token(item: dict, g: torch.Generator) -> dict:
    """An augment for token sequences: drops one random token (so views differ in length)."""
    seq = item["input"]
    k = int(torch.randint(0, len(seq), (), generator=g))
    return {**item, "input": torch.cat([seq[:k], seq[k + 1:]])}


class EditedAt(torch.utils.data.Dataset):
    """``dataset`` with item ``at``'s ``field`` changed (``+ 0.5``, or the tokens reversed for an
    int field): one edited item, the others as they were (issue 42's reruns and reader checks)."""

    def __init__(self, dataset: torch.utils.data.Dataset, at: int, field: str = "input") -> None:
        self.dataset, self.at, self.field = dataset, at, field

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        item = self.dataset[i]
        if i != self.at:
            return item
        value = item[self.field]
        changed = value.flip(0) if not value.is_floating_point() else value + 0.5
        return {**item, self.field: changed}


class MeanPool(nn.Module):
    """A toy sentence encoder: token embeddings averaged over the real tokens (the attention
    mask of :func:`featstore.ragged.pad_sequences`), then a linear layer: ``[B, dim]``, the same
    for a sample whatever its batch pads to. With ``path``, each forward appends its padded
    width and its real tokens to that file (works across processes)."""

    def __init__(self, vocab: int = 97, dim: int = 8, path: str | None = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, dim)
        self.out = nn.Linear(dim, dim)
        self.path = path

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = x["attention_mask"]
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(f"{mask.shape[0]} {mask.shape[1]} {int(mask.sum())}\n")
        m = mask.unsqueeze(-1).float()
        return self.out((self.emb(x["ids"]) * m).sum(1) / m.sum(1).clamp(min=1))


class RaisesOnToken(MeanPool):
    """:class:`MeanPool` that raises ``ValueError`` on a batch holding token ``token``."""

    def __init__(self, token: int, vocab: int = 97) -> None:
        super().__init__(vocab=vocab)
        self.token = token

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        if bool((x["ids"] == self.token).any()):
            raise ValueError(f"token {self.token}")
        return super().forward(x)


class LengthDependent(MeanPool):
    """:class:`MeanPool` whose output width is the batch's padded length: its shape changes
    with how a batch pads (what a Model A must not do)."""

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return super().forward(x).new_zeros((x["ids"].shape[0], x["ids"].shape[1]))
