"""The spans in flight: every stream's span of each window of a consumer's share read ahead, on
a thread pool (or in the calling thread when no core is spare and nothing is remote), one window
after another: what the reader cuts batches from.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from featstore.read.shards._gather import SpanRows
from featstore.read.shards._sources import Epoch, InThread, ShardSource, Span, SpanRead, spare_cores


@dataclass(frozen=True)
class StreamSources:
    """One stream's sources in this process (a version's arrays, or several teachers' under
    their labels), and what the rows' sample index is computed with."""

    sources: Sequence[ShardSource]
    samples_per_shard: int

    def index(self, span: Span) -> np.ndarray:
        """The sample index of each of ``span``'s rows, in read order."""
        spp = self.samples_per_shard
        return np.concatenate([np.zeros(0, dtype=np.int64)] + [np.arange(p.shard * spp + p.lo, p.shard * spp + p.hi,
                                                                         dtype=np.int64) for p in span.pieces])


#: Per stream, the span of one window to read (None: the window reads nothing of that stream).
Unit = tuple[Span | None, ...]
#: Per stream, the rows read of one unit (None where it read nothing), ``"index"`` among them.
UnitRows = list[dict[str, SpanRows] | None]


def spans_in_flight(streams: Sequence[StreamSources], reads: Executor, units: Iterable[Unit],
                    prefetch: int) -> Iterator[UnitRows]:
    """Keeps units (one window's spans of every stream) in flight over the streams' sources and
    yields each once all its reads are done (a window is permuted as a whole, so it is only
    usable once complete).

    Every (piece, array) is its own read, so one shard's arrays are fetched concurrently;
    ``reads`` (``prefetch`` pool threads) issues them. The next unit's reads are always in
    flight while the current one is consumed, so S3 latency hides behind Model B instead of
    adding up window by window. Every read decodes straight into its rows: no concatenation.
    """
    todo = iter(units)
    queue = deque[tuple[int, list[tuple[np.ndarray, list[SpanRead]] | None]]]()

    def fill() -> None:
        """Keep ``prefetch`` pieces in flight (the queued units'), and the next two units at least."""
        while sum(n for n, _ in queue) < prefetch or len(queue) < 2:
            unit = next(todo, None)
            if unit is None:
                return
            started = [None if span is None else (stream.index(span), [s.read(span, reads) for s in stream.sources])
                       for stream, span in zip(streams, unit, strict=True)]
            queue.append((sum(len(span.pieces) for span in unit if span is not None), started))

    current: list[SpanRead] = []
    try:
        fill()
        while queue:
            _, started = queue.popleft()
            rows: UnitRows = []
            current = [r for got in started if got is not None for r in got[1]]
            for got in started:
                arrays: dict[str, SpanRows] | None = None
                if got is not None:
                    arrays = {"index": got[0]}
                    for r in got[1]:
                        arrays.update(r.result())
                rows.append(arrays)
            fill()
            yield rows
            for r in current:  # the consumer has cut every batch of this unit
                r.close()
            current = []
    finally:
        for r in current:
            r.close()
        for _, queued in queue:  # an abandoned epoch: do not read what nobody will use
            for got in queued:
                for r in () if got is None else got[1]:
                    r.close()


def read_spans(streams: Sequence[StreamSources], epochs: Sequence[Epoch], units: Iterable[Unit],
               prefetch: int) -> Iterator[UnitRows]:
    """The epoch's units from the streams' sources (``epochs``: what each stream's sources learn
    when the iteration starts), read ahead on a pool of ``prefetch`` threads, or in the calling
    thread when no core is spare and nothing is remote: pool threads would only take turns with
    Model B's torch threads (measured slower)."""
    begun: list[ShardSource] = []
    finished = False
    try:
        for stream, epoch in zip(streams, epochs, strict=True):
            for s in stream.sources:
                s.begin(epoch)
                begun.append(s)
        here = spare_cores() < 1 and all(s.near(epoch.todo) for stream, epoch in zip(streams, epochs, strict=True)
                                         for s in stream.sources)
        with InThread() if here else ThreadPoolExecutor(prefetch, thread_name_prefix="featstore-read") as reads:
            yield from spans_in_flight(streams, reads, units, prefetch)
        finished = True
    finally:
        for s in begun:
            s.end(finished)
