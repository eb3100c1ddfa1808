"""What a FeatureDataset shares with its DataLoader workers: epochs, resume point, placement.

With ``persistent_workers=True`` each DataLoader worker keeps its own copy of the dataset for the
whole run, and without it every epoch's workers are fresh copies: either way ``set_epoch()`` and
``load_state_dict()`` in the training process, and the epoch count itself, must reach them. So
these few integers live in one small shared-memory tensor (:class:`SharedProgress`) that the
training process and its workers see.

**The epoch, without set_epoch.** Every new iteration of the dataset reads the next epoch: a
plain ``iter(ds)`` in a process, or one DataLoader iteration (all its workers together). The first
iteration after building the dataset, ``set_epoch(e)`` or ``load_state_dict()`` reads that epoch
(0, ``e``, the state's); each later one reads the previous iteration's epoch + 1. DataLoader
workers recognise the iteration they belong to by a key: the DataLoader's base seed (the same for
every worker of one DataLoader iterator, drawn afresh for each iterator) with the number of
iterations this worker process has started (which tells a persistent worker's epochs apart). The
first worker of an iteration to start records (key, epoch) in a small ring; the others find it
there, in whatever order they start (two starting at the same moment may each record one, the
later one the epoch after the earlier's: each then takes the key's oldest record). Every write
is one aligned 64-bit word, so a worker reads a record whole or not at all.

A fresh worker (its process's first iteration) belongs to the DataLoader iterator that started
it: the training process stamps each worker's copy, just before it forks or pickles it, with the
generation of ``set_epoch`` calls and the epoch a new iteration would read then
(:meth:`SharedProgress.stamp`). So a ``set_epoch`` made while the workers are still starting up
(Lightning calls ``on_train_epoch_start`` after it started the first epoch's loader) is for the
next iteration, and a late worker of an abandoned iterator cannot take the next iteration's epoch
or resume point. Persistent workers' later iterations see ``set_epoch`` as it is when they start.

A fresh worker that finds its key recorded by another process *in its own slot* cannot tell a new
iteration from the last one (the DataLoader drew the same base seed twice: re-seeded before each
epoch); it raises :class:`~featstore.InvalidInput` asking for ``set_epoch`` rather than read the
last epoch again.

**Atomic updates.** The workers of two DataLoaders over one dataset start at once and each
loader's first worker appends its record: every read-modify-write of the block (the ring's
counter, the generation) is one critical section under a ``flock`` on a file of the block's own,
which each process that shares the block opens by name (fork, spawn and forkserver alike), with
a thread lock for the threads of one process (a lost update of the counter loses a loader's
record, and its workers then read the other loader's epoch: tests/read/test_clients.py).

**Ownership.** A block belongs to one process (its owner) and that process's DataLoader workers.
``ddp_spawn`` pickles a dataset built before the spawn into every rank, and torch shares a shared
tensor with whoever unpickles it; so the first time a process that is not a DataLoader worker uses
a block it does not own, it takes a copy of its own (:meth:`SharedProgress.own`), and so does every
process just before it forks (``os.register_at_fork``), so that forked workers share their parent's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import get_worker_info

from featstore.errors import InvalidInput
from featstore.read.shards import held_open, process_local, shm_root
from featstore.read.state._ranks import Placement

# header words
OWNER, GEN, BASE, RESUME_GEN, RESUME_SEEN, RESUME_WORKERS, LAST_WORKERS, RANK, WORLD, SOURCE, RING_NEXT = range(11)
HEADER = 16
#: Iterations remembered, so the workers of several loaders over one dataset still find theirs.
RING = 8
#: DataLoader worker slots (slot 0 is the process itself, without workers).
MAX_WORKERS = 512
SLOTS = HEADER + RING
SIZE = SLOTS + 2 * (MAX_WORKERS + 1)
#: Epochs are stored in 31 bits of a record word.
MAX_EPOCH = 2**31 - 1
_KEY_BITS = 22


@dataclass(frozen=True)
class Start:
    """How an iteration starts: its epoch, and the rank-level resume point that applies to it
    (batches seen this epoch and the DataLoader workers it was saved with; None: none)."""

    epoch: int
    resume_seen: int | None = None
    resume_workers: int | None = None


def _pack(key: int, first: bool, gen: int, epoch: int) -> int:
    return (key << 40) | (int(first) << 39) | ((gen & 0xFF) << 31) | epoch


def _unpack(word: int) -> tuple[int, bool, int, int]:
    return word >> 40, bool((word >> 39) & 1), (word >> 31) & 0xFF, word & MAX_EPOCH


def iteration_key(base_seed: int, count: int) -> int:
    """A nonzero 22-bit key for a DataLoader worker's iteration: its loader iterator's base seed
    and this worker process's iteration count (splitmix64)."""
    z = (base_seed * 0x9E3779B97F4A7C15 + count * 0xBF58476D1CE4E5B9 + 1) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return int((z ^ (z >> 31)) % (2**_KEY_BITS - 1) + 1)


def in_worker() -> bool:
    """Whether this code runs inside a DataLoader worker."""
    return get_worker_info() is not None


class SharedProgress:
    """The shared integers of one dataset (see the module docstring for the rules)."""

    def __init__(self) -> None:
        self._mine(torch.zeros(SIZE, dtype=torch.int64))
        self._t[RESUME_GEN] = -1

    def _mine(self, t: torch.Tensor) -> None:
        """Make ``t`` this process's block, with a lock file of its own."""
        self._t = t.share_memory_()
        self._t[OWNER] = os.getpid()
        process_local(("progress locks swept",), _sweep_dead_locks)  # once per process
        self._lock_path = os.path.join(shm_root(), f"{_LOCK_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}.lock")
        weakref.finalize(self, _remove_lock, self._lock_path, os.getpid())
        self._held: tuple[int, int, threading.Lock] | None = None

    def own(self) -> None:
        """Take a private copy unless this process owns the block (or is a DataLoader worker,
        which shares its parent's)."""
        if in_worker() or (int(self._t[OWNER]) == os.getpid() and self._t.is_shared()):
            return
        with self._locked():
            mine = self._t.clone()
        self._mine(mine)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_held": None}  # the lock file's fd stays in its process

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the block's lock (every process that shares the block opens its file by name)."""
        if self._held is None or self._held[0] != os.getpid():  # a forked child opens its own
            self._held = (os.getpid(), held_open(self._lock_path, os.O_RDWR | os.O_CREAT), threading.Lock())
        _, fd, lock = self._held
        with lock:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _get(self, i: int) -> int:
        return int(self._t[i])

    def _set(self, i: int, value: int) -> None:
        self._t[i] = int(value)

    # -- epochs ---------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The next new iteration reads ``epoch``; a resume point saved for that same epoch
        still applies to it (``load_state_dict`` then ``set_epoch`` with the state's epoch)."""
        self.own()
        epoch = check_epoch(epoch)
        with self._locked():
            self._new_epoch(epoch)

    def _new_epoch(self, epoch: int) -> None:
        keep = self._get(RESUME_GEN) == self._get(GEN) and self._get(BASE) == epoch
        self._set(BASE, epoch)
        self._set(GEN, self._get(GEN) + 1)
        self._set(RESUME_GEN, self._get(GEN) if keep else -1)

    def set_resume(self, epoch: int, seen: int, workers: int | None) -> None:
        """The next new iteration reads ``epoch`` and skips the ``seen`` batches of this rank."""
        self.own()
        epoch = check_epoch(epoch)
        with self._locked():
            self._set(RESUME_SEEN, seen)
            self._set(RESUME_WORKERS, 0 if workers is None else workers + 1)
            self._new_epoch(epoch)
            self._set(RESUME_GEN, self._get(GEN))

    def current_epoch(self) -> int:
        """The epoch of the latest iteration since the last ``set_epoch``, else the one the next
        will read."""
        with self._locked():
            latest = self._latest(self._get(GEN))
            return self._get(BASE) if latest is None else latest

    def _latest(self, gen: int) -> int | None:
        """The epoch of the ring's latest record when it is of generation ``gen`` (else None)."""
        latest = next(reversed(self._records()), None)
        return latest[3] if latest is not None and latest[2] == gen & 0xFF else None

    def _records(self) -> list[tuple[int, bool, int, int]]:
        """The ring's records, oldest first (a refused iteration's record is 0: left out)."""
        n = self._get(RING_NEXT)
        words = [self._get(HEADER + i % RING) for i in range(max(0, n - RING), n)]
        return [_unpack(w) for w in words if w]

    def stamp(self) -> tuple[int, int]:
        """(generation, the epoch a new iteration would read now): what a DataLoader worker's
        copy records when the training process starts it (see :meth:`begin`)."""
        with self._locked():
            gen = self._get(GEN)
            return gen, self._next(gen)[0]

    def _next(self, gen: int) -> tuple[int, bool]:
        """The epoch of a new iteration in generation ``gen``, and whether it is the first."""
        latest = self._latest(gen)
        return (self._get(BASE), True) if latest is None else (min(latest + 1, MAX_EPOCH), False)

    def begin(self, slot: int, key: int | None = None, fresh: bool = True, epoch: int | None = None,
              started: tuple[int, int] | None = None, check: Callable[[Start], None] | None = None) -> Start:
        """Start an iteration in ``slot`` (0: this process; 1 + worker id) and say its epoch.

        ``key``: the DataLoader iteration's key (None: a process's own iteration, always new);
        ``fresh``: the worker process starts its first iteration; ``epoch``: fixed by the
        worker's own resume state (torchdata), recorded for the iterations after it;
        ``started``: the worker's :meth:`stamp` from when it was started. A fresh worker belongs
        to the DataLoader iterator that started it: a ``set_epoch`` while it was still starting
        up is for the next iterator, and a worker of an abandoned iterator that starts late must
        not take the next iteration's epoch or resume point. ``check(start)`` may refuse the
        iteration before anything is recorded.
        """
        if slot > MAX_WORKERS:
            raise InvalidInput(f"featstore supports at most {MAX_WORKERS} DataLoader workers.")
        with self._locked():
            return self._begin(slot, key, fresh, epoch, started, check)

    def _begin(self, slot: int, key: int | None, fresh: bool, epoch: int | None, started: tuple[int, int] | None,
               check: Callable[[Start], None] | None) -> Start:
        now = self._get(GEN)
        gen = started[0] if fresh and started is not None else now
        found = None if key is None or epoch is not None else self._find(key, gen)
        if epoch is not None:
            e, first = epoch, False
        elif found is not None:
            self._check_slot(slot, key, gen, fresh)
            e, first = found
        elif gen != now:  # started before the latest set_epoch: the epoch it was started for
            e, first = started[1], False  # type: ignore[index]
        else:
            e, first = self._next(gen)
        mine = None
        if found is None and key is not None:
            # Under the lock no other worker records between our lookup and our record; should
            # one have (a lock file removed under a running job), each still takes the
            # iteration's oldest record: the same for all of them.
            mine = self._record(_pack(key, first, gen, e))
            e, first = self._find(key, gen) or (e, first)
            if _pack(key, first, gen, e) != mine[1]:  # ours is the later: it says the same now
                mine = self._rerecord(*mine, _pack(key, first, gen, e))
        start = Start(e)
        if first and self._get(RESUME_GEN) == gen:
            workers = self._get(RESUME_WORKERS)
            start = Start(e, self._get(RESUME_SEEN), workers - 1 if workers else None)
        if check is not None:
            try:
                check(start)
            except BaseException:
                if mine is not None:  # refused: as if never started (the others are refused alike)
                    self._rerecord(*mine, 0)
                raise
        if key is None:
            self._record(_pack(_own_key(), first, gen, e))
        self._set(SLOTS + 2 * slot + 1, os.getpid())
        self._set(SLOTS + 2 * slot, _pack(key or 0, first, gen, e))
        return start

    def _find(self, key: int, gen: int) -> tuple[int, bool] | None:
        """The oldest record of ``key`` in generation ``gen``."""
        return next(((e, first) for k, first, g, e in self._records() if k == key and g == gen & 0xFF), None)

    def _record(self, word: int) -> tuple[int, int]:
        n = self._get(RING_NEXT)
        self._set(HEADER + n % RING, word)
        self._set(RING_NEXT, n + 1)
        return HEADER + n % RING, word

    def _rerecord(self, at: int, word: int, new: int) -> tuple[int, int]:
        if self._get(at) == word:  # not overwritten by a later iteration meanwhile
            self._set(at, new)
        return at, new

    def _check_slot(self, slot: int, key: int | None, gen: int, fresh: bool) -> None:
        """A fresh worker whose slot already holds its key from another process is a second
        DataLoader iterator with the same base seed as the last: refuse to guess."""
        word, pid = self._get(SLOTS + 2 * slot), self._get(SLOTS + 2 * slot + 1)
        if fresh and word and _unpack(word)[0] == key and _unpack(word)[2] == gen & 0xFF and pid != os.getpid():
            raise InvalidInput(
                "this DataLoader iterator drew the same base seed as the previous one (a generator "
                "re-seeded before each epoch?), so its workers cannot tell the next epoch from the last: "
                "call dataset.set_epoch(epoch) before each epoch, or keep the DataLoader's generator running.")

    # -- workers and placement --------------------------------------------------------------
    def saw_workers(self, workers: int) -> None:
        with self._locked():
            self._set(LAST_WORKERS, workers + 1)

    def last_workers(self) -> int | None:
        n = self._get(LAST_WORKERS)
        return n - 1 if n else None

    def publish(self, placement: Placement) -> None:
        """Record the training process's placement for its DataLoader workers."""
        self.own()
        with self._locked():
            self._set(RANK, placement.rank)
            self._set(WORLD, placement.world)
            self._set(SOURCE, placement.source)

    def placement(self) -> Placement:
        """The placement the training process last recorded."""
        with self._locked():
            return Placement(self._get(RANK), self._get(WORLD), self._get(SOURCE))


_LOCK_PREFIX = "featstore-progress-"


def _sweep_dead_locks() -> None:
    """Remove the lock files whose owner died without removing its own (a SIGKILL); the
    owner's pid is in the name (a reused pid only keeps a file a while longer)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(shm_root()):
            pid = name[len(_LOCK_PREFIX):].split("-")[0]
            if name.startswith(_LOCK_PREFIX) and pid.isdigit() and not _alive(int(pid)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(shm_root(), name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_lock(path: str, owner: int) -> None:
    """The block's lock file goes with its owner (a forked child inherits the finalizer)."""
    if os.getpid() == owner:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _own_key() -> int:
    """A key for a process's own iteration (never joined): random, without touching the global
    ``random`` state a training script may rely on."""
    return int(int.from_bytes(os.urandom(3), "little") % (2**_KEY_BITS - 1) + 1)


def check_epoch(epoch: Any) -> int:
    """``epoch`` as an int in [0, 2**31), or :class:`InvalidInput`."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) and not hasattr(epoch, "__index__"):
        raise InvalidInput(f"epoch must be an int, got {epoch!r}.")
    value = int(epoch)
    if not 0 <= value <= MAX_EPOCH:
        raise InvalidInput(f"epoch must be in [0, {MAX_EPOCH}], got {value}.")
    return value


#: Objects to prepare before this process forks (datasets: see :func:`on_fork`).
_BEFORE_FORK: "weakref.WeakSet[Any]" = weakref.WeakSet()


def on_fork(obj: Any) -> None:
    """Call ``obj._before_fork()`` in this process just before every fork while ``obj`` lives:
    a dataset owns its block and records its placement for the workers the fork may start."""
    _BEFORE_FORK.add(obj)


def _before_fork() -> None:
    if in_worker():
        return
    for obj in list(_BEFORE_FORK):
        try:
            obj._before_fork()
        except Exception:  # noqa: BLE001 - a fork must not fail for it; the worker re-checks
            pass


os.register_at_fork(before=_before_fork)
