"""Weighted mixtures of versions read as one stream: :func:`mix`, :class:`Stream`, :class:`MixtureDataset`.

>>> ds = featstore.mix([(web, 0.7), (code, 0.3)], epoch_size=100_000, batch_size=256, seed=0)
>>> for batch in DataLoader(ds, batch_size=None, num_workers=2):
...     batch["features"], batch["index"], batch["source"]   # source: the row's version, ds.versions[i]

The plan is the pure one of :mod:`featstore.read.plans._mixture` (weights as Mosaic Streaming defines
them: ``proportion``, ``repeat``, ``choose``): each consumer (rank, DataLoader worker) takes its
span of the epoch's positions, cut into shuffle windows that read a run of each version's shard
order and yield its rows in the window's stratified order, so every stretch of the stream holds
each version in its proportion. Nothing else is new: a :class:`MixtureDataset` holds one
:class:`~featstore.FeatureDataset` per version as its reader (its sources, caches, decoding) and
one :class:`~featstore.read.state._epoch_state.EpochState` for the mixture's epochs, placement and
resume points - so sharding, ``set_epoch``, ``state_dict``/``load_state_dict`` and the elastic
resume under another split are the single version's.

**A batch.** Its rows come in the stratified order, then are grouped by version inside the batch
(version 0's rows first; each version's rows read shard-contiguously), with ``"source"``: the
version of each row, an index into :attr:`MixtureDataset.versions`; ``"index"`` is the row's
sample in its version.

**Limits.** The versions must have the same arrays (names, codecs, dtypes, per-sample shapes and
codec parameters, the tokenizer among them), or ``arrays=`` names arrays they share that agree.
Per-token (ragged) arrays and versions with views are refused (:class:`InvalidInput`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from featstore.errors import InvalidInput
from featstore.format._manifests import ArraySpec
from featstore.read.plans._assignment import UniformShards
from featstore.read._dataset import FeatureDataset, raising
from featstore.read.plans._elastic import EpochOrder
from featstore.read.state._epoch_state import EpochState, Iteration
from featstore.read._mix_gather import MixedRows, MixedSlice, regrouped
from featstore.read.plans._mixture import MixStream, Mixture
from featstore.read._options import ReaderOptions
from featstore.read.plans._slices import Share, run_starts, slice_reads, slice_rows
from featstore.read.shards._sources import Epoch, Window, WindowRows, read_windows
from featstore.read.state._worker_share import in_worker
from featstore.versions._committed import HasStoredVersion, StoredVersion, stored

SOURCE = "source"


@dataclass(frozen=True)
class Stream:
    """One version of a mixture and at most one weight (Mosaic's): ``proportion`` (relative, all
    streams or none, with ``epoch_size``), ``repeat`` (times its size per epoch) or ``choose``
    (samples per epoch); none: its size."""

    version: StoredVersion | HasStoredVersion
    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None


@dataclass(frozen=True)
class _Ident:
    """What a mixture's states name it by (checked on load)."""

    id: str
    name: str


def mix(streams: Sequence[Stream | tuple[StoredVersion | HasStoredVersion, float]], *,
        epoch_size: int | None = None, arrays: Sequence[str] | None = None, rank: int | None = None,
        world_size: int | None = None, options: ReaderOptions | None = None, **option_fields: Any) -> MixtureDataset:
    """Several versions read as one weighted stream (a :class:`MixtureDataset`).

    ``streams``: :class:`Stream`\\ s, or ``(version, proportion)`` pairs; ``epoch_size``: samples
    per epoch with proportions (None: the versions' sizes summed); ``arrays``: the arrays to read
    (None: all, which must agree across the versions); every other keyword is a
    :class:`~featstore.ReaderOptions` field (``batch_size``, ``shuffle``, ``seed``, ...).

    >>> ds = featstore.mix([(web, 0.7), (code, 0.3)], epoch_size=50_000, batch_size=256, seed=0)
    """
    given = [s if isinstance(s, Stream) else Stream(s[0], proportion=s[1]) for s in streams]
    return MixtureDataset(given, epoch_size=epoch_size, arrays=arrays, rank=rank, world_size=world_size,
                          options=options, **option_fields)


class MixtureDataset(IterableDataset):
    """A weighted mixture of versions as one ``IterableDataset`` (see the module docstring)."""

    def __init__(self, streams: Sequence[Stream], *, epoch_size: int | None = None,
                 arrays: Sequence[str] | None = None, rank: int | None = None, world_size: int | None = None,
                 options: ReaderOptions | None = None, **option_fields: Any) -> None:
        super().__init__()
        if not streams:
            raise InvalidInput("a mixture needs at least one stream: featstore.mix([(version, weight), ...]).")
        self.versions = [stored(s.version) for s in streams]
        self.options = replace(options or ReaderOptions(), **option_fields)
        self.fields = check_compatible(self.versions, None if arrays is None else tuple(arrays))
        self.readers = [FeatureDataset(v, options=replace(self.options, fields=self.fields)) for v in self.versions]
        layouts = [UniformShards(v.manifest.layout.n_samples, v.manifest.layout.samples_per_shard)
                   for v in self.versions]
        self.mixture = Mixture(tuple(MixStream(lay, s.proportion, s.repeat, s.choose)
                                     for lay, s in zip(layouts, streams, strict=True)), epoch_size)
        window = self.options.shuffle_window or 4 * max(lay.per_shard for lay in layouts)
        self.order = EpochOrder(self.mixture, self.options.seed, self.options.shuffle, window)
        ident = _Ident("+".join(v.id for v in self.versions), "mix(" + ", ".join(v.name for v in self.versions) + ")")
        self._epochs = EpochState(ident, self.options, self.order, rank, world_size)

    # -- what the single reader offers ---------------------------------------------------
    @property
    def counts(self) -> tuple[int, ...]:
        """Each version's samples per epoch."""
        return self.mixture.counts()

    def __len__(self) -> int:
        """Samples per epoch, all versions together."""
        return self.mixture.n_samples

    @property
    def epoch(self) -> int:
        """The epoch (see :attr:`FeatureDataset.epoch`)."""
        return self._epochs.epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration read ``epoch`` (see :meth:`FeatureDataset.set_epoch`)."""
        self._epochs.set_epoch(epoch)

    def state_dict(self, batches_seen: int | None = None, num_workers: int | None = None) -> dict[str, Any]:
        """Where this rank is in the epoch (see :meth:`FeatureDataset.state_dict`)."""
        return self._epochs.state_dict(batches_seen, num_workers)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume mid-epoch, under any split with the same global batch (see
        :meth:`FeatureDataset.load_state_dict`)."""
        self._epochs.load_state_dict(state)

    def state_from_workers(self, states: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The rank-level state made of a loader's per-worker states (:class:`featstore.StatefulLoader`)."""
        return self._epochs.from_workers(states)

    # -- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        # as FeatureDataset.__iter__: started here; a worker's error raised by the first next()
        if not in_worker():
            return self._iterate(self._epochs.start())
        try:
            it = self._epochs.start()
        except Exception as exc:  # noqa: BLE001 - re-raised by the first next(), in the DataLoader's handling
            return raising(exc)
        return self._iterate(it)

    def _iterate(self, it: Iteration) -> Iterator[dict[str, torch.Tensor]]:
        local = self._epochs.local
        share = it.share.rows(it.skip_rows, it.share.n_samples)
        for batch in self._batches(share, it.epoch, self._stream_windows(share, it)):
            local.yielded += 1
            yield batch

    def _stream_windows(self, share: Share, it: Iteration) -> list[Iterator[tuple[Window, dict[str, WindowRows]]]]:
        """Each version's windows of ``share`` (one per slice that reads it), read ahead by its
        own reader: each version's reads stay shard-contiguous."""
        reads = [slice_reads(sl, self.options.shuffle) for sl in share.slices]
        out = []
        for k, reader in enumerate(self.readers):
            windows = tuple(Window(j, r[k], len(self.versions[k])) for j, r in enumerate(reads) if r[k])
            epoch = Epoch(it.epoch, it.cid, it.split.consumers, it.split.partition, windows)
            out.append(read_windows(reader.process_sources(), epoch, self.options.prefetch,
                                    self.versions[k].manifest.layout.samples_per_shard))
        return out

    def _batches(self, share: Share, epoch: int,
                 streams: list[Iterator[tuple[Window, dict[str, WindowRows]]]]) -> Iterator[dict[str, torch.Tensor]]:
        """Cut the share's slices into batches (across slice boundaries, as a version's windows).
        Each slice's joint arrays are set up once (:class:`MixedSlice`); a batch is then one
        gather per array. A batch's part from a slice is gathered before the next slice is read
        (which releases that slice's windows)."""
        bs, shuffle = self.options.batch_size, self.options.shuffle
        held: list[MixedRows] = []  # the batch being filled: its parts from earlier slices
        n_held = 0
        for sl in share.slices:
            rows = slice_rows(sl, self.options.seed, epoch, shuffle)
            arrays = [next(streams[k])[1] if run else None for k, run in enumerate(rows.reads)]
            # each version's rows read start where the rows read of the versions before end
            starts = run_starts([sum(p.size for p in run) for run in rows.reads])
            mixed = MixedSlice(arrays, rows.streams, rows.order - starts[rows.streams], n_held, bs)
            pos, n = 0, len(rows.order)
            while pos < n:
                take = min(bs - n_held, n - pos)
                part = mixed.rows(pos, pos + take)
                pos += take
                if take == bs:
                    yield self._batch(part)
                    continue
                held.append(part)
                n_held += take
                if n_held == bs:
                    yield self._batch(regrouped(held))
                    held, n_held = [], 0
        for s in streams:  # every version's reads end (their sources close the epoch)
            for _ in s:
                pass
        if held and not self.options.drop_last:
            yield self._batch(regrouped(held))

    def _batch(self, rows: MixedRows) -> dict[str, torch.Tensor]:
        """One batch from its rows (grouped by version): decoded once, as one version's (the
        versions' codecs agree: :func:`check_compatible`), with the ``"source"`` column."""
        t = self.readers[0].to_batch(rows.arrays)
        t[SOURCE] = torch.from_numpy(rows.labels.astype(np.int64, copy=False))  # MixedRows' own copy
        return t

    def __repr__(self) -> str:
        return f"MixtureDataset({', '.join(v.ref for v in self.versions)}, counts={self.counts}, {self.options})"


def check_compatible(versions: list[StoredVersion], arrays: tuple[str, ...] | None) -> tuple[str, ...]:
    """The arrays to read from every version: ``arrays``, or all of the first's; each must exist in
    every version with the same codec, dtype, per-sample shape and codec parameters (the tokenizer
    among them). Per-token arrays and views are refused (:class:`InvalidInput`)."""
    for v in versions:
        if v.views is not None:
            raise InvalidInput(f"version {v.ref} has {v.views} views per sample; a mixture reads versions without "
                               "views (a limit of featstore.mix).")
    first = versions[0].manifest.arrays
    wanted = arrays if arrays is not None else tuple(f for f, a in first.items() if a.source != "seed")
    ragged = [f for v in versions for f, a in v.manifest.arrays.items() if f in wanted and a.ragged]
    if ragged:
        raise InvalidInput(f"arrays {sorted(set(ragged))} are per-token (ragged); a mixture reads per-sample arrays "
                           "only (a limit of featstore.mix): name others with arrays=[...].")
    differ = []
    for v in versions[1:]:
        specs = v.manifest.arrays
        for f in wanted:
            if f not in first or f not in specs:
                differ.append(f"{f!r} is missing from {versions[0].ref if f not in first else v.ref}")
                continue
            differ += [f"{f!r} {what} {getattr(first[f], what)!r} in {versions[0].ref}, "
                       f"{getattr(specs[f], what)!r} in {v.ref}" for what in _disagree(first[f], specs[f])]
        if arrays is None and set(specs) != set(first):
            differ.append(f"{v.ref} has arrays {sorted(specs)}, {versions[0].ref} {sorted(first)}")
    if differ:
        shared = sorted(f for f in first if not first[f].ragged and all(
            f in v.manifest.arrays and not _disagree(first[f], v.manifest.arrays[f]) for v in versions[1:]))
        raise InvalidInput(f"the versions' arrays differ: {'; '.join(differ)}. Pass arrays=[...] naming arrays they "
                           f"share with the same codec, dtype and shape (these agree: {shared}).")
    return tuple(wanted)


def _disagree(a: ArraySpec, b: ArraySpec) -> list[str]:
    """What of two versions' specs of one array differs (the codec, dtype, shape, params)."""
    return [what for what in ("codec", "dtype", "shape", "params") if getattr(a, what) != getattr(b, what)]
