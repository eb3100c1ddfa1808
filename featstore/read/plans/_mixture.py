"""Weighted mixtures of versions: several streams read as one, as pure functions.

A *stream* is one version of a mixture, with its layout (:class:`~featstore.read.UniformShards`)
and at most one weight, as Mosaic Streaming's ``Stream`` defines them:

- ``proportion``: the stream's share of the epoch. Proportions are relative (normalised to sum
  1) and all-or-none: the epoch has ``epoch_size`` samples (None: the streams' sizes summed),
  apportioned by largest remainder (ties to the earlier stream; Mosaic hands the remainder out
  at random, which is equally deterministic but farther from the weights);
- ``repeat``: the stream's size times this, rounded down (0.5: half of it, 2: all of it twice);
- ``choose``: exactly this many samples;
- none: the stream's size. ``repeat``, ``choose`` and none mix freely; ``epoch_size`` is for
  proportions (or none at all: then the streams are weighted by their sizes).

:meth:`Mixture.counts` gives each stream's samples per epoch. Then each epoch:

1. **Which samples.** Stream ``s`` reads an endless sequence of *passes* over its shards, pass
   ``p`` in the order :class:`~featstore.read.ShardPermutation` gives for (the stream's seed,
   ``p``) - the order a plain read of that version would take in its epoch ``p`` under that seed;
   epoch ``e`` reads that sequence's positions ``[e * c, (e + 1) * c)`` (``c``: the stream's
   count). So samples are drawn without replacement until a stream is exhausted, across epochs
   as well as within one, and with replacement (another pass) beyond; unshuffled, a stream's
   epochs follow each other through its samples. The stream's seed is drawn from (seed, stream).
2. **Interleaving.** The epoch is one sequence of ``M`` positions (the counts summed) in which
   the streams take turns in the balanced pattern of :func:`~featstore.read.plans._slices.interleave`:
   of the first ``x`` positions, stream ``s`` has ``F_s(x)``, within a row of ``x * c_s / M``.
3. **Splitting.** As for one version (:mod:`featstore.read.plans._assignment`): consumer ``cid`` takes
   the span ``consumer_span(M, consumers, cid, partition)`` (``"pad"`` wraps to the epoch's start),
   cut into shuffle windows of ``window`` positions. A window ``[a, b)`` reads, of each stream,
   its positions ``[F_s(a), F_s(b))`` - a run of that stream's sequence, so shard pieces - and
   yields them in the window's stratified order (:func:`~featstore.read.plans._slices.window_order`), so
   that every stretch of what a consumer yields holds each stream in its proportion.

A consumer's plan is a :class:`~featstore.read.plans._slices.Share` like a plain version's, with a
stream per run: the same reader loop reads both, labels each row with its stream, and resumes
either under another split (:mod:`featstore.read.plans._elastic`). Planning costs O(the consumer's
windows x streams), whatever the epoch or the streams' sizes. Nothing here does IO.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from featstore.errors import InvalidInput
from featstore.read.plans._assignment import Partition, Piece, UniformShards, consumer_span, laps, uniform_span_pieces
from featstore.read.plans._shuffle import ShardPermutation
from featstore.read.plans._slices import Share, Slice, Window, interleave, split_pieces

WEIGHTS = ("proportion", "repeat", "choose")


@dataclass(frozen=True)
class MixStream:
    """One version of a mixture: its layout and at most one weight (see the module docstring)."""

    layout: UniformShards
    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None

    def __post_init__(self) -> None:
        given = [w for w in WEIGHTS if getattr(self, w) is not None]
        if len(given) > 1:
            raise InvalidInput(f"a stream takes at most one of {WEIGHTS}, got {given}: keep one.")
        for w in given:
            value = getattr(self, w)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0 \
                    or (w == "choose" and not isinstance(value, int)):
                kind = "an int" if w == "choose" else "a number"
                raise InvalidInput(f"{w} must be {kind} >= 0, got {value!r}.")
            if not math.isfinite(value):
                raise InvalidInput(f"{w}={value!r} is not a finite weight: a stream read without end would leave no "
                                   "room for the others. Give a finite proportion (relative to the others), repeat "
                                   "(times its size per epoch) or choose (samples per epoch).")

    @property
    def weight(self) -> str | None:
        return next((w for w in WEIGHTS if getattr(self, w) is not None), None)


@dataclass(frozen=True)
class Mixture:
    """Streams read as one epoch (see the module docstring); ``epoch_size`` with proportions."""

    streams: tuple[MixStream, ...]
    epoch_size: int | None = None

    def __post_init__(self) -> None:
        if not self.streams:
            raise InvalidInput("a mixture needs at least one stream.")
        relative = [s.weight == "proportion" for s in self.streams]
        if any(relative) and not all(relative):
            raise InvalidInput("proportions are relative and all-or-none: give every stream a proportion, or "
                               "use repeat/choose (absolute) for all of them.")
        if all(relative) and not sum(s.proportion for s in self.streams):  # type: ignore[misc]
            raise InvalidInput("the proportions sum to 0: give at least one stream a positive proportion.")
        absolute = any(s.weight in ("repeat", "choose") for s in self.streams)
        if self.epoch_size is not None:
            if absolute:
                raise InvalidInput("epoch_size is for proportions: with repeat/choose each stream's count is "
                                   "absolute already. Drop epoch_size, or weight by proportion.")
            if isinstance(self.epoch_size, int) and not isinstance(self.epoch_size, bool) and self.epoch_size == 0:
                raise InvalidInput("epoch_size=0 reads nothing: give the samples per epoch (>= 1), or None for the "
                                   "streams' sizes summed.")
            int_at_least(self.epoch_size, "epoch_size", 1)
        for i, (stream, count) in enumerate(zip(self.streams, self.counts(), strict=True)):
            if count and not stream.layout.n_samples:
                raise InvalidInput(f"stream {i} has no samples but is weighted to {count} per epoch: drop it, "
                                   "or weight it to 0.")

    def counts(self) -> tuple[int, ...]:
        """Each stream's samples per epoch."""
        sizes = [s.layout.n_samples for s in self.streams]
        if all(s.weight == "proportion" for s in self.streams):
            return apportion(self.epoch_size if self.epoch_size is not None else sum(sizes),
                             [Fraction(str(s.proportion)) for s in self.streams])
        if self.epoch_size is not None:  # no weights at all: by the streams' sizes
            return apportion(self.epoch_size, [Fraction(n) for n in sizes])
        return tuple(n if s.weight is None else s.choose if s.weight == "choose"  # type: ignore[misc]
                     else int(Fraction(str(s.repeat)) * n) for s, n in zip(self.streams, sizes, strict=True))

    @property
    def n_samples(self) -> int:
        """Samples per epoch, all streams together."""
        return sum(self.counts())


def int_at_least(value: Any, what: str, least: int) -> int:
    """``value``, an int (not a bool) >= ``least``, or :class:`InvalidInput` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidInput(f"{what} must be an int >= {least}, got {value!r}.")
    return value


def apportion(total: int, weights: list[Fraction]) -> tuple[int, ...]:
    """``total`` split in proportion to ``weights`` by largest remainder (ties: the earlier).

    >>> apportion(10, [Fraction(1), Fraction(1), Fraction(1)])
    (4, 3, 3)
    """
    whole = sum(weights)
    quotas = [total * w / whole for w in weights]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[:total - sum(counts)]:
        counts[i] += 1
    return tuple(counts)


def stream_seed(seed: int, stream: int) -> int:
    """The seed of stream ``stream``'s passes: drawn from (seed, stream), so streams of the same
    layout still take different orders."""
    return int(np.random.SeedSequence([seed, stream]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def stream_pieces(layout: UniformShards, seed: int, shuffle: bool, lo: int, hi: int) -> list[Piece]:
    """Positions ``[lo, hi)`` of a stream's endless sequence of passes, as shard pieces. A
    stream of one shard, or a whole pass of a small one, costs no permutation walk: a small stream
    upsampled many times over reads thousands of passes an epoch."""
    if layout.n_shards == 1:  # every pass is its one shard
        return [Piece(0, a, b) for _, a, b in laps(lo, hi, layout.n_samples)]
    out: list[Piece] = []
    for p, a, b in laps(lo, hi, layout.n_samples):
        order = _pass_order(layout.n_shards, seed, p, shuffle)
        if a == 0 and b == layout.n_samples:
            out += _whole_pass(layout, order)
        else:
            out += uniform_span_pieces(layout, order, a, b)
    return out


def _whole_pass(layout: UniformShards, order: ShardPermutation) -> list[Piece]:
    """Every shard of a pass, in its order, whole."""
    shards = order.shards(np.arange(layout.n_shards, dtype=np.int64)).tolist()
    last, short = layout.n_shards - 1, layout.n_samples - (layout.n_shards - 1) * layout.per_shard
    return [Piece(s, 0, short if s == last else layout.per_shard) for s in shards]


def stream_samples(mix: Mixture, stream: int, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The samples stream ``stream`` reads in epoch ``epoch`` (its positions ``[e * c, (e + 1) * c)``,
    ``c`` its count), in its passes' order: what a map-style view of the mixture's epoch reads
    (:class:`featstore.hf.SoftLabels` over a mixture)."""
    c, layout = mix.counts()[stream], mix.streams[stream].layout
    pieces = stream_pieces(layout, stream_seed(seed, stream), shuffle, epoch * c, (epoch + 1) * c)
    spp = layout.per_shard
    return np.concatenate([np.zeros(0, dtype=np.int64)] + [np.arange(p.shard * spp + p.lo, p.shard * spp + p.hi)
                                                            for p in pieces]).astype(np.int64, copy=False)


@functools.lru_cache(maxsize=64)
def _pass_order(n_shards: int, seed: int, p: int, shuffle: bool) -> ShardPermutation:
    """A stream's shard order in pass ``p``, kept for the few passes an epoch's windows read
    (each window asks for it again: drawing the round keys and locating the short shard once)."""
    return ShardPermutation(n_shards, seed, p, shuffle)


def mixture_share(mix: Mixture, *, seed: int, epoch: int, shuffle: bool, consumers: int, cid: int,
                  partition: Partition, window: int) -> Share:
    """The whole plan of consumer ``cid`` for one epoch of the mixture, as whole windows."""
    counts = mix.counts()
    m = sum(counts)
    start, stop = consumer_span(m, consumers, cid, partition)
    if not m:
        return Share(())
    bounds = np.array([*range(start, stop, max(1, window)), stop], dtype=np.int64)
    # Each stream's rows over the whole span are one run of its positions, planned at once (one
    # walk of each pass's permutation) and cut at the windows' bounds. Past the epoch's end
    # ("pad") the epoch's positions start again, and so do the stream's: its rows count on
    # (counts[s] a lap), its positions repeat.
    at = np.stack(interleave(list(counts), bounds % m)) + np.outer(counts, bounds // m)  # [streams, bounds]
    runs = []
    for s, stream in enumerate(mix.streams):
        base, sseed = epoch * counts[s], stream_seed(seed, s)
        pieces = [piece for _, a, b in laps(int(at[s, 0]), int(at[s, -1]), counts[s])
                  for piece in stream_pieces(stream.layout, sseed, shuffle, base + a, base + b)]
        runs.append(split_pieces(pieces, np.diff(at[s]).tolist()))
    windows = (Window(r, cid, k) for k, r in enumerate(zip(*runs, strict=True)))
    return Share(tuple(Slice(w, range(w.size)) for w in windows))
