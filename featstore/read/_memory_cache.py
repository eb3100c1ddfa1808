"""Shard bytes held in place: mapped local files and a cache of decoded shards shared by every
process on the machine. Reader side only (used by :mod:`featstore.read`).

- :class:`MappedFiles`: read-only memory maps of local shard objects, kept open (least recently
  used first out, up to a byte bound) because faulting a mapping's pages in again costs about
  as much as copying them.
- :class:`SharedCache`: decoded shards as files in one folder on ``/dev/shm`` (shared memory),
  one copy for all DataLoader workers and ranks of the machine. Every process maps the same
  file. The folder's files never exceed ``max_bytes``: an insert first evicts the least
  recently used shards (by modification time, which a hit refreshes) under an exclusive lock.
  An entry is written under a temporary name and renamed when whole, only after the decoder
  checked every crc32c, so a reader never sees a torn or unverified shard.
- Lifetime: each process using a folder holds a shared ``flock`` on its ``users.lock`` until it
  exits; the process that leaves last (its exclusive lock succeeds) removes the folder. The
  kernel drops the locks of a killed process, so a SIGKILLed worker never keeps a folder alive,
  and a folder whose every user was killed is removed by the next process that opens any cache
  under the same root.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import mmap
import os
import shutil
import tempfile
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import util as mp_util

CACHE_KINDS = ("memory",)
PREFIX = "featstore-cache-"
_USERS = "users.lock"
_EVICT = "evict.lock"
_TMP = ".tmp-"


def default_root() -> str:
    """``/dev/shm`` where it exists (Linux shared memory), else the temp folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@dataclass(frozen=True)
class CacheOptions:
    """Where a :class:`SharedCache` lives and how much it may hold.

    Attributes:
        max_bytes: the folder's files never exceed this many bytes.
        root: the folder's parent (None: :func:`default_root`, shared memory on Linux).
    """

    max_bytes: int
    root: str | None = None

    def folder(self, identity: str) -> str:
        """The cache folder of one version: every process naming the same identity shares it."""
        digest = hashlib.sha256(identity.encode()).hexdigest()[:20]
        return os.path.join(self.root or default_root(), PREFIX + digest)


#: Descriptors of files this process holds a short-lived ``flock`` on (an eviction lock, a
#: writer's temporary file). A child forked meanwhile (a DataLoader worker) closes its copies at
#: once: a ``flock`` belongs to the open file, which the fork shares, so the child's copy would
#: otherwise keep the lock held for the child's whole life after the parent let go.
_HELD: set[int] = set()


def _close_held_in_child() -> None:
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


def held_open(path: str, flags: int) -> int:
    """``os.open(path, flags, 0o600)``, closed in any child forked before :func:`held_close`."""
    fd = os.open(path, flags, 0o600)
    _HELD.add(fd)
    return fd


def held_close(fd: int) -> None:
    """Close a descriptor from :func:`held_open` (dropping its lock)."""
    _HELD.discard(fd)
    os.close(fd)


@contextlib.contextmanager
def _flocked(path: str, how: int) -> Iterator[int]:
    fd = held_open(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, how)
        yield fd
    finally:
        held_close(fd)


def _unused(lock_path: str) -> bool:
    """Whether no live process holds ``lock_path`` (a non-blocking exclusive lock succeeds)."""
    try:
        fd = held_open(lock_path, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        held_close(fd)


def sweep_stale(root: str) -> list[str]:
    """Remove every cache folder under ``root`` that no live process uses (all its users were
    killed); return the folders removed."""
    removed = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        folder = os.path.join(root, name)
        lock = os.path.join(folder, _USERS)
        if os.path.exists(lock) and _try_remove(folder):
            removed.append(folder)
    return removed


def _try_remove(folder: str) -> bool:
    """Remove ``folder`` if no process holds its users lock (checked under that lock)."""
    try:
        fd = held_open(os.path.join(folder, _USERS), os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held_close(fd)
        return False
    try:
        # Newcomers re-check the lock file's inode after their shared lock, so removing the
        # folder under our exclusive lock cannot strand one.
        shutil.rmtree(folder, ignore_errors=True)
        return True
    finally:
        held_close(fd)


class MappedFiles:
    """Read-only memory maps of local files, the most recently used kept open up to
    ``max_bytes`` in all (thread-safe). Each map is returned as a ``memoryview``.

    Every ``get`` checks the file (one ``stat``, about a microsecond): a file deleted since it
    was mapped raises ``FileNotFoundError`` (a deleted version reads as deleted, not from a
    stale map), and a file replaced or rewritten is mapped afresh. Each kept map carries the set
    of its chunks whose crc32c the reader has checked (:meth:`checked`): a map is checked once,
    and a rewritten file, being mapped afresh, is checked again.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._maps: OrderedDict[str, tuple[tuple[int, int, int], memoryview, set[int]]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, path: str, keep: bool = True) -> memoryview:
        """The file's bytes, mapped (raises ``FileNotFoundError``). ``keep=False``: a file not
        held already is mapped for this use alone, not kept (unmapped once the caller drops
        it): bytes read once, such as a compressed shard decoded into the shared cache, would
        otherwise stay resident in every process that read one."""
        return self.get_signed(path, keep)[0]

    def get_signed(self, path: str, keep: bool = True) -> tuple[memoryview, tuple[int, int, int]]:
        """:meth:`get`, with the ``(inode, size, mtime_ns)`` of the very file mapped."""
        # The signature is the opened file's: a stat of the path before the open would describe
        # whatever file the path named then, and a file replaced in between would be kept under
        # the new file's signature with the old one's bytes (and its chunks' checks).
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            sig = (st.st_ino, st.st_size, st.st_mtime_ns)
            with self._lock:
                hit = self._maps.get(path)
                if hit is not None and hit[0] == sig:
                    self._maps.move_to_end(path)
                    return hit[1], sig
            view = _map_fd(fd)
        finally:
            os.close(fd)
        if not keep:
            return view, sig
        with self._lock:
            old = self._maps.pop(path, None)
            if old is not None:
                self._bytes -= len(old[1])
            self._maps[path] = (sig, view, set())
            self._bytes += len(view)
            while self._bytes > self.max_bytes and len(self._maps) > 1:
                _, (_, evicted, _) = self._maps.popitem(last=False)  # unmapped once its last array is freed
                self._bytes -= len(evicted)
        return view, sig

    def checked(self, path: str, view: memoryview) -> set[int]:
        """The chunks of ``view`` (the map of ``path`` that :meth:`get` returned) already checked
        in this process; the caller adds those it checks. A map not kept gets a fresh set."""
        with self._lock:
            hit = self._maps.get(path)
        return hit[2] if hit is not None and hit[1] is view else set()

    def clear(self) -> None:
        """Forget every map (each is unmapped once no array uses it any more)."""
        with self._lock:
            self._maps.clear()
            self._bytes = 0


def join_users(folder: str) -> int:
    """Create ``folder`` if needed and return a descriptor holding a shared lock on its users
    file (the last user, taking it exclusively, removes the folder): one rule for the shared
    memory cache and the disk cache."""
    lock = os.path.join(folder, _USERS)
    while True:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:  # the folder was removed between makedirs and open
            continue
        fcntl.flock(fd, fcntl.LOCK_SH)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)  # the last user removed the folder meanwhile: start over


def _map(path: str, writable: bool = False) -> memoryview:
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        return _map_fd(fd, writable)
    finally:
        os.close(fd)


def _map_fd(fd: int, writable: bool = False) -> memoryview:
    size = os.fstat(fd).st_size
    if size == 0:
        return memoryview(b"")
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    # Read maps are faulted in here, in a reader thread, not page by page in the batch gather.
    flags = mmap.MAP_SHARED | (0 if writable else getattr(mmap, "MAP_POPULATE", 0))
    return memoryview(mmap.mmap(fd, size, flags=flags, prot=prot))


class SharedCache:
    """Decoded shards shared by every process of the machine (see the module docstring).

    >>> cache = SharedCache.open(CacheOptions(max_bytes=2**30), "s3://bucket/feats|cnn-a@3f2a")
    >>> view = cache.get("features.3") or cache.put("features.3", nbytes, fill)
    """

    _open: dict[tuple[int, str], "SharedCache"] = {}
    _open_lock = threading.Lock()

    def __init__(self, folder: str, max_bytes: int) -> None:
        self.folder, self.max_bytes = folder, int(max_bytes)
        self._maps: dict[str, tuple[int, memoryview]] = {}  # key -> (inode, map) in this process
        self._lock = threading.Lock()
        self._users_fd = self._join()
        mp_util.Finalize(None, _leave, args=(folder, self._users_fd), exitpriority=-10)

    @classmethod
    def open(cls, options: CacheOptions, identity: str) -> "SharedCache":
        """This process's handle on the cache of ``identity`` (one per process and folder; the
        first caller's ``max_bytes`` is the default budget of its inserts)."""
        folder = options.folder(identity)
        key = (os.getpid(), folder)
        with cls._open_lock:
            cache = cls._open.get(key)
            if cache is None:
                sweep_stale(os.path.dirname(folder))
                cache = cls._open[key] = cls(folder, options.max_bytes)
            return cache

    def _join(self) -> int:
        """Create the folder if needed and hold a shared lock on its users file until exit."""
        return join_users(self.folder)

    def path(self, key: str) -> str:
        """The file that holds ``key`` once cached (it may not exist)."""
        return self._path(key)

    def touch(self, key: str) -> None:
        """Count a use of ``key`` (least recently used goes first)."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(self._path(key))

    def _path(self, key: str) -> str:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"bad cache key {key!r}")
        return os.path.join(self.folder, key)

    # -- reading ------------------------------------------------------------------------
    def get(self, key: str) -> memoryview | None:
        """The cached bytes of ``key`` (read-only, mapped), or None; a hit counts as a use."""
        path = self._path(key)
        try:  # the inode of the file opened, not of whatever the path named a moment before
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            with self._lock:
                self._maps.pop(key, None)
            return None
        try:
            ino = os.fstat(fd).st_ino
            with self._lock:
                held = self._maps.get(key)
            if held is None or held[0] != ino:
                held = (ino, _map_fd(fd))
                with self._lock:
                    self._maps[key] = held
        finally:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)  # least recently used goes first
        return held[1]

    # -- writing ------------------------------------------------------------------------
    def put(self, key: str, nbytes: int, fill: Callable[[memoryview], None],
            max_bytes: int | None = None) -> memoryview | None:
        """Store ``nbytes`` written by ``fill(buffer)`` under ``key`` and return them mapped;
        None when they cannot fit (larger than the budget, or shared memory is full): the
        caller then keeps its own copy. ``fill`` must raise on bad data: nothing is stored then.
        ``max_bytes`` is this insert's budget for the whole folder (default: the handle's).
        """
        budget = self.max_bytes if max_bytes is None else int(max_bytes)
        if nbytes <= 0 or nbytes > budget:
            return None
        path = self._path(key)
        tmp = os.path.join(self.folder, f"{_TMP}{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        fd = self._reserve(tmp, nbytes, budget)
        self.drop_stale()  # our maps of what was just evicted: free their memory now
        if fd is None:
            return None
        try:
            view = _map(tmp, writable=True)
            fill(view)
            # Whole and verified: now visible to every process. Under the eviction lock, so that no
            # listing of the folder (another insert making room) sees neither the temporary name
            # nor the final one and undercounts the folder by this entry.
            with _flocked(os.path.join(self.folder, _EVICT), fcntl.LOCK_EX):
                os.rename(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        finally:
            held_close(fd)  # drops the writer's lock on the temporary file
        ro = view.toreadonly()
        with self._lock:
            self._maps[key] = (_ino(path), ro)
        return ro

    def _reserve(self, tmp: str, nbytes: int, budget: int) -> int | None:
        """Evict until ``nbytes`` more fit, then create ``tmp`` at that size (locked while
        written, so a crashed writer's file is recognised and removed)."""
        with _flocked(os.path.join(self.folder, _EVICT), fcntl.LOCK_EX):
            entries, used = self._entries()
            for _, size, path in sorted(entries):
                if used + nbytes <= budget:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                used -= size
            if used + nbytes > budget:
                return None
            fd = held_open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                os.posix_fallocate(fd, 0, nbytes)  # ENOSPC here, not SIGBUS on a write later
            except OSError as exc:
                held_close(fd)
                os.unlink(tmp)
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    return None
                raise
            return fd

    def _entries(self) -> tuple[list[tuple[int, int, str]], int]:
        """(mtime, size, path) of every cached shard, and the bytes in use (temporary files
        included; a crashed writer's are removed here)."""
        entries, used = [], 0
        for name in os.listdir(self.folder):
            path = os.path.join(self.folder, name)
            if name in (_USERS, _EVICT):
                continue
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            if name.startswith(_TMP):
                if _unused(path):  # its writer died mid-write
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                    continue
                used += st.st_size
                continue
            entries.append((st.st_mtime_ns, st.st_size, path))
            used += st.st_size
        return entries, used

    def trim(self, max_bytes: int) -> None:
        """Evict least recently used shards until the folder holds at most ``max_bytes``
        (a reader with a smaller budget than an earlier one on the same version)."""
        with _flocked(os.path.join(self.folder, _EVICT), fcntl.LOCK_EX):
            entries, used = self._entries()
            for _, size, path in sorted(entries):
                if used <= max_bytes:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                used -= size
        self.drop_stale()

    def clear(self) -> None:
        """Remove every cached shard (processes that have one mapped keep it until they move on)."""
        with _flocked(os.path.join(self.folder, _EVICT), fcntl.LOCK_EX):
            for _, _, path in self._entries()[0]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        with self._lock:
            self._maps.clear()

    def used_bytes(self) -> int:
        """Bytes of the folder's files now (shards and inserts in progress), read under the
        eviction lock, so no reader is halfway through making room."""
        with _flocked(os.path.join(self.folder, _EVICT), fcntl.LOCK_EX):
            return self._entries()[1]

    def drop_stale(self) -> None:
        """Unmap this process's view of every shard another process evicted."""
        with self._lock:
            for key, (ino, _) in list(self._maps.items()):
                if _ino(self._path(key)) != ino:
                    del self._maps[key]


def _ino(path: str) -> int:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return -1


def _leave(folder: str, fd: int) -> None:
    """At process exit: drop this process's use; the last user removes the folder."""
    with contextlib.suppress(OSError):
        os.close(fd)
    _try_remove(folder)
