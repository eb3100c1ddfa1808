"""The batches a shard task runs Model A on: cut in sample order, or by size within windows.

A collate that pads (token sequences of different lengths) makes A pay for every row of a batch
at the batch's longest: one 250-token text among 31 of 20 tokens costs 32 of 250. Where A's
inputs differ in size, the task reads a window of its samples at once (whole shards where they
fit, up to :data:`GROUP_BATCHES` batches), orders them by size, largest first, and cuts the
batches from that order (what sentence-transformers' ``encode`` and Hugging Face's
``group_by_length`` do). A's outputs go back into sample order before they are checked, encoded
and stored, so the stored rows do not depend on it beyond floating-point rounding (a batch's
shape can change the last bits). Measured on 1,410 docstring paragraphs for all-MiniLM-L6-v2: its
real tokens were 0.28 of the tokens A computed on in sample order, 0.83 cut by size in windows.

Only where it is safe and useful: ``ComputeOptions(group_by_length=True)`` (the default), a
``collate`` (``default_collate`` cannot batch inputs of different sizes anyway), per-sample
outputs (per-token outputs are packed in sample order as they come) and no sparse codec staged
on A's device (it seeds by position). Otherwise, or where a window's inputs all have one size,
the batches are today's: ``batch_size`` samples from each shard's first, one window per batch,
read one batch ahead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from featstore._user_types import Item, MapDataset
from featstore.codecs import is_parts_codec, parts_codec
from featstore.compute._batches import select
from featstore.compute._shard_rows import Inputs, collate_inputs, read_inputs
from featstore.compute._shard_writing import want_shape
from featstore.compute._task_spec import TaskSpec
from featstore.compute._transfer import HostBatch
from featstore.errors import FeatstoreError, OutputMismatch

#: Batches a window holds at most: enough that sorting by size leaves little padding, few
#: enough that the window's inputs and A's outputs stay small beside a shard.
GROUP_BATCHES = 32
#: Samples the probe runs A on where the inputs differ in size: the smallest of its batch (the
#: probe learns shapes, dtypes and zstd's saving; a batch padded to its longest cost 10% of a
#: compute of 1,410 texts).
PROBE_BY_SIZE = 8
#: A window holds at most this many bytes of A's outputs (they wait there until the window ends).
WINDOW_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Span:
    """Samples ``[b0, b1)`` of shard ``shard``; ``first``/``last``: the shard starts/ends here."""

    shard: int
    b0: int
    b1: int
    first: bool
    last: bool


@dataclass(frozen=True)
class Window:
    """Samples a task reads at once (its spans, in sample order); ``by_size``: its batches may be
    cut in order of size (else it is one batch, read one ahead of the forward)."""

    spans: tuple[Span, ...]
    by_size: bool = False

    @property
    def rows(self) -> int:
        return sum(s.b1 - s.b0 for s in self.spans)


@dataclass(frozen=True)
class Batch:
    """One input batch for A: ``span`` where its samples are consecutive samples of one shard
    (stored as they come), else ``positions``: where its rows go in the window's sample order."""

    x: object
    kept: dict[str, torch.Tensor]
    span: Span | None = None
    positions: np.ndarray | None = None


def may_group(spec: TaskSpec, on_device: bool) -> bool:
    """Whether this task may cut its batches by size (see the module's docstring)."""
    staged = on_device and any(is_parts_codec(c) and parts_codec(c).sparse for c in spec.outputs.values())
    return spec.group_by_length and spec.collate is not None and spec.tokens is None and not staged


def plan_windows(spec: TaskSpec, shards: Sequence[int], by_size: bool) -> list[Window]:
    """The task's windows over ``shards``: one per batch (``batch_size`` samples from each
    shard's first), or, ``by_size``, whole shards together up to :func:`window_rows` samples
    (a larger shard cut into pieces of that many, a multiple of ``batch_size``)."""
    size = window_rows(spec) if by_size else spec.batch_size
    windows: list[Window] = []
    spans: list[Span] = []
    for index in shards:
        start, stop = spec.layout.shard_range(index)
        for b0 in range(start, stop, size):
            b1 = min(b0 + size, stop)
            if spans and sum(s.b1 - s.b0 for s in spans) + b1 - b0 > size:
                windows.append(Window(tuple(spans), by_size))
                spans = []
            spans.append(Span(index, b0, b1, b0 == start, b1 == stop))
    if spans:
        windows.append(Window(tuple(spans), by_size))
    return windows


def window_rows(spec: TaskSpec) -> int:
    """Samples a window holds: :data:`GROUP_BATCHES` batches, fewer where A's outputs for them
    (as A returns them: float32 logits stored as top-k are wider than stored) and the kept fields
    would pass :data:`WINDOW_BYTES`; a multiple of ``batch_size``."""
    def elements(shape: tuple[int, ...]) -> int:
        return int(np.prod(shape, dtype=np.int64))

    itemsize = {n: int(getattr(torch, spec.dtypes.get(n, "float32")).itemsize) for n in spec.outputs}  # torch: Any
    row = sum(elements(want_shape(spec, n)) * itemsize[n] for n in spec.outputs)
    row += sum(elements(a.shape) * np.dtype(a.dtype).itemsize for a in spec.arrays.values() if a.source != "output")
    batches = max(1, min(GROUP_BATCHES, WINDOW_BYTES // max(1, row * spec.batch_size)))
    return batches * spec.batch_size


def window_samples(window: Window) -> np.ndarray:
    """The window's sample indices, in sample order."""
    return np.concatenate([np.arange(s.b0, s.b1) for s in window.spans])


def window_shards(window: Window) -> np.ndarray:
    """The shard of each of the window's samples, in sample order."""
    return np.concatenate([np.full(s.b1 - s.b0, s.shard) for s in window.spans])


def input_size(x: object) -> int | None:
    """What an input costs A once padded, roughly: a tensor's or array's elements, a sequence's
    or string's length, the sum over a dict's values; None where that is unknown."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return int(x.numel() if isinstance(x, torch.Tensor) else x.size)
    if isinstance(x, (str, bytes, list, tuple)):
        return len(x)
    if isinstance(x, Mapping):
        sizes = [input_size(v) for v in x.values()]
        return None if None in sizes else sum(s for s in sizes if s is not None)
    return None


def probe_inputs(spec: TaskSpec, inputs: Inputs, by_size: bool) -> tuple[Inputs, bool]:
    """The probe's samples (of ``inputs``, the first of the dataset) and whether A's inputs
    differ in size among them; where they do and the batches may be cut by size, only the
    :data:`PROBE_BY_SIZE` smallest (in sample order)."""
    sizes = [input_size(select(it, spec.input_key, "input")) for it in inputs.items]
    vary = None not in sizes and len(set(sizes)) > 1
    if not (vary and by_size) or len(sizes) <= PROBE_BY_SIZE:
        return inputs, vary
    keep = np.sort(np.argsort(np.asarray(sizes, dtype=np.int64), kind="stable")[:PROBE_BY_SIZE])
    return Inputs([inputs.items[i] for i in keep], None if inputs.digests is None else inputs.digests[keep]), vary


def fetch_window(spec: TaskSpec, dataset: MapDataset, window: Window, pinned: bool) -> list[Batch]:
    """Read, digest and collate a window's batches (on the task's fetch thread): in sample order,
    or cut by size where the window may be and its inputs differ in size."""
    if not window.by_size:
        s = window.spans[0]
        x, kept = collate_inputs(spec, read_inputs(dataset, s.b0, s.b1, spec.digests), s.b0, pinned)
        return [Batch(x, kept, span=s)]
    inputs = [read_inputs(dataset, s.b0, s.b1, spec.digests) for s in window.spans]
    items = [it for inp in inputs for it in inp.items]
    sizes = [input_size(select(it, spec.input_key, "input")) for it in items]
    if None not in sizes and len(set(sizes)) > 1:
        try:
            return _by_size(spec, items, inputs, np.asarray(sizes, dtype=np.int64), pinned)
        except FeatstoreError:
            pass  # collated in sample order below, where the error names the right samples
    return [b for s, inp in zip(window.spans, inputs, strict=True) for b in _in_order(spec, s, inp, pinned)]


def _in_order(spec: TaskSpec, span: Span, inputs: Inputs, pinned: bool) -> list[Batch]:
    """``span``'s batches of ``batch_size`` samples from its first."""
    out = []
    for b0 in range(span.b0, span.b1, spec.batch_size):
        b1 = min(b0 + spec.batch_size, span.b1)
        part = slice(b0 - span.b0, b1 - span.b0)
        sub = Inputs(inputs.items[part], None if inputs.digests is None else inputs.digests[part])
        x, kept = collate_inputs(spec, sub, b0, pinned)
        out.append(Batch(x, kept, span=Span(span.shard, b0, b1, span.first and b0 == span.b0,
                                             span.last and b1 == span.b1)))
    return out


def _by_size(spec: TaskSpec, items: list[Item], inputs: list[Inputs], sizes: np.ndarray,
             pinned: bool) -> list[Batch]:
    """The window's batches cut from its samples ordered by size, largest first (ties in sample
    order)."""
    found = [i.digests for i in inputs if i.digests is not None]
    digests = np.concatenate(found) if found else None
    order = np.argsort(-sizes, kind="stable")
    out = []
    for k in range(0, len(order), spec.batch_size):
        pos = order[k:k + spec.batch_size]
        sub = Inputs([items[p] for p in pos], None if digests is None else digests[pos])
        x, kept = collate_inputs(spec, sub, 0, pinned)
        out.append(Batch(x, kept, positions=pos))
    return out


def in_sample_order(window: Window, batches: Sequence[tuple[np.ndarray, HostBatch]],
                    samples: str) -> dict[str, torch.Tensor]:
    """A window's values (A's outputs and the kept fields of batches cut by size, each with
    its positions) back in the window's sample order. ``samples`` names the window's samples."""
    got = [(pos, host.wait()) for pos, host in batches]
    first = got[0][1]
    out = {}
    for name, t in first.items():
        for _, values in got:
            v = values[name]
            if tuple(v.shape[1:]) != tuple(t.shape[1:]) or v.dtype != t.dtype:
                raise OutputMismatch(
                    f"{name!r} has shape {tuple(v.shape)} ({v.dtype}) in one batch of samples {samples} and "
                    f"{tuple(t.shape)} ({t.dtype}) in another; Model A's output shape and dtype must not change "
                    "between batches (pad to a fixed length, or store per-token outputs with tokens=).")
        whole = torch.empty((window.rows, *t.shape[1:]), dtype=t.dtype)
        for pos, values in got:
            whole[torch.from_numpy(pos)] = values[name].cpu()
        out[name] = whole
    return out
