"""Elastic resume: what an interrupted run read of an epoch, and the rest spread over any split.

DDP ranks step together, so what any one rank saves at a step describes the whole job: the
epoch, how the epoch was first planned (:class:`EpochOrder`: the layout or mixture, seed,
shuffle, window) and, for each *segment* of the epoch run under one split (:class:`Split`: world
size, DataLoader workers per rank, batch size per rank, partition, drop_last), the batches each
rank consumed in it (:class:`Segment`). That is the whole state (:class:`ResumeState`), a few
integers per segment, whatever the position in the epoch.

From it, the rest of the epoch under any split:

1. **Segment 0 is the epoch's plan**: consumer ``c`` (rank ``c // W``, worker ``c % W``) yields
   its :func:`epoch_share` (:func:`~featstore.read.consumer_plan` for a version,
   :func:`~featstore.read.plans._mixture.mixture_share` for a mixture) as window slices
   (:mod:`featstore.read.plans._slices`).
2. **What each consumer of a segment yielded** (:func:`progress`, arithmetic on counts): each
   consumer's share has ``n_c`` rows (its span's length), so ``ceil(n_c / batch)`` batches
   (``floor`` with drop_last); a rank's DataLoader takes its workers' batches in turn from worker
   0, skipping a worker once it is exhausted, so after ``k`` batches its worker ``w`` had
   yielded :func:`~featstore.read.plans._assignment.round_robin_consumed` ``(k, counts)[w]`` batches:
   the first ``t_c = min(batches * batch, n_c)`` rows of its share. Had the run gone on it would
   have yielded ``y_c = n_c`` rows (drop_last: ``n_c`` rounded down to whole batches).
3. **The remaining sequence** of a segment is every consumer's rows ``[t_c, y_c)``, consumer
   after consumer: ``R`` rows, each a not-yet-yielded row of the epoch, in an order fixed by the
   segment. The next segment splits it as an epoch is split: consumer ``c'`` of the new split
   takes the span ``consumer_span(R, consumers', c', partition')`` of it (``"pad"`` wraps to the
   sequence's start, ``"drop"`` leaves out its last ``R mod C'``; ``"even"`` reads each once) -
   slices of the windows the rows came from, each keeping its window's order. So every remaining
   row is read exactly once under ``"even"``, none of the yielded ones again, and each rank gets
   the same number of batches under ``"pad"``/``"drop"``, as in a whole epoch.
4. **Only what a consumer needs is built** (:func:`segment_share`): its span of the remaining
   sequence overlaps a few consumers of the previous segment (found from the prefix sums of
   ``y_c - t_c``), and only their shares are built, recursively down to segment 0's plans. So a
   resume costs the same at 10% and at 90% of an epoch: counts, then a few consumers' plans.

**Resuming** (:func:`resume`): under the split of the state's last segment (0 and 1 DataLoader
workers are one split: one consumer per rank), each worker continues that segment as the
uninterrupted run would have, in the original order: the DataLoader's round robin restarts at
worker 0, which plays the role of the worker the run would have read next
(:func:`~featstore.read.plans._assignment.rotated`). Under any other split a new segment starts. The run
then saves :meth:`ResumeState.advanced` by the batches each rank consumed since (a split that
consumed none is not recorded: it changed nothing). The next epoch is a whole epoch.

**The global batch** (ranks x batch per rank) stays the same across segments: a resumed job keeps
its optimisation schedule. Where the saved global batch does not divide over the new world size,
no split can keep it, and :func:`resume` says so (:class:`~featstore.errors.InvalidInput`). The
arithmetic itself is exact for any batch size.

**Reading cost.** A slice of a shuffled window needs the whole window read: the window each
interrupted consumer was in is read again for its unread rows, and a window the new split cuts
is read by both consumers. That is at most one window per consumer of either split per resume,
whatever the epoch's size. Unshuffled, a slice reads only its rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from featstore.errors import InvalidInput
from featstore.read.plans._assignment import (PARTITIONS, Partition, UniformShards, consumer_plan, consumer_span, laps,
                                              rotated, round_robin_consumed)
from featstore.read.plans._mixture import MixStream, Mixture, int_at_least, mixture_share
from featstore.read.plans._slices import Share, Slice, whole

SCHEMA = "featstore.epoch_progress"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Split:
    """How one run splits an epoch: ranks, DataLoader workers per rank (0: the rank's own
    process), batch size per rank, partition and drop_last."""

    world: int
    workers: int
    batch_size: int
    partition: Partition = "even"
    drop_last: bool = False

    def __post_init__(self) -> None:
        for name, least in (("world", 1), ("workers", 0), ("batch_size", 1)):
            int_at_least(getattr(self, name), name, least)
        if self.partition not in PARTITIONS:
            raise InvalidInput(f"partition must be one of {PARTITIONS}, got {self.partition!r}.")
        if not isinstance(self.drop_last, bool):
            raise InvalidInput(f"drop_last must be a bool, got {self.drop_last!r}.")

    def continues(self, other: Split) -> bool:
        """Whether this split reads ``other``'s plan: the same but for 0 or 1 DataLoader workers
        (one consumer per rank either way)."""
        return replace(self, workers=self.per_rank) == replace(other, workers=other.per_rank)

    @property
    def per_rank(self) -> int:
        """Consumers per rank: its DataLoader workers, or the rank itself."""
        return max(1, self.workers)

    @property
    def consumers(self) -> int:
        return self.world * self.per_rank

    @property
    def global_batch(self) -> int:
        return self.world * self.batch_size


@dataclass(frozen=True)
class EpochOrder:
    """What fixes an epoch's plan besides the split: the version's layout or the mixture, the
    seed, shuffle, and the shuffle window in samples."""

    source: UniformShards | Mixture
    seed: int
    shuffle: bool
    window: int

    def __post_init__(self) -> None:
        int_at_least(self.window, "the shuffle window", 1)


@dataclass(frozen=True)
class Segment:
    """Part of an epoch run under one split: the batches each rank consumed in it."""

    split: Split
    batches: int


@dataclass(frozen=True)
class ResumeState:
    """Where a job is in an epoch (see the module docstring); JSON-able with :meth:`to_dict`."""

    epoch: int
    order: EpochOrder
    segments: tuple[Segment, ...] = ()

    @property
    def steps(self) -> int:
        """Steps of the epoch so far: each rank's batches, all segments together."""
        return sum(s.batches for s in self.segments)

    def advanced(self, split: Split, batches: int) -> ResumeState:
        """The state after each rank consumed ``batches`` more under ``split``: the last
        segment's count grows under its own split, another split starts a segment (none for 0
        batches: a split that read nothing changes nothing)."""
        if batches < 0:
            raise InvalidInput(f"batches must be >= 0, got {batches}.")
        if not batches:
            return self
        if self.segments and self.segments[-1].split.continues(split):
            last = self.segments[-1]
            return replace(self, segments=(*self.segments[:-1], Segment(last.split, last.batches + batches)))
        return replace(self, segments=(*self.segments, Segment(split, batches)))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types, versioned."""
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "epoch": self.epoch,
                "order": _order_dict(self.order),
                "segments": [{**asdict(s.split), "batches": s.batches} for s in self.segments]}

    @classmethod
    def from_dict(cls, data: Any) -> ResumeState:
        """The state :meth:`to_dict` wrote, or :class:`InvalidInput` saying what is wrong."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise InvalidInput(f"not a featstore epoch state (no schema {SCHEMA!r}): pass what state_dict() saved.")
        if not isinstance(data.get("schema_version"), int) or data["schema_version"] > SCHEMA_VERSION:
            raise InvalidInput(f"this epoch state has schema version {data.get('schema_version')!r}; this "
                               f"featstore reads version {SCHEMA_VERSION} and older: upgrade featstore to resume it.")
        try:
            order = _order_from(data["order"])
            segments = tuple(Segment(Split(s["world"], s["workers"], s["batch_size"], s["partition"], s["drop_last"]),
                                     _count(s["batches"], "batches")) for s in data["segments"])
            return cls(_count(data["epoch"], "epoch"), order, segments)
        except (KeyError, TypeError) as exc:
            raise InvalidInput(f"this epoch state is incomplete or damaged ({exc!r}): pass what state_dict() "
                               "saved, or start the epoch over.") from exc


def _count(value: Any, name: str) -> int:
    return int_at_least(value, f"the epoch state's {name}", 0)


def _layout_from(data: dict[str, Any]) -> UniformShards:
    n, per = _count(data["n_samples"], "n_samples"), _count(data["per_shard"], "per_shard")
    if not per:
        raise InvalidInput("the epoch state's per_shard must be >= 1.")
    return UniformShards(n, per)


def _order_dict(order: EpochOrder) -> dict[str, Any]:
    src = order.source
    if isinstance(src, Mixture):
        source: dict[str, Any] = {"mixture": {"epoch_size": src.epoch_size, "streams": [
            {**asdict(s.layout), "proportion": s.proportion, "repeat": s.repeat, "choose": s.choose}
            for s in src.streams]}}
    else:
        source = {"version": asdict(src)}
    return {"seed": order.seed, "shuffle": order.shuffle, "window": order.window, "source": source}


def _order_from(data: dict[str, Any]) -> EpochOrder:
    src = data["source"]
    if "mixture" in src:
        mix = src["mixture"]
        source: UniformShards | Mixture = Mixture(tuple(
            MixStream(_layout_from(s), s["proportion"], s["repeat"], s["choose"]) for s in mix["streams"]),
            mix["epoch_size"])
    else:
        source = _layout_from(src["version"])
    if not isinstance(data["shuffle"], bool):
        raise InvalidInput(f"the epoch state's shuffle must be a bool, got {data['shuffle']!r}.")
    return EpochOrder(source, _count(data["seed"], "seed"), data["shuffle"], data["window"])


def check_same_order(saved: EpochOrder, now: EpochOrder) -> None:
    """Refuse to resume an epoch planned otherwise than this reader would plan it: the rest
    would be read from the saved plan, and the next epochs from another (:class:`InvalidInput`)."""
    differ = [f"{k}={getattr(saved, k)!r} (now {getattr(now, k)!r})" for k in ("source", "seed", "shuffle", "window")
              if getattr(saved, k) != getattr(now, k)]
    if differ:
        raise InvalidInput(f"the saved epoch was planned with other data or options: {', '.join(differ)}. Resume "
                           "with the saved version, seed, shuffle and shuffle_window, or start the epoch over.")


def check_global_batch(saved: Split, now: Split) -> None:
    """Refuse a split whose global batch (ranks x batch per rank) is not the saved one's, saying
    which batch size keeps it, or that none can (:class:`InvalidInput`)."""
    g = saved.global_batch
    if now.global_batch == g:
        return
    was = f"the saved run's global batch is {g} ({_ranks(saved.world)} x batch_size={saved.batch_size})"
    if g % now.world:
        fits = [w for w in range(1, g + 1) if g % w == 0]
        raise InvalidInput(f"{was}, which does not divide over {_ranks(now.world)}, so no batch size resumes it "
                           f"exactly: resume on a world size that divides {g} ({', '.join(map(str, fits[:12]))}"
                           f"{', ...' if len(fits) > 12 else ''}), or start the epoch over.")
    raise InvalidInput(f"{was}; {_ranks(now.world)} x batch_size={now.batch_size} is {now.global_batch}: resume "
                       f"with batch_size={g // now.world} to keep it.")


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


# -- the arithmetic -----------------------------------------------------------------------------
def epoch_share(order: EpochOrder, epoch: int, split: Split, cid: int) -> Share:
    """Consumer ``cid``'s share of an uninterrupted epoch under ``split``: one plan for a
    version and for a mixture."""
    kw = dict(seed=order.seed, epoch=epoch, shuffle=order.shuffle, consumers=split.consumers, cid=cid,
              partition=split.partition, window=order.window)
    if isinstance(order.source, Mixture):
        return mixture_share(order.source, **kw)  # type: ignore[arg-type]
    return whole(consumer_plan(order.source, **kw), cid)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Progress:
    """How far each consumer of one segment got, in rows of its share.

    Attributes:
        split: the segment's split.
        counts: each consumer's batches, had the segment run to the epoch's end.
        yielded: rows each consumer yielded (``t_c``).
        ends: rows each would have yielded by the epoch's end (``y_c``).
    """

    split: Split
    counts: np.ndarray
    yielded: np.ndarray
    ends: np.ndarray

    @property
    def offsets(self) -> np.ndarray:
        """Where each consumer's unread rows start in the remaining sequence (and its length last)."""
        return np.concatenate([[0], np.cumsum(self.ends - self.yielded)]).astype(np.int64)


def span_sizes(n: int, split: Split) -> np.ndarray:
    """Each consumer's rows when ``n`` are split under ``split``."""
    spans = [consumer_span(n, split.consumers, c, split.partition) for c in range(split.consumers)]
    return np.array([stop - start for start, stop in spans], dtype=np.int64)


def progress(order: EpochOrder, segments: tuple[Segment, ...]) -> list[Progress]:
    """Each segment's :class:`Progress` (O(consumers) arithmetic per segment)."""
    out: list[Progress] = []
    n = order.source.n_samples  # positions: a mixture's repeats count
    for i, seg in enumerate(segments):
        split, bs = seg.split, seg.split.batch_size
        sizes = span_sizes(n, split)
        counts = sizes // bs if split.drop_last else -(-sizes // bs)
        per_rank = counts.reshape(split.world, split.per_rank)
        most = int(per_rank.sum(axis=1).max())
        if seg.batches > most:
            raise InvalidInput(f"the epoch state says {seg.batches} batches per rank in segment {i} "
                               f"({split.world} ranks x {split.workers} workers), but a rank has at most {most} "
                               "there: the state is not of this epoch's plan. Start the epoch over.")
        # DDP ranks step together; under "even" a rank with fewer batches had run out.
        batches = np.array([round_robin_consumed(min(seg.batches, int(row.sum())), row.tolist())
                            for row in per_rank], dtype=np.int64).reshape(-1)
        yielded = np.minimum(batches * bs, sizes)
        ends = sizes // bs * bs if split.drop_last else sizes
        out.append(Progress(split, counts, yielded, ends))
        n = int((ends - yielded).sum())
    return out


def segment_share(order: EpochOrder, epoch: int, done: list[Progress], split: Split, cid: int,
                  memo: dict[tuple[int, int], Share] | None = None) -> Share:
    """Consumer ``cid``'s whole share in a segment under ``split`` that follows the segments of
    ``done`` (see the module docstring, step 4). ``memo``: the earlier segments' shares already
    built from the same ``done`` (by segment and consumer), so that none is built twice."""
    if not done:
        return epoch_share(order, epoch, split, cid)
    memo = {} if memo is None else memo
    last = done[-1]
    offsets = last.offsets
    total = int(offsets[-1])
    start, stop = consumer_span(total, split.consumers, cid, split.partition)
    slices: list[Slice] = []
    for _, a, b in laps(start, stop, total):  # a "pad" span wraps around to the remaining sequence's start
        c = int(np.searchsorted(offsets, a, side="right")) - 1
        while c < len(offsets) - 1 and offsets[c] < b:
            lo, hi = max(a, int(offsets[c])) - int(offsets[c]), min(b, int(offsets[c + 1])) - int(offsets[c])
            if lo < hi:
                key = (len(done) - 1, c)
                if key not in memo:
                    memo[key] = segment_share(order, epoch, done[:-1], last.split, c, memo)
                t = int(last.yielded[c])
                slices += memo[key].rows(t + lo, t + hi).slices
            c += 1
    return Share(tuple(slices))


@dataclass(frozen=True)
class Resumed:
    """Where one consumer (rank, worker) of a resumed epoch starts.

    Attributes:
        role: the consumer of its rank it plays (its worker id, rotated when continuing a segment).
        skipped: batches of that role yielded before (continuing a segment; else 0).
        share: what it yields from here to the epoch's end (cut into batches as usual).
    """

    role: int
    skipped: int
    share: Share


def resume(state: ResumeState, split: Split, rank: int, worker: int) -> Resumed:
    """Where worker ``worker`` of rank ``rank`` starts the state's epoch under ``split``.

    Raises :class:`InvalidInput` where the split cannot keep the saved global batch, or the state
    is not of its own plan."""
    if not (0 <= rank < split.world and 0 <= worker < split.per_rank):
        raise InvalidInput(f"rank {rank}, worker {worker} is not in {split.world} ranks x {split.workers} workers.")
    order, epoch, segs = state.order, state.epoch, state.segments
    if segs:
        check_global_batch(segs[0].split, split)
    if segs and segs[-1].split.continues(split):
        done = progress(order, segs)
        first = rank * split.per_rank
        counts = done[-1].counts[first:first + split.per_rank].tolist()
        role, skipped = rotated(worker, split.workers, min(segs[-1].batches, sum(counts)), counts)
        full = segment_share(order, epoch, done[:-1], split, first + role)
        return Resumed(role, skipped, full.rows(int(done[-1].yielded[first + role]), full.n_samples))
    return Resumed(worker, 0, segment_share(order, epoch, progress(order, segs), split, rank * split.per_rank + worker))


def remaining_samples(state: ResumeState) -> int:
    """Rows of the state's epoch not yet yielded (0: the epoch is over, the next is whole)."""
    if not state.segments:
        return state.order.source.n_samples
    return int(progress(state.order, state.segments)[-1].offsets[-1])
