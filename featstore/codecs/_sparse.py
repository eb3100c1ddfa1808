"""The arithmetic of the parts codecs, pure torch: which classes a sparse soft label keeps
(``topk``, ``topp``, ``sample``), how they are stored (ids, float16 log-probabilities,
counts), the reconstruction's weights (the uniform tail, renormalised, counts), the fidelity
diagnostics a manifest records (KL, kept mass), and ``int8``'s per-sample absmax encoding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


from featstore.errors import InvalidInput, NonFiniteOutput, OutputMismatch
from featstore._lazy import np, torch  # imported on first use: the quick commands never need them




PAD_ID = -1
#: Seed of ``sample:S``'s draws (with the sample index): fixed, so a recompute draws the same ids.
SAMPLE_SEED = 0x5EED
#: float16 keeps log-probabilities down to -65504; anything below is probability 0 anyway.
_FP16_MIN = -65504.0  # float(np.finfo(np.float16).min), written out: numpy is imported lazily
HIST_BINS = 10
#: Rows of each encoded batch whose KL to the teacher the manifest's codec error records (all
#: of an image batch; a sample of a language model's per-token rows).
KL_ROWS = 256

def fp16_logp(vals: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Kept log-probabilities as float16 (below -65504 is probability 0 anyway), padding -inf."""
    return torch.where(ids >= 0, vals.clamp(min=_FP16_MIN), -math.inf).to(torch.float16)


def ids_dtype(classes: int, output: str = "output") -> str:
    """The narrowest unsigned dtype whose largest value (the padding sentinel) is not a class id."""
    if classes < 2**16:
        return "uint16"
    if classes < 2**32:
        return "uint32"
    raise InvalidInput(f"{output!r} has {classes} classes; class ids must fit uint32.")


def store_ids(ids: torch.Tensor, dtype: str) -> np.ndarray:
    sentinel = np.iinfo(dtype).max
    out = ids.numpy()
    if out.size and int(out.max()) >= sentinel:  # the codec chose the dtype: this is a bug guard
        raise InvalidInput(f"class id {int(out.max())} does not fit {dtype}; report this as a bug.")
    return np.where(out < 0, sentinel, out).astype(dtype)


def top_p(logp: torch.Tensor, p: float, min_k: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest prefix of each row's classes (by probability) reaching mass ``p``, at least
    ``min_k`` and at most ``cap`` long; slots past it padded with id -1 and value -inf."""
    vals, ids = torch.topk(logp, cap, dim=-1)
    mass = torch.cumsum(vals.exp(), dim=-1)
    # entries needed: 1 + the number of prefixes whose mass is still below p
    need = 1 + (mass < p).sum(dim=-1)
    keep = need.clamp(min=min_k, max=cap)
    slot = torch.arange(cap).expand_as(vals)
    pad = slot >= keep[:, None]
    return vals.masked_fill(pad, -math.inf), ids.masked_fill(pad, PAD_ID)


def sample_ids(logp: torch.Tensor, s: int, row_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``s`` draws per row from ``exp(logp)``, seeded by each row's global id: unique ids (sorted,
    padded with -1) and their counts."""
    u = torch.from_numpy(_uniforms(row_ids, s)).to(logp.device)
    cdf = torch.cumsum(logp.double().exp(), dim=-1)
    cdf = cdf / cdf[:, -1:]
    drawn = torch.searchsorted(cdf, u, right=True).clamp(max=logp.shape[-1] - 1)
    drawn, _ = torch.sort(drawn, dim=-1)
    new = torch.ones_like(drawn, dtype=torch.bool)
    new[:, 1:] = drawn[:, 1:] != drawn[:, :-1]
    pos = torch.cumsum(new, dim=-1) - 1
    ids = torch.full_like(drawn, PAD_ID).scatter_(1, pos, drawn)
    counts = torch.zeros_like(drawn).scatter_add_(1, pos, torch.ones_like(drawn))
    return ids, counts


def _uniforms(row_ids: np.ndarray, s: int) -> np.ndarray:
    """``s`` uniforms in [0, 1) per row, a pure function of (SAMPLE_SEED, row id, draw): a
    splitmix64 hash of a counter, so a sample draws the same ids in any batch, task or order."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
        z = (row_ids.astype(np.uint64)[:, None] * np.uint64(s) + np.arange(s, dtype=np.uint64)[None, :]
             + np.uint64(SAMPLE_SEED) * np.uint64(0x9E3779B97F4A7C15))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


def encode_int8(x: torch.Tensor) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    flat = x.reshape(x.shape[0], -1)
    scale = flat.abs().amax(dim=1) / 127.0 if flat.shape[1] else torch.zeros(x.shape[0])
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(flat / safe[:, None]).clamp(-127, 127).to(torch.int8)
    err = (q.float() * scale[:, None] - flat).abs()
    stats = {"rows": int(x.shape[0]), "max_abs_error_max": float(err.max()) if err.numel() else 0.0,
             "rel_error_max": float((err.amax(dim=1) / safe).max() / 127.0) if err.numel() else 0.0}
    return {"": q.reshape(x.shape).numpy(), "scale": scale.numpy()}, stats


def check_finite(codec: Any, finite: torch.Tensor, first_sample: int, output: str) -> None:
    bad = ~finite
    if bool(bad.any()):
        rows = (torch.nonzero(bad).reshape(-1) + first_sample).tolist()
        raise NonFiniteOutput(
            f"Model A produced NaN/Inf in {output!r} for {len(rows)} samples (first: {rows[:10]}), or values "
            f"beyond float32's range (~3.4e38, in which {codec.name} computes); {codec.name} cannot rank or "
            "quantise them (allow_nonfinite does not apply). Fix the model or data, or store this output as "
            "'float32'.")


#: The per-row diagnostics a sparse codec's device half hands its host half (besides the parts).
DIAGNOSTICS = ("finite", "classes", "mass", "kept", "stored_mass", "kl", "quant_kl")


def sparse_diagnostics(logp: torch.Tensor, ids: torch.Tensor, vals: torch.Tensor,
                        rule: str) -> dict[str, torch.Tensor]:
    """Per row: the teacher mass kept, the entries kept, the stored (float16) mass kept, and for
    top-k/top-p the KL of the reconstruction to the teacher on the first :data:`KL_ROWS` rows."""
    kept = ids >= 0
    stored = fp16_logp(vals, ids).float()
    out = {"mass": torch.exp(torch.gather(logp, 1, ids.clamp(min=0))).masked_fill(~kept, 0).sum(dim=-1),
           "kept": kept.sum(dim=-1), "stored_mass": stored.exp().sum(dim=-1)}
    if rule != "counts":  # a sample's rows are unbiased on average, not close one by one: no per-row KL
        # on the first KL_ROWS rows of each batch: the KL needs two more passes over every class
        # of a row, which for a language model's per-token rows would cost more than the codec
        n = min(len(logp), KL_ROWS)
        out["kl"] = uniform_tail_kl(logp[:n], torch.gather(logp[:n], 1, ids[:n].clamp(min=0)), stored[:n], kept[:n])
    return out


def check_given_rows(ids: torch.Tensor, logp: torch.Tensor, classes: int, output: str) -> None:
    """Refuse top-k rows an engine returned that are not a distribution's top k: ids outside
    the classes, or values whose probabilities sum past 1 (raw logits, not log-probabilities)."""
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= classes):
        raise OutputMismatch(f"{output!r}: the teacher returned class ids in [{int(ids.min())}, {int(ids.max())}], "
                             f"outside its {classes} classes.")
    mass = logp.double().exp().sum(-1)
    if len(mass) and float(mass.max()) > 1.0 + 1e-3:
        raise OutputMismatch(f"{output!r}: the teacher's top-k probabilities sum to {float(mass.max()):.4f} on a "
                             "row; a TopK holds normalised log-probabilities (log_softmax), not raw logits.")


def sparse_error(d: Mapping[str, torch.Tensor], rule: str) -> dict[str, Any]:
    """Per-batch error statistics from the per-row diagnostics: mass kept, entries kept, KL."""
    mass, n_kept = d["mass"], d["kept"]
    if not len(mass):  # a batch of token sequences without a single real token
        return {"rows": 0}
    hist = np.histogram(mass.numpy(), bins=HIST_BINS, range=(0.0, 1.0))[0]
    out = {"rows": int(len(mass)), "mass_min": float(mass.min()), "mass_sum": float(mass.sum()),
           "mass_hist": hist.tolist(), "kept_sum": int(n_kept.sum()), "kept_max": int(n_kept.max()),
           "stored_mass_sum": float(d["stored_mass"].sum())}
    if "kl" in d:
        kl = d["kl"]
        out.update(kl_sum=float(kl.sum()), kl_max=float(kl.max()), kl_rows=int(len(kl)))
    if "quant_kl" in d:  # topkq: KL of the exact top-k to the stored one, every row
        q = d["quant_kl"]
        out.update(quant_kl_sum=float(q.sum()), quant_kl_max=float(q.max()))
    return out


def uniform_tail_kl(logp: torch.Tensor, true_kept: torch.Tensor, stored: torch.Tensor,
                     kept: torch.Tensor) -> torch.Tensor:
    """Per row, KL(teacher || its uniform-tail reconstruction from the stored float16 values),
    in closed form (no dense reconstruction): kept classes compare true and stored log-probs,
    the rest of the mass is compared with the uniform tail."""
    p_true = true_kept.exp().masked_fill(~kept, 0)
    kept_term = (p_true * (true_kept - stored).masked_fill(~kept, 0)).sum(-1)
    rest_plogp = (logp.exp() * logp).sum(-1) - (p_true * true_kept.masked_fill(~kept, 0)).sum(-1)
    rest_mass = (1.0 - p_true.sum(-1)).clamp(min=0)
    tail = (1.0 - stored.exp().sum(-1)).clamp(min=0) / (logp.shape[-1] - kept.sum(-1)).clamp(min=1)
    return (kept_term + rest_plogp - rest_mass * torch.log(tail.clamp(min=1e-30))).clamp(min=0)


RULES = ("uniform_tail", "renormalize", "counts")


def sparse_weights(ids: torch.Tensor, logp: torch.Tensor, counts: torch.Tensor | None, classes: int,
                   rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The one home of the reconstruction rules: for sparse rows ``[rows, slots]`` (ids -1 in
    unused slots), the teacher probability of each slot (0 in unused ones) and the probability
    of each class that was not kept, ``[rows]``.

    ``uniform_tail``: the kept probabilities as stored, the missing mass ``1 - sum`` spread evenly
    over the other classes; ``renormalize``: the kept probabilities scaled to sum to 1, no tail;
    ``counts`` (sample): ``counts / sum(counts)`` on the drawn ids, no tail (unbiased on average).
    """
    kept = ids >= 0
    none = torch.zeros(ids.shape[0])
    if rule == "counts":
        if counts is None:
            raise InvalidInput("the 'counts' rule needs the counts of a sample:S output.")
        w = counts.float() * kept
        return w / w.sum(dim=-1, keepdim=True).clamp(min=1), none
    if rule not in RULES:
        raise InvalidInput(f"unknown reconstruction rule {rule!r}; use one of {RULES}.")
    p = logp.float().exp().masked_fill(~kept, 0)
    if rule == "renormalize":
        return p / p.sum(dim=-1, keepdim=True).clamp(min=1e-30), none
    return p, (1.0 - p.sum(dim=-1)).clamp(min=0) / (classes - kept.sum(dim=-1)).clamp(min=1)


def reconstruct(ids: torch.Tensor, logp: torch.Tensor, counts: torch.Tensor | None, classes: int,
                rule: str) -> torch.Tensor:
    """The dense distribution ``[rows, classes]`` (float32) ``rule`` rebuilds from sparse rows
    (see :func:`sparse_weights`)."""
    w, tail = sparse_weights(ids, logp, counts, classes, rule)
    kept = ids >= 0
    dense = tail[:, None].repeat(1, classes)
    rows = torch.arange(ids.shape[0])[:, None].expand_as(ids)
    dense[rows[kept], ids[kept]] = w[kept]
    return dense
