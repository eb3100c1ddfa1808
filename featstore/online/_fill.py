"""Fill as you train: the shards an online reader computes become the version.

Every (rank, DataLoader worker) consumer reads one contiguous span of the epoch's shard order
(:mod:`featstore.read.plans._assignment`). A shard's first row lies in exactly one consumer's span: that consumer
*owns* the shard for the epoch (:func:`owned`) and is the only one that writes it, with the
writer's own shard write (:mod:`featstore.compute._shard_writing`: the same arrays, crc32c and receipts as
``store.compute``). A consumer that reads only the tail of a shard another one
owns computes those rows for itself and writes nothing, so no two consumers of a run ever write
the same object (and a shard is never written from two floating-point histories).

The commit: after writing the last shard it owns in the epoch, a consumer lists the receipts (one
LIST, no GET); whoever sees the last unit's receipt commits
(:func:`featstore.compute._driver.commit_run`, what ``compute`` ends with). Two consumers (or two
runs) that both see it both commit: the manifest is created if absent, so one wins and the other
adopts it (same fingerprint). Every consumer also tries at the end of each of its epochs, so a run
killed between the last receipt and the commit commits on the next epoch or run. A killed run
leaves receipts: the next run reads those shards and computes the rest.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from featstore.errors import ComputeFailed
from featstore.online._teacher import Planned
from featstore.read import Piece
from featstore.storage import Storage
from featstore.versions import Catalog
from featstore.versions import StoredVersion
from featstore.versions import view_key
from featstore.versions import finished_shards

log = logging.getLogger("featstore")


def owned(pieces: Iterable[Piece], start: int, n: int) -> list[bool]:
    """Whether the consumer whose span starts at position ``start`` owns each of its
    ``pieces`` (in plan order): it holds the shard's first row, at a position below ``n`` (a
    ``"pad"`` span that wraps around reads some shards a second time; their owner is the
    consumer that reads them first).

    >>> owned([Piece(3, 5, 10), Piece(1, 0, 10), Piece(0, 0, 4)], 15, 30)
    [False, True, True]
    >>> owned([Piece(1, 0, 10), Piece(0, 0, 4)], 25, 30)  # position 30 wraps to 0
    [True, False]
    """
    out, pos = [], start
    for p in pieces:
        out.append(p.lo == 0 and pos < n)
        pos += p.size
    return out


@dataclass
class FillState:
    """One process's view of what is stored: the finished units (refreshed by a listing at
    each iteration's start and after each shard it writes) and whether the version committed."""

    done: dict[int | None, set[int]] = field(default_factory=dict)  # view (None: no views) -> shards
    committed: bool = False

    def refresh(self, storage: Storage, version: StoredVersion, views: Sequence[int | None]) -> None:
        """List the receipts of each of ``views``' groups (one LIST page per 1,000 shards) with
        this process's ``storage``."""
        for v in views:
            self.done[v] = finished_shards(storage, view_key(version.key, v))

    def holds(self, view: int | None, shard: int) -> bool:
        return shard in self.done.get(view, set())

    def add(self, view: int | None, shard: int) -> None:
        self.done.setdefault(view, set()).add(shard)

    def complete(self, n_shards: int, views: Sequence[int | None]) -> bool:
        """Whether every unit of the version has a receipt (as last listed)."""
        return all(set(range(n_shards)) <= self.done.get(v, set()) for v in views)


@dataclass(frozen=True)
class ShardUnit:
    """One unit a fill writes: shard ``shard`` of view ``view`` (None: a version without views)."""

    view: int | None
    shard: int


#: Shard writes a consumer keeps in flight: A's next shard is computed while the last one is
#: written; a third waits for the oldest (its buffers are the shard's rows: memory stays bounded).
WRITES_IN_FLIGHT = 2


class ShardWrites:
    """One consumer's shard writes on a background thread of its own, so A computes the next
    shard while the last one is encoded, compressed and stored (zstd, crc32c and file or
    socket writes release the GIL); a write's error is raised in the consumer, by the next
    :meth:`submit`, :meth:`finished` or :meth:`drain` (unless ``quietly``).

    >>> writes = ShardWrites()
    >>> writes.submit(ShardUnit(None, 7), print, "shard 7 written")  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="featstore-fill")  # its thread starts on the first write
        self._pending: deque[tuple[ShardUnit, Future[object]]] = deque()

    def submit(self, key: ShardUnit, fn: Callable[..., object], *args: object) -> list[ShardUnit]:
        """Start ``fn(*args)``; returns the keys of the writes that finished meanwhile (waiting
        for the oldest while :data:`WRITES_IN_FLIGHT` are pending)."""
        done: list[ShardUnit] = []
        while len(self._pending) >= WRITES_IN_FLIGHT:
            done.append(self._take_oldest())
        self._pending.append((key, self._pool.submit(fn, *args)))
        return done + self.finished()

    def finished(self) -> list[ShardUnit]:
        """The keys of the writes finished so far, oldest first (not waiting)."""
        done: list[ShardUnit] = []
        while self._pending and self._pending[0][1].done():
            done.append(self._take_oldest())
        return done

    def drain(self, quietly: bool = False) -> list[ShardUnit]:
        """Wait for every pending write; the keys of those that succeeded. ``quietly``, for an
        epoch that ends with an error (or is abandoned): a failed write is logged, not raised,
        as the epoch's own error is what the caller sees."""
        done: list[ShardUnit] = []
        while self._pending:
            try:
                done.append(self._take_oldest())
            except Exception as exc:  # noqa: BLE001 - quietly: logged; the epoch's own error propagates
                if not quietly:
                    raise
                log.warning("featstore: a shard write of an abandoned epoch failed: %s", exc)
        return done

    def _take_oldest(self) -> ShardUnit:
        key, fut = self._pending.popleft()
        fut.result()
        return key


def try_commit(catalog: Catalog, planned: Planned, state: FillState) -> bool:
    """Commit the version if every unit of every view has a receipt (listing them first); True
    once committed.

    A commit racing another consumer's (or another run's) adopts the winner's manifest; what
    the commit refuses (a hole, a gc's mark) is logged and retried at the next epoch, while
    training goes on reading what is stored.
    """
    from featstore.compute import commit_run

    if state.committed:
        return True
    if planned.claim is None:  # only a fill claims the version's folder: a reader that only reads commits nothing
        return False
    views: list[int | None] = [None] if planned.version.views is None else list(range(planned.version.views))
    state.refresh(catalog.storage, planned.version, views)
    if not state.complete(planned.version.manifest.layout.n_shards, views):
        return False
    if catalog.committed(planned.plan.name, planned.vid) is None:
        try:
            commit_run(catalog, planned.plan, planned.claim, [], {"filled": 1.0})
        except ComputeFailed as exc:  # a hole or a gc's mark: its receipts are gone, it is computed again
            log.warning("featstore: %s was not committed yet (%s); it is retried at the next epoch",
                        planned.version.ref, exc)
            return False
        log.info("featstore: filled and committed %s", planned.version.ref)
    state.committed = True
    return True
