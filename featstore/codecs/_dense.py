"""Value codecs: how a tensor Model A produced becomes the stored values, and back.

Pure functions, no IO. Each codec stores a standard Zarr dtype, so plain ``zarr`` and ``xarray``
can read a version (``bfloat16`` is stored as its raw 16 bits in ``uint16``, since Zarr 3.1 has
no bfloat16). How those values become Zarr chunks (compression, checksums, shards) is
:mod:`featstore.format`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass


from featstore.errors import InvalidInput, NonFiniteOutput
from featstore._lazy import np, torch  # imported on first use: the quick commands never need them


@dataclass(frozen=True)
class Codec:
    """How one output is stored: the stored numpy dtype and the torch dtype it decodes to."""

    name: str
    stored: str  # numpy dtype string written to zarr
    dtype_name: str  # the torch dtype it decodes to, by name (torch is imported when first used)
    lossy: bool

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype a reader gets back."""
        dtype: torch.dtype = getattr(torch, self.dtype_name)
        return dtype

    def encode(self, values: torch.Tensor) -> np.ndarray:
        """Turn A's output (any float dtype, any device) into the stored numpy array.

        Raises :class:`NonFiniteOutput` when finite values cannot be represented in the stored
        type (they overflow it: float16 holds at most 65504, float32 and bfloat16 about 3.4e38):
        silently storing ``inf`` would change the user's data. :meth:`store` returns the rows
        instead of raising.
        """
        out, lost = self.store(values)
        if lost is not None:
            raise NonFiniteOutput(unrepresentable(self, "output", torch.nonzero(lost).reshape(-1).tolist(),
                                                  largest_finite(values)))
        return out

    def store(self, values: torch.Tensor) -> tuple[np.ndarray, torch.Tensor | None]:
        """The stored array, and per row (axis 0) whether the cast turned a finite value into
        inf or NaN (None when no row lost one; always None without a cast: float32 outputs of a
        float32 codec are stored bit for bit)."""
        x = values.detach()
        out = self.cast(x)
        if x.dtype == self.torch_dtype or not x.numel():
            return out, None
        # Fast path: a cast only makes inf/NaN from finite values in rows whose stored values are
        # not all finite, so the usual result needs one pass over the small stored array.
        stored = decode_np(self, out)
        bad = ~finite_rows(stored)
        if not bool(bad.any()):
            return out, None
        rows = len(stored) if stored.dim() else 1
        src = x.to("cpu").reshape(rows, -1)[bad]
        lost = torch.zeros(rows, dtype=torch.bool)
        lost[bad] = (~torch.isfinite(stored.reshape(rows, -1)[bad]) & torch.isfinite(src)).any(dim=1)
        return out, (lost if bool(lost.any()) else None)

    @property
    def largest(self) -> float:
        """The largest finite magnitude the stored type holds."""
        return float(torch.finfo(self.torch_dtype).max) if self.torch_dtype.is_floating_point else float(
            torch.iinfo(self.torch_dtype).max)

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
    "float32": Codec("float32", "float32", "float32", lossy=False),
    "float16": Codec("float16", "float16", "float16", lossy=True),
    "bfloat16": Codec("bfloat16", "uint16", "bfloat16", lossy=True),
}

#: torch dtypes a kept field may have, by name; each is stored as the numpy dtype of that name.
_KEEP_DTYPES = frozenset({"bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"})


def output_codec(name: str) -> Codec:
    """Look up a dense output codec by name (``float32``, ``float16``, ``bfloat16``); every
    output codec a compute accepts is validated by :func:`featstore.codecs.check_output_codec`."""
    codec = OUTPUT_CODECS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise InvalidInput(f"unknown dense output codec {name!r}; choose one of {sorted(OUTPUT_CODECS)}.")
    return codec


def unrepresentable(codec: Codec, output: str, samples: list[int], largest: float) -> str:
    """The one message for finite values a codec cannot store (they would become inf): which
    samples, how large, and which codec holds them, if any.

    >>> unrepresentable(OUTPUT_CODECS["float16"], "x", [3], 1e6)[:50]
    "finite values of 'x' overflow float16 in 1 samples"
    """
    fits = [c.name for c in OUTPUT_CODECS.values() if c.name != codec.name and largest <= c.largest]
    fix = (f"Store this output as {' or '.join(repr(f) for f in fits)} instead" if fits else
           f"No featstore codec holds values that large (float32 and bfloat16 reach {_F32_MAX:.3g}): scale "
           "or clamp them in Model A")
    return (f"finite values of {output!r} overflow {codec.name} in {len(samples)} samples (first: "
            f"{samples[:10]}; largest |value| {largest:.4g}, {codec.name} holds at most {codec.largest:.4g}), "
            f"so they would be stored as inf. {fix}, or pass ComputeOptions(allow_nonfinite=True) to store "
            "them as inf.")


_F32_MAX = 3.4028234663852886e38  # float(np.finfo(np.float32).max), written out: numpy is imported lazily


def largest_finite(values: torch.Tensor) -> float:
    """The largest finite |value| (0.0 if there is none), on an error path: for messages."""
    x = values.detach().to("cpu", torch.float64).abs()
    x = x[torch.isfinite(x)]
    return float(x.max()) if x.numel() else 0.0


def keep_codec(dtype: torch.dtype) -> Codec:
    """The lossless codec for a kept dataset field (labels, ids) of this torch dtype."""
    stored = str(dtype).removeprefix("torch.")
    if stored == "bfloat16":
        return OUTPUT_CODECS["bfloat16"]
    if stored not in _KEEP_DTYPES:
        raise InvalidInput(
            f"cannot store a kept field of dtype {dtype}; convert it to an integer or float tensor.")
    return Codec(f"keep-{stored}", stored, stored, lossy=False)


def codec_by_name(name: str) -> Codec:
    """Inverse of ``Codec.name`` for what a manifest records."""
    if name in OUTPUT_CODECS:
        return OUTPUT_CODECS[name]
    if name.startswith("keep-"):
        if name[5:] in _KEEP_DTYPES:
            return Codec(name, name[5:], name[5:], lossy=False)
    raise InvalidInput(f"unknown codec {name!r} in a manifest; upgrade featstore.")


def finite_rows(values: torch.Tensor) -> torch.Tensor:
    """Per row (axis 0), whether every value in it is finite, as a bool tensor.

    One summing pass over the values (NaN and Inf propagate through a sum, so a finite row sum
    proves the row finite); the elementwise check runs only on rows whose sum is not finite (a
    NaN/Inf, or finite values whose sum overflowed). About 20x cheaper than ``isfinite().all()``
    on a batch of wide logits.

    >>> finite_rows(torch.tensor([[1.0, 2.0], [float("nan"), 0.0], [3e38, 3e38]])).tolist()
    [True, False, True]
    """
    rows = values.shape[0] if values.dim() else 1
    if values.numel() == 0 or not values.is_floating_point():
        return torch.ones(rows, dtype=torch.bool)
    flat = values.reshape(rows, -1)
    ok = torch.isfinite(flat.sum(dim=1))
    if not bool(ok.all()):
        recheck = ~ok
        ok[recheck] = torch.isfinite(flat[recheck]).all(dim=1)
    return ok
