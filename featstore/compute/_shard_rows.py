"""One shard's rows as compute stores them: Model A run on the shard's batches (``batch_size``
rows from the shard's first), each batch's outputs checked, encoded with their codecs and
copied into the shard's buffers, with their statistics (:class:`ShardRows`).

Two callers run the same steps: the shard task (:mod:`featstore.compute`, which overlaps them
on three threads: fetch, A's forward, encode and write) and :func:`compute_shard` (the same
steps one after the other, in the calling process: what the teacher in the loop reads and
fills). From the same floats both give the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from featstore._user_code import describe, read_items, user_error
from featstore._user_types import Item, MapDataset
from featstore.codecs import TOKEN_LENGTH, batch_mask, pack
from featstore.codecs import merge_stats
from featstore.compute._batches import TOKEN_MASK, Output, as_outputs, collate_batch
from featstore.compute._shard_writing import (ShardBuffers, StoredRows, check_batch, device_stage, encode_batch,
                                              encodes_on_device, finish_buffers, shard_buffers, tokens_per_shard,
                                              unstage)
from featstore.compute._task_spec import TaskSpec
from featstore.compute._transfer import HostBatch, Offloader, pin, to_device
from featstore.errors import FeatstoreError
from featstore.format import ArrayStats
from featstore.versions import DIGEST_FIELD, item_digests
from featstore.versions import SEED_FIELD, ViewDataset, view_seeds


@dataclass(frozen=True)
class Inputs:
    """Samples ``[b0, b1)`` as Model A runs on them (augmented, with views), and the input
    digest of each item as the dataset gave it (None where the version stores no digests)."""

    items: list[Item]
    digests: np.ndarray | None


def read_inputs(dataset: MapDataset, b0: int, b1: int, digests: bool) -> Inputs:
    """Read samples ``[b0, b1)`` of ``dataset`` (as A sees it: a view's items are augmented),
    digesting each item as the dataset gave it, before any augmentation, when ``digests``: so
    every view of a sample, the rerun's content check and a reader joining the items all digest
    the same bytes. Runs where the items are read (the task's fetch thread), never on A's."""
    raw = dataset.dataset if isinstance(dataset, ViewDataset) else dataset
    items = read_items(raw, range(b0, b1))
    found = item_digests(items) if digests else None
    if isinstance(dataset, ViewDataset):
        items = dataset.seen(items, range(b0, b1))
    return Inputs(items, found)


#: ``inputs(dataset, b0, b1)``: samples ``b0 .. b1 - 1`` (default: :func:`read_inputs` now).
ItemReader = Callable[[MapDataset, int, int], Inputs]


def collate_inputs(spec: TaskSpec, inputs: Inputs, start: int,
                   pinned: bool) -> tuple[object, dict[str, torch.Tensor]]:
    """The input batch for A (in pinned memory if ``pinned``) and the kept fields (with
    per-token outputs, the batch's real-token mask and each sample's token count; with digests,
    each sample's input digest)."""
    items = inputs.items
    x, kept = collate_batch(items, spec.input_key, spec.keep, spec.collate, start)
    if inputs.digests is not None:
        kept[DIGEST_FIELD] = torch.from_numpy(inputs.digests)
    if spec.tokens is not None:
        try:
            kept[TOKEN_MASK] = batch_mask(spec.tokens, x, len(items), start)
        except FeatstoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's mask function raises anything
            raise user_error(exc, f"Tokens(mask={describe(spec.tokens.mask)}) on samples [{start}, "
                             f"{start + len(items)})", "fix it, then rerun.") from exc
        kept[TOKEN_LENGTH] = kept[TOKEN_MASK].sum(1).to(torch.int32)
    return (pin(x) if pinned else x), kept


def forward(spec: TaskSpec, model: torch.nn.Module, x: object, start: int, rows: int,
            device: torch.device, samples: str | None = None) -> dict[str, Output]:
    """Model A on one input batch (samples ``[start, start + rows)``, or as ``samples`` names
    them), under ``inference_mode`` (and ``autocast`` if asked), its outputs by name; what A
    raises names the samples."""
    x = to_device(x, device)
    try:
        with torch.inference_mode():
            if spec.autocast:
                with torch.autocast(device.type, dtype=getattr(torch, spec.autocast)):
                    out = model(x)
            else:
                out = model(x)
    except Exception as exc:  # noqa: BLE001
        raise user_error(exc, "Model A", "fix the model or the data, then rerun: finished shards are kept.",
                         f"on samples {samples or f'[{start}, {start + rows})'}") from exc
    return as_outputs(out, list(spec.outputs))


def shard_batches(spec: TaskSpec, index: int) -> list[tuple[int, int]]:
    """The batches ``[b0, b1)`` A runs on for shard ``index``: ``spec.batch_size`` rows from
    the shard's first (the last one shorter)."""
    start, stop = spec.layout.shard_range(index)
    return [(b0, min(b0 + spec.batch_size, stop)) for b0 in range(start, stop, spec.batch_size)]


@dataclass(frozen=True)
class BatchSpan:
    """Where one batch of a shard goes: samples ``[b0, b1)``, and its first token row (per-token
    outputs: what ``sample:S`` seeds its draws with, like a sample index)."""

    b0: int
    b1: int
    token0: int = 0


@dataclass
class ShardRows:
    """Shard ``index``'s rows being built, batch by batch: every array's rows in its stored dtype
    (a list of batches' token rows for a per-token array, until :meth:`finish`) and their
    statistics.

    :meth:`forward` runs on A's thread, :meth:`store` wherever the encoding runs (the shard
    task's write thread); called in batch order, then :meth:`finish`, they give what
    ``compute`` stores.
    """

    spec: TaskSpec
    index: int
    buffers: ShardBuffers
    stats: dict[str, ArrayStats] = field(default_factory=dict)
    tokens: int = 0  # real tokens in the batches forwarded so far

    @classmethod
    def start(cls, spec: TaskSpec, index: int) -> ShardRows:
        """Empty buffers for shard ``index``."""
        return cls(spec, index, shard_buffers(spec, index))

    def forward(self, net: torch.nn.Module, x: object, kept: dict[str, torch.Tensor], b0: int, b1: int,
                device: torch.device, on_device: bool) -> tuple[dict[str, torch.Tensor], BatchSpan]:
        """A on the batch ``[b0, b1)`` of this shard (``on_device``: the sparse codecs' device
        half staged on A's device); the values to copy to the host (outputs and kept fields)
        and where they go."""
        span = BatchSpan(b0, b1, self.index * tokens_per_shard(self.spec) + self.tokens)
        outs = forward(self.spec, net, x, b0, b1 - b0, device)
        mask = kept.get(TOKEN_MASK)
        staged = device_stage(self.spec, outs, mask, b0, span.token0, dense=on_device)
        if mask is not None:
            self.tokens += int(mask.sum())
        return {**staged, **kept}, span

    def store(self, batch: HostBatch, span: BatchSpan) -> None:
        """Check, encode and copy one batch into the shard's buffers, once its device->host
        copies have landed."""
        spec, start = self.spec, self.spec.layout.shard_range(self.index)[0]
        values = batch.wait()
        if spec.view is not None:  # each row's replay seed, stored beside the outputs
            values[SEED_FIELD] = torch.from_numpy(view_seeds(spec.augment_seed, spec.view,
                                                             np.arange(span.b0, span.b1)))
        mask = values.pop(TOKEN_MASK, None)
        staged = unstage(values)
        if mask is not None:  # per-token outputs (spec.ragged) come only with Tokens, which sets the mask
            for name in spec.ragged:
                if name in values:
                    values[name] = pack(values[name], mask, name)[0]
        check_batch(spec, values, span.b1 - span.b0, span.b0)  # a staged output was checked on the device
        enc, st = encode_batch(spec, {**values, **staged}, span.b0, span.token0)
        for n, arr in enc.items():
            buf = self.buffers[n]
            if isinstance(buf, list):
                buf.append(arr)
            else:
                buf[span.b0 - start:span.b1 - start] = arr
            self.stats[n] = merge_stats(self.stats.get(n), st[n])

    def finish(self) -> ShardRows:
        """The rows as stored, once every batch is in: each per-token array one array of the
        shard's token rows, and ``token_start`` filled in."""
        finish_buffers(self.spec, self.index, self.buffers, self.stats)
        return self

    def arrays(self) -> StoredRows:
        """Every array's rows as stored, once :meth:`finish` joined each per-token array's
        batches (before, the per-token arrays are left out)."""
        return {n: b for n, b in self.buffers.items() if isinstance(b, np.ndarray)}

    def stored_bytes(self) -> int:
        """Bytes of the shard's rows as stored (before compression)."""
        return sum(b.nbytes if isinstance(b, np.ndarray) else sum(a.nbytes for a in b) for b in self.buffers.values())




def compute_shard(spec: TaskSpec, net: torch.nn.Module, dataset: MapDataset, index: int, device: torch.device,
                  items: ItemReader | None = None) -> ShardRows:
    """Shard ``index`` as ``compute`` stores it, computed here: A (``net``, on ``device``) run
    on the shard's batches of ``dataset`` (as A sees it: with views, the view's items), each
    batch encoded as the shard task encodes it; the same bytes as the task's from the same
    floats. ``items``: where the batches' items come from (e.g. read ahead on a thread).

    Write it with :func:`~featstore.compute.write_shard` (the task's write: objects, digests
    and receipt).
    """
    rows = ShardRows.start(spec, index)
    offload, on_device = Offloader(device), encodes_on_device(device)
    read = items or (lambda data, b0, b1: read_inputs(data, b0, b1, spec.digests))
    for b0, b1 in shard_batches(spec, index):
        x, kept = collate_inputs(spec, read(dataset, b0, b1), b0, pinned=device.type == "cuda")
        values, span = rows.forward(net, x, kept, b0, b1, device, on_device)
        rows.store(offload.to_host(values), span)
    return rows.finish()
