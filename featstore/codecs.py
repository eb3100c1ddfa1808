"""Output codecs: how a tensor Model A produced becomes a stored Zarr array, and back.

Pure functions, no IO. Each codec stores a standard Zarr dtype, so plain ``zarr`` and ``xarray``
can read a version (``bfloat16`` is stored as its raw 16 bits in ``uint16``, since Zarr 3.1 has
no bfloat16). Compression (zstd, or none where zstd saves little: see :func:`choose_compression`) and
integrity (crc32c per chunk) are added by the Zarr codec chain in :func:`zarr_codecs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from zarr.codecs import Crc32cCodec, ZstdCodec

from .errors import InvalidInput, NonFiniteOutput

ZSTD_LEVEL = 3
COMPRESSIONS = ("auto", "zstd", "none")
# "auto" stores an array with zstd only where zstd saves at least this share of its bytes on the
# probe batch: near-incompressible float32 (logits) decodes ~10x slower through zstd than as a
# plain copy, and the reader's decode competes with Model B for the same cores.
AUTO_MIN_SAVING = 0.10


@dataclass(frozen=True)
class Codec:
    """How one output is stored: the stored numpy dtype and the torch dtype it decodes to."""

    name: str
    stored: str  # numpy dtype string written to zarr
    torch_dtype: torch.dtype
    lossy: bool

    def encode(self, values: torch.Tensor) -> np.ndarray:
        """Turn A's output (any float dtype, any device) into the stored numpy array.

        Raises :class:`NonFiniteOutput` when finite values overflow the stored type (float16
        holds at most 65504): silently storing ``inf`` would change the user's data.
        """
        x = values.detach()
        out = self.cast(x)
        if self.lossy:
            # Fast path: a cast only produces inf from finite values, so the usual all-finite
            # result needs one pass over the small stored array, not two float tensors.
            stored = decode_np(self, out)
            if not bool(torch.isinf(stored).any()):
                return out
            overflow = torch.isinf(stored) & torch.isfinite(x.to("cpu"))
            if bool(overflow.any()):
                raise NonFiniteOutput(
                    f"{int(overflow.sum())} finite values overflow {self.name} "
                    f"(largest |value| {float(x.abs().max()):.4g}); store this output as "
                    "'float32' or 'bfloat16' instead."
                )
        return out

    def cast(self, values: torch.Tensor) -> np.ndarray:
        """``values`` in the stored dtype, on the CPU, without :meth:`encode`'s overflow check."""
        x = values.detach()
        if self.name == "bfloat16":
            return x.to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
        return x.to("cpu", self.torch_dtype).contiguous().numpy()

    def decode(self, stored: np.ndarray) -> torch.Tensor:
        """The tensor a reader gets back (float16 stays float16: cast in Model B if needed)."""
        return decode_np(self, stored)


def decode_np(codec: Codec, stored: np.ndarray) -> torch.Tensor:
    """Stored numpy values -> torch tensor, without a copy where the dtype allows."""
    if codec.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(stored).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(stored))


OUTPUT_CODECS: dict[str, Codec] = {
    "float32": Codec("float32", "float32", torch.float32, lossy=False),
    "float16": Codec("float16", "float16", torch.float16, lossy=True),
    "bfloat16": Codec("bfloat16", "uint16", torch.bfloat16, lossy=True),
}

_KEEP_DTYPES = {
    torch.bool: "bool", torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16",
    torch.int32: "int32", torch.int64: "int64", torch.float16: "float16",
    torch.float32: "float32", torch.float64: "float64",
}


def output_codec(name: str) -> Codec:
    """Look up an output codec by name (``float32``, ``float16``, ``bfloat16``)."""
    try:
        return OUTPUT_CODECS[name]
    except KeyError:
        raise InvalidInput(
            f"unknown output codec {name!r}; choose one of {sorted(OUTPUT_CODECS)}."
        ) from None


def keep_codec(dtype: torch.dtype) -> Codec:
    """The lossless codec for a kept dataset field (labels, ids) of this torch dtype."""
    if dtype == torch.bfloat16:
        return OUTPUT_CODECS["bfloat16"]
    try:
        stored = _KEEP_DTYPES[dtype]
    except KeyError:
        raise InvalidInput(
            f"cannot store a kept field of dtype {dtype}; convert it to an integer or float tensor."
        ) from None
    return Codec(f"keep-{stored}", stored, dtype, lossy=False)


def codec_by_name(name: str) -> Codec:
    """Inverse of ``Codec.name`` for what a manifest records."""
    if name in OUTPUT_CODECS:
        return OUTPUT_CODECS[name]
    if name.startswith("keep-"):
        for dtype, stored in _KEEP_DTYPES.items():
            if stored == name[5:]:
                return keep_codec(dtype)
    raise InvalidInput(f"unknown codec {name!r} in a manifest; upgrade featstore.")


def zarr_codecs(compression: str = "zstd") -> list:
    """The bytes-to-bytes chain for every chunk: zstd (unless ``"none"``), then a crc32c checksum."""
    if compression not in ("zstd", "none"):
        raise InvalidInput(f"compression must be 'zstd' or 'none' here, got {compression!r}.")
    return [ZstdCodec(level=ZSTD_LEVEL), Crc32cCodec()] if compression == "zstd" else [Crc32cCodec()]


def check_compression(compression: str) -> str:
    """Validate a user's compression choice (``"auto"``, ``"zstd"`` or ``"none"``)."""
    if compression not in COMPRESSIONS:
        raise InvalidInput(f"compression must be one of {COMPRESSIONS}, got {compression!r}.")
    return compression


def zstd_saving(stored: np.ndarray) -> float:
    """The share of bytes zstd (featstore's level) saves on ``stored`` (0 for empty input)."""
    import numcodecs

    raw = np.ascontiguousarray(stored).tobytes()
    if not raw:
        return 0.0
    return 1.0 - len(numcodecs.Zstd(ZSTD_LEVEL).encode(raw)) / len(raw)


def choose_compression(policy: str, saving: float) -> str:
    """``policy`` resolved for one array whose probe batch zstd shrinks by ``saving``.

    >>> choose_compression("auto", 0.42), choose_compression("auto", 0.07)
    ('zstd', 'none')
    """
    if check_compression(policy) != "auto":
        return policy
    return "zstd" if saving >= AUTO_MIN_SAVING else "none"


def value_stats(values: torch.Tensor, all_finite: bool | None = None) -> dict[str, float]:
    """Sufficient statistics of a batch for the manifest (merged with :func:`merge_stats`).

    ``all_finite``: pass it when the caller already checked, to skip a second pass.
    """
    x = values.detach().to("cpu")
    if all_finite is None:
        all_finite = x.is_floating_point() and bool(torch.isfinite(x).all())
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
    if x.dtype == torch.float32 and bool(torch.isfinite(x).all()):
        # float16/bfloat16 -> float32 is exact and the difference of two float32 values close
        # to each other is exact too (Sterbenz), so float32 gives the float64 answer here.
        return float((dec.to(torch.float32) - x).abs().max()) if x.numel() else 0.0
    err = (dec.to(torch.float64) - x.to(torch.float64)).abs()
    err = err[torch.isfinite(err)]
    return float(err.max()) if err.numel() else 0.0


def merge_stats(a: dict | None, b: dict) -> dict:
    """Combine two :func:`value_stats` results."""
    if a is None:
        return dict(b)

    def pick(f, x, y):
        return y if x is None else x if y is None else f(x, y)

    return {
        "count": a["count"] + b["count"], "nan": a["nan"] + b["nan"], "inf": a["inf"] + b["inf"],
        "min": pick(min, a["min"], b["min"]), "max": pick(max, a["max"], b["max"]),
        "sum": a["sum"] + b["sum"], "finite": a["finite"] + b["finite"],
        **({"max_abs_error": max(a.get("max_abs_error", 0.0), b.get("max_abs_error", 0.0))}
           if "max_abs_error" in a or "max_abs_error" in b else {}),
        **({"nonfinite_samples": (a.get("nonfinite_samples", []) + b.get("nonfinite_samples", []))[:1000]}
           if "nonfinite_samples" in a or "nonfinite_samples" in b else {}),
    }


def finalize_stats(s: dict) -> dict:
    """Add the mean and drop the running sum."""
    out = {k: v for k, v in s.items() if k not in ("sum", "finite")}
    out["mean"] = s["sum"] / s["finite"] if s["finite"] else None
    return out


# ---------------------------------------------------------------------------------------------
# Reading a whole Zarr shard object without zarr's async pipeline (the reader's fast path).
# ---------------------------------------------------------------------------------------------
_EMPTY = np.uint64(2**64 - 1)


@dataclass(frozen=True)
class ShardFormat:
    """What the reader needs to decode one shard object of an array written by featstore.

    Only the exact codec chain :func:`zarr_codecs` writes inside a ``sharding_indexed`` codec
    (little-endian bytes, zstd or nothing, crc32c; index little-endian + crc32c at the end) qualifies; any
    other array is read through zarr.
    """

    chunk_rows: int
    row_shape: tuple[int, ...]
    dtype: str
    chunks_per_shard: int
    compressed: bool = True  # zstd before the crc32c; False: the chunk bytes are the values


def shard_format(array: "zarr.Array") -> ShardFormat | None:  # noqa: F821 - only inspected
    """The :class:`ShardFormat` of ``array``, or None when it is not featstore's exact layout."""
    try:
        from zarr.codecs import BytesCodec, ShardingCodec
        from zarr.codecs.sharding import ShardingCodecIndexLocation

        codecs = array.metadata.codecs
        if len(codecs) != 1 or not isinstance(codecs[0], ShardingCodec):
            return None
        sc = codecs[0]
        inner, index = sc.codecs, sc.index_codecs
        little = "little"
        compressed = len(inner) == 3
        ok = (len(inner) in (2, 3) and isinstance(inner[0], BytesCodec)
              and str(getattr(inner[0].endian, "value", "")) == little
              and (not compressed or isinstance(inner[1], ZstdCodec)) and isinstance(inner[-1], Crc32cCodec)
              and len(index) == 2 and isinstance(index[0], BytesCodec)
              and str(getattr(index[0].endian, "value", "")) == little and isinstance(index[1], Crc32cCodec)
              and sc.index_location == ShardingCodecIndexLocation.end
              and tuple(sc.chunk_shape[1:]) == tuple(array.shape[1:]))
        if not ok:
            return None
        dtype = np.dtype(array.dtype)
        if dtype.byteorder == ">":
            return None
        shard_rows = int(array.metadata.chunk_grid.chunk_shape[0])
        if shard_rows % int(sc.chunk_shape[0]):
            return None
        return ShardFormat(int(sc.chunk_shape[0]), tuple(int(s) for s in array.shape[1:]), dtype.str,
                           shard_rows // int(sc.chunk_shape[0]), compressed)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None


class ShardCorrupt(ValueError):
    """A shard object's bytes do not decode (bad checksum, truncated, bad zstd frame)."""


def _check_crc(data: memoryview, what: str) -> memoryview:
    import crc32c

    if len(data) < 4:
        raise ShardCorrupt(f"{what} is truncated ({len(data)} bytes)")
    body, tail = data[:-4], data[-4:]
    if crc32c.crc32c(body) != int.from_bytes(tail, "little"):
        raise ShardCorrupt(f"{what} fails its crc32c checksum")
    return body


def decode_shard_rows(data: bytes, fmt: ShardFormat, lo: int, hi: int,
                      out: np.ndarray | None = None) -> np.ndarray:
    """Rows ``[lo, hi)`` (shard-local) of one shard object, written into ``out`` when given
    (``hi - lo`` rows of the stored dtype: saves the reader a copy) and returned.

    Decodes only the inner chunks that cover the rows, checks every crc32c, and raises
    :class:`ShardCorrupt` on any damage (never returns fill values for a missing chunk).
    """
    import numcodecs

    view = memoryview(data)
    n_chunks = fmt.chunks_per_shard
    index_bytes = 16 * n_chunks + 4
    if len(view) < index_bytes:
        raise ShardCorrupt(f"shard object is truncated ({len(view)} bytes, index needs {index_bytes})")
    index = np.frombuffer(_check_crc(view[-index_bytes:], "shard index"), dtype="<u8").reshape(n_chunks, 2)
    dtype = np.dtype(fmt.dtype)
    row_items = int(np.prod(fmt.row_shape, dtype=np.int64)) if fmt.row_shape else 1
    zstd = numcodecs.Zstd()
    c0, c1 = lo // fmt.chunk_rows, -(-hi // fmt.chunk_rows)
    if out is None:
        out = np.empty((hi - lo, *fmt.row_shape), dtype=dtype.newbyteorder("="))
    elif out.shape != (hi - lo, *fmt.row_shape):
        raise ValueError(f"out has shape {out.shape}, expected {(hi - lo, *fmt.row_shape)}")
    for c in range(c0, c1):
        off, size = index[c]
        if off == _EMPTY or int(off) + int(size) > len(view) - index_bytes:
            raise ShardCorrupt(f"chunk {c} of the shard is missing or out of bounds")
        body = _check_crc(view[int(off):int(off) + int(size)], f"chunk {c}")
        if fmt.compressed:
            try:
                raw = zstd.decode(body)
            except Exception as exc:  # noqa: BLE001 - numcodecs raises plain errors on bad frames
                raise ShardCorrupt(f"chunk {c} does not decompress: {exc}") from exc
        else:
            raw = body  # the values themselves: copied once, straight into ``out``
        if len(raw) % dtype.itemsize:
            raise ShardCorrupt(f"chunk {c} holds {len(raw)} bytes, not a whole number of values")
        arr = np.frombuffer(raw, dtype=dtype)
        if arr.size != fmt.chunk_rows * row_items:
            raise ShardCorrupt(f"chunk {c} holds {arr.size} values, expected {fmt.chunk_rows * row_items}")
        r0 = max(lo - c * fmt.chunk_rows, 0)
        r1 = min(hi - c * fmt.chunk_rows, fmt.chunk_rows)
        o0 = c * fmt.chunk_rows + r0 - lo
        out[o0:o0 + r1 - r0] = arr.reshape(fmt.chunk_rows, *fmt.row_shape)[r0:r1]
    return out
