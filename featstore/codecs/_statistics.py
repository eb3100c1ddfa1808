"""Statistics of stored values for the manifest (NaN/Inf counts, ranges, mean, codec error): pure.

A shard task computes :func:`value_stats` per batch and merges them (:func:`merge_stats`); the
driver merges the shards' and finalises (:func:`finalize_stats`). Everything is a small dict of
JSON numbers, so it travels in receipts and manifests as is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any


from featstore.codecs._dense import Codec, finite_rows
from featstore.codecs._parts import finalize_error, merge_error
from featstore._lazy import np, torch  # imported on first use: the quick commands never need them


#: Sample ids with NaN/Inf recorded per output.
NONFINITE_KEPT = 1000


def value_stats(values: torch.Tensor, all_finite: bool | None = None) -> dict[str, float | None]:
    """Sufficient statistics of a batch for the manifest (merged with :func:`merge_stats`).

    ``all_finite``: pass it when the caller already checked, to skip a second pass.

    >>> value_stats(torch.tensor([1.0, 3.0]))["max"]
    3.0
    """
    x = values.detach().to("cpu")
    if all_finite is None:
        all_finite = x.is_floating_point() and bool(finite_rows(x).all())
    if x.is_floating_point() and x.numel() and all_finite:
        # Fast path (the usual batch): no NaN/Inf, so no float64 copy and no masked copy; min
        # and max are exact in the native dtype and the sum is accumulated in float64.
        lo, hi = torch.aminmax(x)
        return {"count": int(x.numel()), "nan": 0, "inf": 0, "min": float(lo), "max": float(hi),
                "sum": float(x.sum(dtype=torch.float64)), "finite": int(x.numel())}
    x = x.to(torch.float64)
    finite = torch.isfinite(x)
    nan = int(torch.isnan(x).sum())
    inf = int(x.numel() - int(finite.sum()) - nan)
    fx = x[finite]
    return {
        "count": int(x.numel()),
        "nan": nan,
        "inf": inf,
        "min": float(fx.min()) if fx.numel() else None,
        "max": float(fx.max()) if fx.numel() else None,
        "sum": float(fx.sum()),
        "finite": int(fx.numel()),
    }


def max_abs_error(codec: Codec, stored: np.ndarray, values: torch.Tensor) -> float:
    """Largest |decoded - original| over the finite values: the error a lossy codec introduced."""
    x = values.detach().to("cpu")
    dec = codec.decode(stored)
    if x.dtype == torch.float32 and bool(finite_rows(x).all()):
        # float16/bfloat16 -> float32 is exact and the difference of two float32 values close
        # to each other is exact too (Sterbenz), so float32 gives the float64 answer here.
        return float((dec.to(torch.float32) - x).abs().max()) if x.numel() else 0.0
    err = (dec.to(torch.float64) - x.to(torch.float64)).abs()
    err = err[torch.isfinite(err)]
    return float(err.max()) if err.numel() else 0.0


def merge_stats(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Combine two :func:`value_stats` results."""
    if a is None:
        return dict(b)

    def pick(f: Callable[[float, float], float], x: float | None, y: float | None) -> float | None:
        return y if x is None else x if y is None else f(x, y)

    return {
        "count": a["count"] + b["count"], "nan": a["nan"] + b["nan"], "inf": a["inf"] + b["inf"],
        "min": pick(min, a["min"], b["min"]), "max": pick(max, a["max"], b["max"]),
        "sum": a["sum"] + b["sum"], "finite": a["finite"] + b["finite"],
        **({"max_abs_error": max(a.get("max_abs_error", 0.0), b.get("max_abs_error", 0.0))}
           if "max_abs_error" in a or "max_abs_error" in b else {}),
        **({"codec_error": merge_error(a.get("codec_error"), b["codec_error"])} if "codec_error" in b else {}),
        **({"nonfinite_samples": (a.get("nonfinite_samples", []) + b.get("nonfinite_samples", []))[:NONFINITE_KEPT]}
           if "nonfinite_samples" in a or "nonfinite_samples" in b else {}),
    }


def finalize_stats(s: dict[str, Any]) -> dict[str, Any]:
    """Add the mean and drop the running sum."""
    out = {k: v for k, v in s.items() if k not in ("sum", "finite")}
    out["mean"] = s["sum"] / s["finite"] if s["finite"] else None
    if "codec_error" in s:
        out["codec_error"] = finalize_error(s["codec_error"])
    return out


def summarize(per_shard: Iterable[Mapping[str, dict[str, Any]]], arrays: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The manifest's statistics: every shard's statistics of each array, merged and finalised."""
    merged: dict[str, dict[str, Any] | None] = {a: None for a in arrays}
    for stats in per_shard:
        for a in merged:
            merged[a] = merge_stats(merged[a], stats[a])
    return {a: finalize_stats(s) for a, s in merged.items() if s is not None}
