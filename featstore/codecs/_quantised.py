"""The arithmetic of ``topkq:K[:L][@T]``: compact top-k soft labels for language models (pure torch).

A language model's per-token top-k soft labels are mostly bytes: ``topk:50`` stores 50 uint16 ids
and 50 float16 log-probabilities per token (about 154 B/token after zstd on SmolLM2's outputs,
docs/benchmarks.md). ``topkq`` stores the same K classes in three plain Zarr arrays that zstd
shrinks far better, each readable as a standard dtype:

- ``<name>.ids``: the K class ids of each row **sorted ascending** (uint16 up to 65,536 classes,
  else uint32: ids are real ids, only their order changes). Sorting is what compresses: a set of
  K ids in order has ``log2(K!)`` bits less information than the same ids by rank, and zstd finds
  the small, skewed steps between them (62.0 B/token against 86.6 by rank, K=50 on SmolLM2).
  Delta-coding the sorted ids saved 0.6 B/token more: not worth making plain-Zarr readers undo
  it, so the ids stay plain ids.
- ``<name>.values``: each kept class's probability as a **square-root level** ``l = round(L *
  sqrt(p))`` (uint8, ``L <= 255``), in the ids' order. A level step costs the same KL wherever it
  is (KL ~ ``sum_i p_i eps_i**2 / 2`` and a step in ``sqrt(p)`` moves ``log p`` by ``2 / (L
  sqrt(p))``), so the error is spread evenly: KL(stored || exact) ~ ``(K + 1) / (6 L**2)`` nats
  per row on average (measured 5.0e-4 at K=50, L=128 on SmolLM2).
- ``<name>.tail``: the probability of every class *not* kept (``1 - sum p``), as a level of the
  same scale (uint8). Storing it instead of inferring it from the kept values keeps the uniform
  tail right when the kept mass is near 1: ``1 - sum q`` of quantised values measured a KL 30x
  larger than the quantisation itself.

**Reconstruction** (what a reader does; recorded in the manifest): a level ``l`` stands for
``q(l) = (l / L)**2`` (``l = 0``: ``1 / (12 L**2)``, the mean probability of that bin, never 0);
the row's kept log-probabilities are ``log q(values) - log Z`` with ``Z = sum q(values) +
q(tail)``, and the mass ``q(tail) / Z`` is spread evenly over the classes not kept (the
``uniform_tail`` rule of every top-k codec). Batches carry the ids (int64) and these normalised
float32 log-probabilities as ``<name>.ids`` / ``<name>.values``, like ``topk``, so
:mod:`featstore.kd` reads them unchanged; ``<name>.tail`` is consumed by the normalisation.
"""

from __future__ import annotations

import functools
import math
from typing import Any


from featstore._lazy import np, torch  # imported on first use: the quick commands never need them
from featstore.codecs._sparse import KL_ROWS, uniform_tail_kl


#: The default number of square-root levels: KL ~ (K + 1) / (6 L**2) is ~5e-4 nats at K = 50.
DEFAULT_LEVELS = 128
MAX_LEVELS = 255  # a level is a uint8


@functools.lru_cache(maxsize=8)
def level_table(levels: int) -> torch.Tensor:
    """``log q(l)`` for every stored level ``l`` in ``0..255`` (float32): ``log((l / L)**2)``,
    and ``log(1 / (12 L**2))`` for ``l = 0``. Levels above ``L`` never occur (the table still
    maps them, so a damaged byte decodes to a finite value, never NaN).

    >>> [round(float(v), 3) for v in level_table(128)[[0, 1, 128]]]
    [-12.189, -9.704, 0.0]
    """
    s = torch.arange(256, dtype=torch.float64) / levels
    s[0] = 1.0 / (math.sqrt(12.0) * levels)
    # kept per process (every decode of a batch asks for it): read-only, only ever indexed
    return (2.0 * torch.log(s)).to(torch.float32).requires_grad_(False)


def quantise(p: torch.Tensor, levels: int) -> torch.Tensor:
    """Probabilities -> square-root levels (uint8): ``round(L * sqrt(p))``, clamped to ``[0, L]``."""
    return torch.round(p.clamp(0, 1).sqrt() * levels).clamp(0, levels).to(torch.uint8)


def normalised(log_q: torch.Tensor, log_tail: torch.Tensor) -> torch.Tensor:
    """The kept log-probabilities of rows ``[..., K]`` whose unnormalised level values are
    ``log_q`` and tail ``log_tail [...]``: ``log_q - log Z`` (see the module). Padding rows
    (every value ``-inf``) stay ``-inf``."""
    z = torch.logsumexp(torch.cat([log_q, log_tail.unsqueeze(-1)], dim=-1), dim=-1, keepdim=True)
    return log_q - torch.where(torch.isfinite(z), z, torch.zeros_like(z))


def encode_rows(logp: torch.Tensor, k: int, levels: int) -> dict[str, torch.Tensor]:
    """The device half of ``topkq`` on rows of teacher log-probabilities ``[R, C]`` (at the
    codec's temperature): the parts (ids int64 sorted ascending, values and tail uint8) and the
    per-row diagnostics :func:`featstore.codecs._sparse.sparse_error` turns into the manifest's
    codec error (``quant_kl``: KL of the exact top-k to the stored one, every row)."""
    top, ids = torch.topk(logp, k, dim=-1)
    out, (top, stored, kept) = _encode_top(top, ids, levels)
    n = min(len(logp), KL_ROWS)
    return {**out, "kl": uniform_tail_kl(logp[:n], top[:n], stored[:n], kept[:n])}


def encode_top(top: torch.Tensor, ids: torch.Tensor, levels: int) -> dict[str, torch.Tensor]:
    """:func:`encode_rows` for rows whose top-k an engine already ranked: ``top [R, K]`` the
    log-probabilities of ``ids [R, K]`` in the full distribution. The same parts and diagnostics,
    less the KL to the full distribution (``kl``), which only the full rows give."""
    return _encode_top(top, ids, levels)[0]


def _encode_top(top: torch.Tensor, ids: torch.Tensor,
                levels: int) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The parts and diagnostics of rows' top-k, and (the top-k in ids' order, the stored
    log-probabilities, the kept mask) for the KL to the full rows."""
    ids, order = torch.sort(ids, dim=-1)
    top = torch.gather(top, 1, order)
    p = top.double().exp()
    tail = (1.0 - p.sum(-1)).clamp(min=0)
    values, tail_level = quantise(p, levels), quantise(tail, levels)
    table = level_table(levels).to(top.device)
    stored = normalised(table[values.long()], table[tail_level.long()])
    kept = torch.ones_like(ids, dtype=torch.bool)
    return ({"ids": ids, "values": values, "tail": tail_level,
             "mass": p.sum(-1).float(), "kept": kept.sum(-1), "stored_mass": stored.exp().sum(-1),
             "quant_kl": quantisation_kl(top.double(), tail, stored.double()).float()}, (top, stored, kept))


def quantisation_kl(exact: torch.Tensor, tail: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """Per row, KL(exact top-k || stored top-k), both rebuilt by the uniform tail: ``exact`` and
    ``stored`` the kept log-probabilities ``[R, K]``, ``tail`` the exact tail mass ``[R]``. The
    tail's spread over the other classes is the same on both sides, so it reduces to one term."""
    p = exact.exp()
    stored_tail = (1.0 - stored.exp().sum(-1)).clamp(min=1e-300)
    tail_term = torch.where(tail > 0, tail * (torch.log(tail.clamp(min=1e-300)) - torch.log(stored_tail)),
                            torch.zeros_like(tail))
    return ((p * (exact - stored)).sum(-1) + tail_term).clamp(min=0)


def decode_levels(stored: np.ndarray, levels: int) -> torch.Tensor:
    """Stored levels (uint8, any shape) -> ``log q(l)`` (float32, not yet normalised)."""
    return level_table(levels)[torch.from_numpy(np.ascontiguousarray(stored).astype(np.int64))]


def params(k: int, levels: int) -> dict[str, Any]:
    """What the manifest records beside each part of a ``topkq`` output: how to read it back,
    and the mean KL the quantisation is expected to cost (the measured one is in the statistics)."""
    return {"representation": "sqrt-probability levels", "levels": levels,
            "ids": "sorted ascending per row (real class ids)",
            "level_value": f"q(l) = (l / {levels})**2, q(0) = 1 / (12 * {levels}**2)",
            "reconstruction": "log p_i = log q(values_i) - log Z, Z = sum_i q(values_i) + q(tail); "
                              "the mass q(tail) / Z spread evenly over the classes not kept",
            "expected_quant_kl": (k + 1) / (6.0 * levels * levels)}
