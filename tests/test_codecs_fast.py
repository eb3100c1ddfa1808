"""The codecs' fast paths (all-finite batches) give the same answers as the general paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from featstore import NonFiniteOutput
from featstore import codecs as C


def _slow_stats(x: torch.Tensor) -> dict:
    x = x.to(torch.float64)
    f = x[torch.isfinite(x)]
    return {"count": x.numel(), "nan": int(torch.isnan(x).sum()), "min": float(f.min()), "max": float(f.max()),
            "sum": float(f.sum())}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_value_stats_fast_path_matches_float64(dtype):
    x = (torch.randn(64, 33, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    got, want = C.value_stats(x), _slow_stats(x)
    assert (got["count"], got["nan"], got["inf"]) == (want["count"], 0, 0)
    assert got["min"] == want["min"] and got["max"] == want["max"]
    assert got["sum"] == pytest.approx(want["sum"], rel=1e-12, abs=1e-9)


def test_value_stats_with_nonfinite_uses_general_path():
    x = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    s = C.value_stats(x)
    assert (s["nan"], s["inf"], s["min"], s["max"], s["finite"]) == (1, 1, -2.0, 1.0, 2)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_max_abs_error_matches_float64(name):
    codec = C.output_codec(name)
    x = torch.randn(128, 40, generator=torch.Generator().manual_seed(1)) * torch.logspace(-6, 4, 40)
    stored = codec.encode(x)
    want = float((codec.decode(stored).to(torch.float64) - x.to(torch.float64)).abs().max())
    assert C.max_abs_error(codec, stored, x) == want


def test_max_abs_error_ignores_nonfinite():
    codec = C.output_codec("float16")
    x = torch.tensor([[1.1, float("nan")], [float("inf"), 2.2]])
    stored = codec.encode(x)
    a, b = float(np.float32(1.1)), float(np.float32(2.2))
    assert C.max_abs_error(codec, stored, x) == pytest.approx(
        max(abs(float(np.float16(a)) - a), abs(float(np.float16(b)) - b)), rel=1e-9)


def test_float16_overflow_still_raises_and_inf_input_does_not():
    codec = C.output_codec("float16")
    with pytest.raises(NonFiniteOutput):
        codec.encode(torch.tensor([1.0, 1e6]))
    assert np.isinf(codec.encode(torch.tensor([1.0, float("inf")]))[1])
