"""The codecs' fast paths (all-finite batches) give the same answers as the general paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from featstore import CorruptChunk, InvalidInput, NonFiniteOutput
from featstore.codecs import _dense as C
from featstore.format import _arrays as F
from featstore.format import _shard_decoder as D
from featstore.codecs import _statistics as S
def _slow_stats(x: torch.Tensor) -> dict:
    x = x.to(torch.float64)
    f = x[torch.isfinite(x)]
    return {"count": x.numel(), "nan": int(torch.isnan(x).sum()), "min": float(f.min()), "max": float(f.max()),
            "sum": float(f.sum())}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_value_stats_fast_path_matches_float64(dtype):
    x = (torch.randn(64, 33, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    got, want = S.value_stats(x), _slow_stats(x)
    assert (got["count"], got["nan"], got["inf"]) == (want["count"], 0, 0)
    assert got["min"] == want["min"] and got["max"] == want["max"]
    assert got["sum"] == pytest.approx(want["sum"], rel=1e-12, abs=1e-9)


def test_value_stats_with_nonfinite_uses_general_path():
    x = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    s = S.value_stats(x)
    assert (s["nan"], s["inf"], s["min"], s["max"], s["finite"]) == (1, 1, -2.0, 1.0, 2)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_max_abs_error_matches_float64(name):
    codec = C.output_codec(name)
    x = torch.randn(128, 40, generator=torch.Generator().manual_seed(1)) * torch.logspace(-6, 4, 40)
    stored = codec.encode(x)
    want = float((codec.decode(stored).to(torch.float64) - x.to(torch.float64)).abs().max())
    assert S.max_abs_error(codec, stored, x) == want


def test_max_abs_error_ignores_nonfinite():
    codec = C.output_codec("float16")
    x = torch.tensor([[1.1, float("nan")], [float("inf"), 2.2]])
    stored = codec.encode(x)
    a, b = float(np.float32(1.1)), float(np.float32(2.2))
    assert S.max_abs_error(codec, stored, x) == pytest.approx(
        max(abs(float(np.float16(a)) - a), abs(float(np.float16(b)) - b)), rel=1e-9)


def test_float16_overflow_still_raises_and_inf_input_does_not():
    codec = C.output_codec("float16")
    with pytest.raises(NonFiniteOutput):
        codec.encode(torch.tensor([1.0, 1e6]))
    assert np.isinf(codec.encode(torch.tensor([1.0, float("inf")]))[1])


def _sharded(tmp_path, shape, dtype, chunk_rows=16, shard_rows=48, compression="zstd"):
    import zarr

    g = zarr.open_group(str(tmp_path / "g"), mode="w")
    a = g.create_array("x", shape=shape, dtype=dtype, chunks=(chunk_rows, *shape[1:]),
                       shards=(shard_rows, *shape[1:]), compressors=F.zarr_codecs(compression), fill_value=0,
                       config={"write_empty_chunks": True})
    rng = np.random.default_rng(0)
    data = (rng.standard_normal(shape) * 10).astype(dtype)
    a[:] = data
    return a, data, tmp_path / "g" / "x"


def _shard_bytes(root, shard, ndim):
    return (root / "c" / str(shard) / "/".join(["0"] * (ndim - 1))).read_bytes() if ndim > 1 else \
        (root / "c" / str(shard)).read_bytes()


@pytest.mark.parametrize("compression", ["zstd", "none"])
@pytest.mark.parametrize("shape,dtype", [((130, 5), "float16"), ((130,), "int64"), ((130, 3, 2), "float32"),
                                         ((130, 4), "uint16")])
def test_decode_shard_rows_matches_zarr(tmp_path, shape, dtype, compression):
    a, data, root = _sharded(tmp_path, shape, dtype, compression=compression)
    fmt = D.shard_format(a)
    assert fmt is not None and fmt.chunks_per_shard == 3 and fmt.compressed == (compression == "zstd")
    rng = np.random.default_rng(1)
    for shard in range(3):
        raw = _shard_bytes(root, shard, len(shape))
        rows = min(48, shape[0] - 48 * shard)
        for _ in range(10):
            lo = int(rng.integers(0, rows))
            hi = int(rng.integers(lo + 1, rows + 1))
            got = D.decode_shard_rows(raw, fmt, lo, hi)
            np.testing.assert_array_equal(got, data[48 * shard + lo:48 * shard + hi])
            assert got.flags.writeable
        out = np.empty((rows, *shape[1:]), dtype=dtype)
        D.decode_shard_rows(raw, fmt, 0, rows, out)
        np.testing.assert_array_equal(out, data[48 * shard:48 * shard + rows])


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_decode_shard_rows_detects_damage(tmp_path, compression):
    a, _, root = _sharded(tmp_path, (96, 5), "float32", compression=compression)
    fmt = D.shard_format(a)
    raw = bytearray(_shard_bytes(root, 0, 2))
    for pos in (3, len(raw) // 2, len(raw) - 10):  # a chunk body, the middle, the index
        bad = bytearray(raw)
        bad[pos] ^= 0x40
        with pytest.raises(CorruptChunk):
            D.decode_shard_rows(bytes(bad), fmt, 0, 48)
    with pytest.raises(CorruptChunk):
        D.decode_shard_rows(bytes(raw[:20]), fmt, 0, 48)


def test_shard_format_refuses_other_layouts(tmp_path):
    import zarr

    g = zarr.open_group(str(tmp_path / "o"), mode="w")
    plain = g.create_array("p", shape=(10, 2), dtype="float32", chunks=(5, 2))
    assert D.shard_format(plain) is None


def test_auto_compression_keeps_zstd_only_where_it_pays():
    rng = np.random.default_rng(0)
    relu = np.maximum(rng.standard_normal((64, 512)), 0).astype(np.float16)  # half zeros
    logits = rng.standard_normal((64, 1000)).astype(np.float32)  # random mantissas
    labels = rng.integers(0, 10, 64)
    assert F.zstd_saving(relu) > 0.3 and F.zstd_saving(logits) < F.AUTO_MIN_SAVING
    assert [F.choose_compression("auto", F.zstd_saving(x)) for x in (relu, logits, labels)] == \
        ["zstd", "none", "zstd"]
    assert F.choose_compression("zstd", 0.0) == "zstd" and F.choose_compression("none", 0.9) == "none"
    # a local store weighs CPU over bytes: fp16 features (~40% saved) stay raw, labels do not
    assert [F.choose_compression("auto", F.zstd_saving(x), local=True) for x in (relu, logits, labels)] == \
        ["none", "none", "zstd"]
    with pytest.raises(InvalidInput, match="compression must be one of"):
        F.choose_compression("lz4", 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("seed", range(4))
def test_finite_rows_matches_the_elementwise_check(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(50, 7, 3, generator=g) * 10).to(dtype)
    flat = x.reshape(50, -1)
    for kind in (float("nan"), float("inf"), -float("inf")):
        rows = torch.randint(0, 50, (3,), generator=g)
        flat[rows, torch.randint(0, 21, (3,), generator=g)] = kind
    flat[7] = torch.finfo(dtype).max  # finite values whose sum overflows: still a finite row
    want = torch.isfinite(x).reshape(50, -1).all(dim=1)
    assert torch.equal(C.finite_rows(x), want)


def test_finite_rows_of_empty_scalar_and_integer_tensors():
    assert C.finite_rows(torch.zeros(0, 4)).tolist() == []
    assert C.finite_rows(torch.tensor(float("nan"))).tolist() == [False]
    assert C.finite_rows(torch.arange(3)).tolist() == [True, True, True]
