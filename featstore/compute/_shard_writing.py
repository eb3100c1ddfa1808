"""The task's write side: checking a batch of A's outputs, encoding it with the output codecs
(the sparse ones' device half staged on A's device), and writing a finished shard (its
receipt and digests) into the version.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypeAlias

import numpy as np
import torch
import zarr

from featstore.codecs import Codec, codec_by_name, finite_rows, largest_finite, unrepresentable
from featstore.errors import (ComputeFailed, InvalidInput, NonFiniteOutput,
                              OutputMismatch)
from featstore.format import open_for_write
from featstore.format import shard_digest
from featstore.format import ArrayStats, ShardReceipt
from featstore.codecs import PartsCodec, is_parts_codec, part_array, parts_codec, unpadded
from featstore.codecs import TOKEN_LENGTH, TOKEN_START, TopK, offsets, pack, pack_topk
from featstore.codecs import NONFINITE_KEPT, max_abs_error, value_stats
from featstore.versions import group_store
from featstore.versions import write_receipt
from featstore.compute._task_spec import TaskSpec
from featstore._json import json_list

#: A shard's rows being built: per array its rows (a list of batches' token rows for a
#: per-token array until :func:`finish_buffers` joins them).
ShardBuffers: TypeAlias = dict[str, np.ndarray | list[np.ndarray]]
#: A shard's rows as stored, once finished: one array per array name.
StoredRows: TypeAlias = dict[str, np.ndarray]
#: A batch of values to store: Model A's outputs, kept fields, and per output the device half
#: of a sparse codec (:func:`device_stage`).
Values: TypeAlias = dict[str, torch.Tensor | dict[str, torch.Tensor]]


def want_shape(spec: TaskSpec, name: str) -> tuple[int, ...]:
    """The per-sample shape Model A's output (or a kept field) ``name`` must have."""
    if name in spec.arrays and not spec.arrays[name].output:
        return spec.arrays[name].shape
    # an output stored in parts: the shape A produced is recorded with each part
    return next(tuple(int(d) for d in json_list(a.params["row_shape"], "row_shape") if isinstance(d, int))
                for a in spec.arrays.values() if a.output == name)


def check_batch(spec: TaskSpec, values: Mapping[str, torch.Tensor | TopK], rows: int, start: int) -> None:
    for name, t in values.items():
        want = want_shape(spec, name)
        if tuple(t.shape) != (t.shape[0] if name in spec.ragged else rows, *want):
            raise OutputMismatch(
                f"{name!r} has shape {tuple(t.shape)} on samples [{start}, {start + rows}), but "
                f"{(rows, *want)} was expected (from the first batch); Model A's output "
                "shape must not change between batches.")
        dtype = str(t.dtype).removeprefix("torch.")
        if spec.dtypes and dtype != spec.dtypes[name]:
            raise OutputMismatch(
                f"{name!r} has dtype {dtype} on samples [{start}, {start + rows}), but the first "
                f"batch had {spec.dtypes[name]}; Model A's output dtype must not change between batches.")


def _encode_parts(name: str, codec: PartsCodec, t: torch.Tensor | dict[str, torch.Tensor], start: int,
                  encoded: dict[str, np.ndarray], stats: dict[str, ArrayStats]) -> None:
    """Encode an output stored in parts (sparse soft labels, int8): one array per part, the
    codec's error statistics with the first part's. ``t`` is the output, or what
    :func:`device_stage` already made of it on the device."""
    parts, error = codec.finish(t, start, name) if isinstance(t, dict) else codec.encode(t, start, name)
    for i, (part, arr) in enumerate(parts.items()):
        key = part_array(name, part)
        encoded[key], stats[key] = arr, value_stats(torch.from_numpy(unpadded(part, arr)))
        if i == 0 and error.get("rows"):
            stats[key]["codec_error"] = error


def encode_batch(spec: TaskSpec, values: Values, start: int,
                 token0: int = 0) -> tuple[dict[str, np.ndarray], dict[str, ArrayStats]]:
    """Each value as stored, and its statistics; a per-token output's rows are tokens, the first
    being token row ``token0`` (what ``sample:S`` seeds its draws with, like a sample index)."""
    encoded: dict[str, np.ndarray] = {}
    stats: dict[str, ArrayStats] = {}
    for name, t in values.items():
        if name in spec.outputs and is_parts_codec(spec.outputs[name]):
            _encode_parts(name, parts_codec(spec.outputs[name]), t, token0 if name in spec.ragged else start,
                          encoded, stats)
            continue
        assert isinstance(t, torch.Tensor), f"{name!r}: only an output stored in parts is staged on the device"
        want = spec.arrays[name]
        codec = codec_by_name(want.codec)
        if want.source != "output":  # a kept field: stored exactly in its own dtype
            encoded[name] = codec.encode(t)
            stats[name] = value_stats(t)
            continue
        encoded[name], stats[name] = _encode_dense(spec, name, codec, t, start)
    return encoded, stats


def _encode_dense(spec: TaskSpec, name: str, codec: Codec, t: torch.Tensor,
                  start: int) -> tuple[np.ndarray, ArrayStats]:
    """One dense output as stored, and the statistics of what is stored: NaN/Inf from Model A,
    or finite values the codec cannot represent (float64 beyond float32's range, float32 beyond
    float16's) are :class:`NonFiniteOutput` naming the samples unless ``allow_nonfinite``; a
    cast's rounding is the codec error (``max_abs_error``)."""
    bad = ~finite_rows(t)  # one finiteness pass serves the check and the statistics
    if bool(bad.any()) and not spec.allow_nonfinite:
        rows = (torch.nonzero(bad).reshape(-1) + start).tolist()
        raise NonFiniteOutput(
            f"Model A produced NaN/Inf in {name!r} for {len(rows)} samples (first: {rows[:10]}); fix the "
            "model or data, or pass ComputeOptions(allow_nonfinite=True) to store them.")
    arr, lost = codec.store(t)
    if lost is not None:
        if not spec.allow_nonfinite:
            raise NonFiniteOutput(unrepresentable(codec, name, (torch.nonzero(lost).reshape(-1) + start).tolist(),
                                                  largest_finite(t)))
        bad |= lost
    cast = t.dtype != codec.torch_dtype
    s: ArrayStats = value_stats(codec.decode(arr) if cast else t, not bool(bad.any()))  # what is stored
    if bool(bad.any()):
        s["nonfinite_samples"] = (torch.nonzero(bad).reshape(-1) + start).tolist()[:NONFINITE_KEPT]
    if cast or codec.lossy:
        s["max_abs_error"] = max_abs_error(codec, arr, t)
    return arr, s


def open_arrays(spec: TaskSpec) -> dict[str, zarr.Array[Any]]:
    """The claimed version's Zarr arrays (of ``spec``'s view), opened for :func:`write_shard`."""
    try:
        return open_for_write(group_store(spec.storage, spec.key, spec.layout.spread, read_only=False), spec.arrays)
    except FileNotFoundError:  # zarr's "array not found": the claim's arrays are gone
        pass
    # Raised outside the except block, without zarr's error as its context: that one does not
    # survive the pickling that takes a task's error to the driver.
    raise ComputeFailed(f"the arrays of {spec.storage.child_url(spec.key)} were deleted while it was "
                        "computed (by store.gc or another process); nothing was committed. Rerun "
                        "compute: the shards still stored are kept.")


def shard_buffers(spec: TaskSpec, index: int) -> ShardBuffers:
    """A shard's buffers: one array per per-sample field, a list of batches' token rows per
    per-token array (their count is known only once the shard's batches are in)."""
    start, stop = spec.layout.shard_range(index)
    return {n: [] if a.ragged else np.empty((stop - start, *a.shape), dtype=a.dtype) for n, a in spec.arrays.items()}


def tokens_per_shard(spec: TaskSpec) -> int:
    """Token rows each shard owns in the per-token arrays (0 without per-token outputs)."""
    a = next((a for a in spec.arrays.values() if a.ragged), None)
    return 0 if a is None else spec.layout.of(a).samples_per_shard


def finish_buffers(spec: TaskSpec, index: int, buffers: ShardBuffers | StoredRows,
                   stats: dict[str, ArrayStats]) -> StoredRows:
    """A shard's buffers once all its batches are in, as they are stored: each per-token array's
    batches joined into one array of the shard's token rows, and each sample's first token row
    (``token_start``), now that the shard's counts are known; in place (idempotent), and
    returned as the arrays they all are now."""
    token_start, lengths = buffers.get(TOKEN_START), buffers.get(TOKEN_LENGTH)
    if isinstance(token_start, np.ndarray) and isinstance(lengths, np.ndarray):  # per-sample: never lists
        token_start[:] = index * tokens_per_shard(spec) + offsets(lengths)[:-1]
        stats[TOKEN_START] = value_stats(torch.from_numpy(token_start))
    for name, buf in buffers.items():
        if isinstance(buf, list):
            a = spec.arrays[name]
            buffers[name] = np.concatenate(buf) if buf else np.empty((0, *a.shape), dtype=a.dtype)
    return {name: buf for name, buf in buffers.items() if isinstance(buf, np.ndarray)}


def write_shard(spec: TaskSpec, arrays: dict[str, zarr.Array[Any]], index: int,
                buffers: ShardBuffers | StoredRows, stats: dict[str, ArrayStats]) -> ShardReceipt:
    """Store shard ``index``'s rows (``buffers``, as :class:`~featstore.compute.ShardRows` built
    them) into ``arrays``, then its receipt (digests and ``stats``): the receipt is written last,
    it is the marker that the shard is stored."""
    start, stop = spec.layout.shard_range(index)
    digests = {}
    for name, buf in finish_buffers(spec, index, buffers, stats).items():
        a = spec.arrays[name]
        if a.ragged:  # a per-token array: the shard's tokens, packed from its first row
            t0 = index * tokens_per_shard(spec)
            # a shard without a single token still stores one (padding) row: every shard of
            # every array is an object, which is what commit and resume check
            arrays[name][t0:t0 + max(len(buf), 1)] = buf if len(buf) else np.zeros((1, *a.shape), dtype=a.dtype)
        else:
            arrays[name][start:stop] = buf
        digests[name] = shard_digest(buf)
    receipt = ShardReceipt(index, start, stop, digests, stats, view=spec.view)
    # The receipt is written only after every array of the shard is stored: it is the marker.
    write_receipt(spec.storage, spec.key, receipt)
    return receipt


_STAGED = "/"


def encodes_on_device(device: torch.device) -> bool:
    """Whether the sparse codecs run on the task's device, before the copy to the host: on a GPU
    (a language model's per-token logits are 64-256 KB a token, the parts a few hundred bytes,
    and the host's passes over every class would bound the worker), or where
    ``FEATSTORE_DEVICE_ENCODE=1`` asks for it (the tests run this path on the CPU)."""
    return device.type != "cpu" or os.environ.get("FEATSTORE_DEVICE_ENCODE") == "1"


def topk_codec(codec: str, name: str, t: TopK) -> PartsCodec:
    """The codec of output ``name``, which Model A returns as an engine's top-k rows; an
    :class:`InvalidInput` where it is not a sparse codec (one that stores them)."""
    parts = parts_codec(codec) if is_parts_codec(codec) else None
    if parts is None or not parts.sparse:
        raise InvalidInput(f"Model A returns its top {t.k} classes a row as {name!r} (a TopK), which stores as "
                           f"topk:K or topkq:K, not as {codec!r}.")
    return parts


def device_stage(spec: TaskSpec, outs: Mapping[str, torch.Tensor | TopK], mask: torch.Tensor | None, b0: int,
                 token0: int, dense: bool = True) -> dict[str, torch.Tensor]:
    """Model A's outputs with each sparse-codec output replaced by its codec's device half
    (:meth:`PartsCodec.encode_tensors`, keys ``<name>/<part>``), a per-token one packed to its
    real tokens first; the others unchanged. An engine's :class:`TopK` rows are always staged
    (:meth:`PartsCodec.encode_topk`: nothing else stores them); dense ones only where ``dense``
    (the device encodes). Runs on the task thread, on A's device."""
    out: dict[str, torch.Tensor] = {}
    for name, t in outs.items():
        codec = parts_codec(spec.outputs[name]) if is_parts_codec(spec.outputs[name]) else None
        if isinstance(t, TopK):
            codec = topk_codec(spec.outputs[name], name, t)
        elif codec is None or not codec.sparse or not dense:
            out[name] = t
            continue
        rows = t.shape[0]
        if name in spec.ragged:
            assert mask is not None, f"{name!r}: a per-token output comes with its batch's token mask"
            t = pack_topk(t, mask, name) if isinstance(t, TopK) else pack(t, mask.to(t.device), name)[0]
        check_batch(spec, {name: t}, rows, b0)
        first = token0 if name in spec.ragged else b0
        parts = codec.encode_topk(t, name) if isinstance(t, TopK) else codec.encode_tensors(t, first, name)
        out.update({f"{name}{_STAGED}{k}": v for k, v in parts.items()})
    return out


def unstage(values: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Take :func:`device_stage`'s tensors out of ``values``, grouped by output."""
    staged: dict[str, dict[str, torch.Tensor]] = {}
    for key in [k for k in values if _STAGED in k]:
        name, part = key.split(_STAGED, 1)
        staged.setdefault(name, {})[part] = values.pop(key)
    return staged
