"""How a version is cut and stored, from what the probe found: the arrays (their codecs, shapes
and compression), the rows per shard and per inner chunk (:func:`choose_layout`), and the
token layout of per-token outputs. Pure arithmetic on a :class:`~featstore.compute.ComputePlan`
and a :class:`~featstore.compute.Probe`, shared by the driver and the teacher in the loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from featstore.codecs import MIN_SHARE, dividing_chunk, nearest_multiples
from featstore.codecs import keep_codec, output_codec
from featstore.codecs import PartsCodec, is_parts_codec, part_array, parts_codec
from featstore.codecs import MIN_SHARD_TOKENS, TOKEN_LENGTH, TOKEN_START, token_layout
from featstore.compute._options import MIN_SHARDS, default_shard_bytes
from featstore.compute._task_spec import Probe
from featstore.errors import InvalidInput, OutputMismatch
from featstore._user_types import FieldKey
from featstore.format import choose_compression
from featstore.format import ArraySpec, Layout
from featstore.versions import DIGEST_BYTES, DIGEST_FIELD
from featstore.versions import SEED_FIELD

if TYPE_CHECKING:
    from featstore.compute._decision import ComputePlan


def choose_layout(n: int, row_bytes: Sequence[int], samples_per_shard: int | None,
                  chunk_rows: int | None, target_shard_bytes: int, fewest: int = 1) -> Layout:
    """Rows per shard and per chunk: about ``target_shard_bytes`` per shard, at least
    ``MIN_SHARDS`` shards when N allows (so readers have something to spread) but, where the
    shard size is chosen here, at least ``fewest`` rows each (unless that passes the byte
    target), 1 MiB chunks.

    An explicit ``samples_per_shard`` is kept exactly: the inner chunk is chosen to divide it
    (:mod:`featstore.codecs`), and a value that no sensible chunk divides, or that an explicit
    ``chunk_rows`` does not divide, is refused naming values that work.

    >>> choose_layout(10_000, [64], 500, None, 2**24).samples_per_shard
    500
    """
    widest = max(max(row_bytes), 1)
    total = max(sum(row_bytes), 1)
    if (samples_per_shard is not None and samples_per_shard < 1) or (chunk_rows is not None and chunk_rows < 1):
        raise InvalidInput("samples_per_shard and chunk_rows must be positive integers.")
    target = 1 << max(4, min(14, (2**20 // widest).bit_length() - 1))
    if samples_per_shard is None:
        by_bytes = max(1, target_shard_bytes // total)
        spread = max(-(-n // MIN_SHARDS), fewest)
        chunk_rows = min(chunk_rows or target, max(1, min(by_bytes, spread)))
        samples_per_shard = -(-max(1, min(by_bytes, spread)) // chunk_rows) * chunk_rows
        return Layout(n_samples=n, samples_per_shard=samples_per_shard, chunk_rows=chunk_rows)
    if chunk_rows is None:
        chunk_rows = dividing_chunk(samples_per_shard, target, widest)
        if chunk_rows is None:
            lo, hi = nearest_multiples(samples_per_shard, target)
            raise InvalidInput(
                f"samples_per_shard={samples_per_shard} cannot be cut into equal inner chunks of about "
                f"{target} rows (~1 MiB of the widest array): it has no divisor between {target // MIN_SHARE} "
                f"and {target}, and a single chunk would be {samples_per_shard * widest / 2**20:.0f} MiB. Use "
                f"{lo} or {hi} (multiples of {target}), or give ComputeOptions(chunk_rows=...) a number of "
                f"rows that divides {samples_per_shard}.")
    elif samples_per_shard % min(chunk_rows, samples_per_shard):
        lo, hi = nearest_multiples(samples_per_shard, chunk_rows)
        raise InvalidInput(f"samples_per_shard={samples_per_shard} is not a multiple of chunk_rows={chunk_rows} "
                           f"(a shard holds whole chunks): use {lo} or {hi}, or a chunk_rows that divides "
                           f"{samples_per_shard}.")
    return Layout(n_samples=n, samples_per_shard=samples_per_shard, chunk_rows=min(chunk_rows, samples_per_shard))


def _spec_arrays(probed: Probe, outputs: Mapping[str, str], keep: Mapping[str, FieldKey], compression: str,
                 local: bool) -> dict[str, ArraySpec]:
    """The arrays of A's outputs and the kept fields, as the probe found them."""
    arrays = {}
    for name, codec_name in outputs.items():
        shape, dtype, saving = probed[name].shape, probed[name].dtype, probed[name].saving
        if not getattr(torch, dtype).is_floating_point:
            raise OutputMismatch(f"output {name!r} is {dtype}; Model A outputs must be floating point.")
        if is_parts_codec(codec_name):
            arrays.update(_part_specs(name, parts_codec(codec_name), probed, compression))
            continue
        codec = output_codec(codec_name)
        arrays[name] = ArraySpec(codec.name, codec.stored, shape, "output",
                                 choose_compression(compression, saving, local))
    for name in keep:
        shape, dtype, saving = probed[name].shape, probed[name].dtype, probed[name].saving
        codec = keep_codec(getattr(torch, dtype))
        arrays[name] = ArraySpec(codec.name, codec.stored, shape, "keep",
                                 choose_compression(compression, saving, local))
    return arrays


def _part_specs(name: str, codec: PartsCodec, probed: Probe, compression: str) -> dict[str, ArraySpec]:
    """The arrays of an output stored in parts; raises here, before anything is written, when
    the codec cannot store the output the probe saw (K larger than the class count, ...)."""
    shape = probed[name].shape
    out = {}
    for ps in codec.parts(shape, name):
        key = part_array(name, ps.part)
        saving = 1.0 if codec.always_compressed or key not in probed else probed[key].saving
        out[key] = ArraySpec(codec.name, ps.dtype, ps.shape, "output", choose_compression(compression, saving),
                             output=name, part=ps.part, params=codec.params(shape))
    return out


def planned_layout(plan: ComputePlan, probed: Probe, local: bool) -> tuple[Layout, dict[str, ArraySpec]]:
    """The layout and arrays a run claims for what the probe found (before any claim adopts
    another run's; ``local``: a store on a local disk): ``compute`` and the teacher in the loop
    (:mod:`featstore.online`) plan the same version (:meth:`ComputePlan.layout`)."""
    options, tokens = plan.options, plan.request.tokens
    arrays = _spec_arrays(probed, plan.outputs, plan.keep, options.compression, local)
    if tokens is not None:
        for f, dtype in ((TOKEN_START, torch.int64), (TOKEN_LENGTH, torch.int32)):
            arrays[f] = ArraySpec(keep_codec(dtype).name, keep_codec(dtype).stored, (), "tokens",
                                  choose_compression(options.compression, probed[f].saving, local))
    if DIGEST_FIELD in probed:  # each sample's input digest: random bytes, which zstd cannot shrink
        arrays[DIGEST_FIELD] = ArraySpec(keep_codec(torch.uint8).name, keep_codec(torch.uint8).stored,
                                         (DIGEST_BYTES,), "digest", choose_compression(options.compression, 0.0, local))
    if plan.views is not None:  # replay seeds: random 63-bit integers, which zstd cannot shrink
        arrays[SEED_FIELD] = ArraySpec(keep_codec(torch.int64).name, keep_codec(torch.int64).stored, (), "seed",
                                       choose_compression(options.compression, 0.0, local))
    arrays = plan.arrays(arrays)
    ragged = {n for n, a in arrays.items() if (a.output or n) in plan.ragged}
    row_bytes = {n: int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize for n, a in arrays.items()}
    # a per-token array's bytes per sample: its token row times the probe's mean tokens
    per_sample_bytes = [max(1, round(b * probed.tokens_per_sample)) if n in ragged else b
                        for n, b in row_bytes.items()]
    target = options.target_shard_bytes or default_shard_bytes(local)
    # a shard's per-token chunks are zstd's frames: spread thinner than MIN_SHARD_TOKENS, a small
    # version's soft labels compress ~10% worse, and a few thousand tokens are no work to spread
    fewest = -(-MIN_SHARD_TOKENS // max(1, round(probed.tokens_per_sample))) if ragged else 1
    layout = replace(choose_layout(plan.n, per_sample_bytes, plan.samples_per_shard, plan.chunk_rows(), target,
                                   fewest), spread=plan.spread())
    if tokens is not None:
        arrays = {n: replace(a, tokens=token_layout(layout.samples_per_shard, tokens.max_tokens, row_bytes[n]))
                  if n in ragged else a for n, a in arrays.items()}
    return layout, arrays
