"""The node's cache, one mechanism for its two locations: decoded shards in shared memory
(``cache="memory"``) and a remote store's objects on the node's disk (``cache="disk"``); what
it guarantees is in docs/caches.md. Standard library only (``featstore cache`` imports it).

A :class:`Space` is one accounting unit: a root folder with the *ledger* (the bytes the space
holds, an upper bound, kept in a file whose exclusive ``flock`` is the eviction lock) and one
folder per *scope* (one commit of one version of one store), where each process reading it holds
a shared ``flock`` on ``users.lock`` until it exits. The location is the space's parameter:

- **memory**: ``<shm>/featstore-cache-<digest>/``, one per version (its budget is the version's);
  the root is the scope's folder, removed when its last user exits; entries are decoded arrays;
- **disk**: ``<cache_dir>/featstore-disk/``, one per folder, shared by every store and version;
  scopes are ``<root>/<scope>/`` and outlive their readers; an entry is the object then a trailer
  (magic, length, crc32c); a miss takes a fetch lock (``<root>/locks/<n>``) and looks again
  before it fetches, so the node sends one GET per object.

The same for both: an insert reserves its bytes in the ledger (raised before a file exists,
lowered after one is removed: a kill can only over-count; an insert that does not fit by it
lists the space and resets it), writes a temporary file its writer holds a ``flock`` on (a
killed writer's is removed by the next listing) and renames it under the ledger's lock (no
listing sees neither name). Eviction (:data:`POLICIES`): ``"keep"`` evicts only entries of
scopes no live process uses, so an epoch scan over a version bigger than the budget keeps one
fixed set and reads only the rest; ``"lru"`` evicts the least recently used of any scope (0.82 of
the version fetched per epoch at half budget, "keep" 0.501: docs/benchmarks.md). The memory
location always keeps (0.50 of its shards decoded per epoch at half budget, LRU 0.77-0.90:
docs/caches.md). Reads map the entry: Linux keeps an unlinked file readable while mapped, so no
eviction or clear takes bytes from under a reader, and an entry gone meanwhile is a miss.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import mmap
import os
import shutil
import struct
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, replace
from multiprocessing import util as mp_util
from typing import Any, TypeVar, cast

from featstore.errors import InvalidInput

POLICIES = ("keep", "lru")
CACHE_DIR_ENV = "FEATSTORE_CACHE_DIR"
DISK_FOLDER = "featstore-disk"
MEMORY_PREFIX = "featstore-cache-"
_USERS, _INFO, _LOCKS, _TMP = "users.lock", "scope.json", "locks", ".tmp-"
_LOCK_BUCKETS = 1024
_MAGIC = b"FSDISK01"
_TRAILER = struct.Struct("<8sQI4x")  # magic, length of the object, crc32c of the object
#: Bytes an entry with a trailer holds beyond its object.
ENTRY_TRAILER = _TRAILER.size
#: Marks, in a mapping's checked set (:meth:`MappedFiles.checked`), that the entry's trailer
#: and crc32c were checked for that mapping.
ENTRY_CHECKED = -1
#: A process that found no room skips further inserts bigger than the room it saw for this long
#: (a miss then costs no listing of the whole space); what another process frees meanwhile is
#: used after it.
_FULL_MEMO_S = 1.0
#: What a write into a full disk or quota raises: the entry is not kept, and reads go on.
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
Sig = tuple[int, int, int]  # (inode, size, mtime_ns) of an opened file
T = TypeVar("T")


def shm_root() -> str:
    """``/dev/shm`` where it exists (Linux shared memory), else the temp folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def default_dir() -> str:
    """``$FEATSTORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/featstore``, else ``~/.cache/featstore``
    (a disk, not ``/tmp``, which is often RAM)."""
    if os.environ.get(CACHE_DIR_ENV):
        return os.environ[CACHE_DIR_ENV]
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                        "featstore")


def digest(text: str, n: int) -> str:
    """The first ``n`` hex digits of the sha256 of ``text`` (names of scopes, entries, locks)."""
    return hashlib.sha256(text.encode()).hexdigest()[:n]


@dataclass(frozen=True)
class Space:
    """One accounting unit of the node's cache (see the module docstring).

    Attributes:
        root: the folder of the ledger (and, on disk, of the scopes and fetch locks).
        memory: the memory location: the root is its one scope's folder, removed with its last
            user; entries have no trailer (decoded and checked once, they live in RAM); no fetch
            locks (two workers decoding one shard at once both insert it, the later rename wins).
    """

    root: str
    memory: bool = False

    @classmethod
    def for_memory(cls, identity: str, root: str | None = None) -> "Space":
        """The shared-memory space of one version (``identity`` names it)."""
        return cls(os.path.join(root or shm_root(), MEMORY_PREFIX + digest(identity, 20)), memory=True)

    @classmethod
    def for_disk(cls, cache_dir: str | None = None) -> "Space":
        """The disk space under ``cache_dir`` (None: :func:`default_dir`)."""
        return cls(os.path.join(os.path.abspath(os.path.expanduser(cache_dir or default_dir())), DISK_FOLDER))

    @property
    def ledger(self) -> str:
        return os.path.join(self.root, "evict.lock" if self.memory else "usage")

    def folder(self, scope: str) -> str:
        return self.root if self.memory else os.path.join(self.root, scope)

    def scopes(self) -> list[str]:
        if self.memory:
            return [""] if os.path.isdir(self.root) else []
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if len(n) == 32 and all(c in "0123456789abcdef" for c in n))

    def in_use(self, scope: str) -> bool:
        return not _unused(os.path.join(self.folder(scope), _USERS))

    @contextlib.contextmanager
    def locked(self) -> Iterator["_Ledger"]:
        """The ledger, exclusively locked (the eviction lock)."""
        with flocked(self.ledger, fcntl.LOCK_EX) as fd:
            yield _Ledger(fd)

    def listing(self) -> tuple[list["_Entry"], int]:
        """Every entry of every scope, and the bytes the space holds (inserts in progress
        included). A killed writer's temporary file is removed here. Call under the ledger's lock."""
        entries: list[_Entry] = []
        used = 0
        for scope in self.scopes():
            folder = self.folder(scope)
            try:
                names = os.listdir(folder)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for name in names:
                path = os.path.join(folder, name)
                if name in (_USERS, _LOCKS) or name.startswith(_INFO) or path == self.ledger:
                    continue
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                if name.startswith(_TMP) and _unused(path):  # its writer died mid-write
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                    continue
                used += st.st_size
                if not name.startswith(_TMP):
                    entries.append(_Entry(st.st_atime_ns, st.st_size, path, scope))
        return entries, used

    def recount(self) -> tuple[list["_Entry"], int]:
        """:meth:`listing`, under the ledger's lock, the ledger reset to the bytes counted."""
        with self.locked() as ledger:
            entries, used = self.listing()
            ledger.write(used)
        return entries, used

    def remove(self, chosen: Callable[[str, bool], bool]) -> int:
        """Remove the entries of every scope ``chosen(scope, in_use)`` picks, and the folders of
        those no process uses; the bytes removed. Safe while readers run."""
        freed = 0
        with self.locked() as ledger:
            entries, used = self.listing()
            in_use = {s: self.in_use(s) for s in self.scopes()}
            for e in entries:
                if chosen(e.scope, in_use.get(e.scope, False)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.path)
                        freed += e.size
            for s, busy in in_use.items():
                if not busy and chosen(s, busy) and not self.memory:
                    _try_remove(self.folder(s))
            ledger.write(used - freed)
        return freed


@dataclass(frozen=True)
class _Ledger:
    """The ledger file, open and exclusively locked."""

    fd: int

    def read(self) -> int | None:
        raw = os.pread(self.fd, 8, 0)
        return int.from_bytes(raw, "little") if len(raw) == 8 else None

    def write(self, used: int) -> int:
        used = max(0, int(used))
        os.pwrite(self.fd, used.to_bytes(8, "little"), 0)
        return used

    def add(self, n: int) -> None:
        held = self.read()
        if held is not None:
            self.write(held + n)


@dataclass(frozen=True)
class _Entry:
    used_ns: int  # last use (the file's atime: set at its creation, and at each use under "lru")
    size: int
    path: str
    scope: str


class NodeCache:
    """One process's handle on one scope of a :class:`Space`.

    >>> cache = NodeCache.open(Space.for_disk("/mnt/nvme/cache"), identity, 500 * 2**30, "keep", info)
    >>> view = cache.get(name) or cache.put(name, len(data), lambda buf: buf.__setitem__(slice(None), data))
    """

    def __init__(self, space: Space, scope: str, budget: int, policy: str = "keep",
                 info: dict[str, str] | None = None, maps: "MappedFiles | None" = None) -> None:
        self.space, self.scope, self.budget, self.policy = space, scope, int(budget), policy
        self.folder = space.folder(scope)
        # a memory scope's maps are kept whole (shared memory: mapping copies nothing)
        self.maps = maps if maps is not None and not space.memory else MappedFiles(2**62)
        self._full = (0.0, 0)  # (monotonic time until which, room then) after an insert found no room
        self._verified: set[Sig] = set()  # (inode, size, mtime) whose crc32c passed
        if not space.memory:
            os.makedirs(os.path.join(space.root, _LOCKS), mode=0o700, exist_ok=True)
        self._users_fd = _join(self.folder)  # held until this process exits (or close())
        if space.memory:
            mp_util.Finalize(None, _leave, args=(self.folder, self._users_fd), exitpriority=-10)
        elif info is not None and not os.path.exists(described := os.path.join(self.folder, _INFO)):
            tmp = f"{described}.{os.getpid()}.{uuid.uuid4().hex[:8]}"  # what list_disk_cache reports
            with open(tmp, "w") as f:
                json.dump({"schema": "featstore.diskcache.scope", "schema_version": 1, **info}, f, sort_keys=True)
            os.replace(tmp, described)

    @classmethod
    def open(cls, space: Space, identity: str, budget: int, policy: str = "keep",
             info: dict[str, str] | None = None, maps: "MappedFiles | None" = None) -> "NodeCache":
        """This process's handle on the scope of ``identity`` (one per process, space, scope,
        budget and policy)."""
        scope = digest(identity, 32)

        def make() -> NodeCache:
            if space.memory:
                sweep_stale(os.path.dirname(space.root))
            return cls(space, scope, budget, policy, info, maps)
        return process_local(_handle_key(space.root, scope, int(budget), policy), make)

    def close(self) -> None:
        """Stop using this scope in this process (its entries may then be evicted, once no other
        process reads the version either); the handle must not be used afterwards."""
        forget_process_local(_handle_key(self.space.root, self.scope, self.budget, self.policy))
        with contextlib.suppress(OSError):
            os.close(self._users_fd)

    def path(self, name: str) -> str:
        """The file of entry ``name`` (it may not exist)."""
        if not name or "/" in name or name.startswith(".") or name in (_USERS, _LOCKS, _INFO):
            raise ValueError(f"bad cache entry name {name!r}")
        return os.path.join(self.folder, name)

    def holds(self, name: str) -> str | None:
        """The file of entry ``name`` if it is there now."""
        path = self.path(name)
        return path if os.path.exists(path) else None

    # -- reading ------------------------------------------------------------------------
    def get(self, name: str, keep: bool = True) -> memoryview | None:
        """Entry ``name``'s bytes (mapped; on disk, checked), or None: absent, or damaged (then
        removed). ``keep=False``: a file not mapped already is mapped for this use alone."""
        path = self.path(name)
        try:
            view, sig = self.maps.get(path, keep)  # a file replaced or changed since is mapped afresh
            if not self.space.memory:
                checked = self.maps.checked(path, view)
                if ENTRY_CHECKED not in checked:
                    # The whole crc32c once per file in this process (a file changed since has
                    # another signature), the length and the trailer once per mapping: a version
                    # bigger than the process's kept mappings is mapped afresh each epoch without
                    # hashing it again.
                    if not _entry_ok(view, crc=sig not in self._verified):
                        self.discard(name)
                        return None
                    checked.add(ENTRY_CHECKED)
                    self._verified.add(sig)
                view = view[:len(view) - _TRAILER.size]
            if self.policy == "lru":  # a use (atime only: the mapping's mtime stays)
                os.utime(path, ns=(time.time_ns(), os.stat(path).st_mtime_ns))
        except FileNotFoundError:
            return None
        return view

    def body(self, view: memoryview, name: str) -> memoryview | None:
        """A mapped disk entry's object, the trailer off; None, with the entry removed, when torn."""
        if _entry_ok(view, crc=False):
            return view[:len(view) - _TRAILER.size]
        self.discard(name)
        return None

    def fetch_lock(self, name: str) -> contextlib.AbstractContextManager[object]:
        """What a miss of disk entry ``name`` holds while it looks again and fetches: a node-wide
        lock (by a hash of the name), so a miss waits for another process's fetch of it."""
        bucket = int(digest(name, 8), 16) % _LOCK_BUCKETS
        return flocked(os.path.join(self.space.root, _LOCKS, str(bucket)), fcntl.LOCK_EX)

    # -- writing ------------------------------------------------------------------------
    def put(self, name: str, nbytes: int, fill: Callable[[memoryview], None]) -> memoryview | None:
        """Keep the ``nbytes`` that ``fill(buffer)`` writes as entry ``name`` and return them
        mapped; None when they do not fit (then nothing is kept). ``fill`` must raise on bad
        data: nothing is kept then."""
        n = nbytes + (0 if self.space.memory else _TRAILER.size)
        until, room = self._full
        if nbytes <= 0 or n > self.budget or (n > room and time.monotonic() < until):
            return None
        tmp = os.path.join(self.folder, f"{_TMP}{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        fd = self._reserve(tmp, n)
        if self.space.memory:
            self.maps.drop_stale()  # our maps of what was just evicted: free their memory now
        if fd is None:
            return None
        try:
            view = _map_fd(fd, writable=True)
            fill(view[:nbytes])
            if not self.space.memory:
                import crc32c

                view[nbytes:] = _TRAILER.pack(_MAGIC, nbytes, crc32c.crc32c(view[:nbytes]))
            with self.space.locked():  # no listing sees neither name
                os.rename(tmp, self.path(name))
        except BaseException as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            with self.space.locked() as ledger:
                ledger.add(-n)
            if isinstance(exc, OSError) and exc.errno in _NO_ROOM:
                return None
            raise
        finally:
            held_close(fd)  # drops the writer's lock on the temporary file
        ro = view.toreadonly()
        if self.space.memory:
            self.maps.remember(self.path(name), ro)
        return ro[:nbytes]

    def _reserve(self, tmp: str, n: int) -> int | None:
        """Make room for ``n`` bytes (by the policy) and create ``tmp`` at that size, locked by
        this writer; None when they do not fit."""
        with self.space.locked() as ledger:
            used = ledger.read()
            if used is None or used + n > self.budget:
                used = self._make_room(n, self.budget, ledger)
            if used + n > self.budget:
                self._full = (time.monotonic() + _FULL_MEMO_S, self.budget - used)
                return None
            ledger.write(used + n)  # before the file exists: a kill from here on over-counts
            fd = held_open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                os.posix_fallocate(fd, 0, n)  # a full disk fails here, not halfway through the write
            except OSError as exc:
                held_close(fd)
                os.unlink(tmp)
                ledger.write(used)
                if exc.errno in _NO_ROOM:
                    return None
                raise
            return fd

    def _make_room(self, n: int, budget: int, ledger: _Ledger, evict_all: bool = False) -> int:
        """List the space, evict what the policy allows (``evict_all``: anything) until ``n``
        more bytes fit in ``budget``, and reset the ledger to what is left (under its lock)."""
        entries, used = self.space.listing()
        if used + n > budget:
            stale = {s for s in {e.scope for e in entries} if s != self.scope and not self.space.in_use(s)}
            victims = entries if self.policy == "lru" or evict_all else [e for e in entries if e.scope in stale]
            for e in sorted(victims, key=lambda e: e.used_ns):
                if used + n <= budget:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)
                    used -= e.size
            left = {e.scope for e in entries if os.path.exists(e.path)}
            for s in stale - left:
                _try_remove(self.space.folder(s))
        return ledger.write(used)

    def trim(self, budget: int) -> None:
        """Evict the oldest entries, in use or not, until the space holds at most ``budget``
        (a reader with a smaller budget than an earlier one on the same version)."""
        with self.space.locked() as ledger:
            self._make_room(0, budget, ledger, evict_all=True)
        self.maps.drop_stale()

    def discard(self, name: str) -> None:
        """Remove entry ``name`` (it failed a check). A process that maps it keeps its copy."""
        with self.space.locked() as ledger:
            try:
                size = os.stat(self.path(name)).st_size
                os.unlink(self.path(name))
            except FileNotFoundError:
                return
            ledger.add(-size)

    def clear(self) -> int:
        """Remove this scope's entries (readers that map one keep it); the bytes removed."""
        freed = self.space.remove(lambda scope, in_use: scope == self.scope)
        self.maps.drop_stale()
        return freed

    def used_bytes(self) -> int:
        """Bytes the whole space holds now, counted afresh."""
        return self.space.recount()[1]


def _entry_ok(view: memoryview, crc: bool) -> bool:
    """Whether a mapped entry ends with its trailer and has the length it names (not torn) and,
    with ``crc``, the crc32c it names."""
    if len(view) < _TRAILER.size:
        return False
    magic, size, want = _TRAILER.unpack(view[len(view) - _TRAILER.size:])
    whole = magic == _MAGIC and size == len(view) - _TRAILER.size
    if not (whole and crc):
        return bool(whole)
    import crc32c

    return bool(crc32c.crc32c(view[:size]) == want)


# -- the disk location's options, listing and clearing ----------------------------------------
@dataclass(frozen=True)
class DiskCacheOptions:
    """Where a node's disk cache lives, how much it may hold and what it evicts.

    Attributes:
        dir: the cache folder (None: :func:`default_dir`); featstore uses ``<dir>/featstore-disk``.
        max_bytes: the folder's files never exceed this (None: see :meth:`resolved`).
        policy: ``"keep"`` (entries of a version in use are never evicted; see the module
            docstring) or ``"lru"``.
    """

    dir: str | None = None
    max_bytes: int | None = None
    policy: str = "keep"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidInput(f"disk_policy must be one of {POLICIES}, got {self.policy!r}.")
        if self.max_bytes is not None and (not isinstance(self.max_bytes, int) or self.max_bytes < 1):
            raise InvalidInput(f"the disk cache's budget must be a positive int, got {self.max_bytes!r}.")

    @property
    def space(self) -> Space:
        return Space.for_disk(self.dir)

    @property
    def root(self) -> str:
        """The folder featstore owns: ``<dir>/featstore-disk``."""
        return self.space.root

    def resolved(self) -> "DiskCacheOptions":
        """These options with ``max_bytes`` set: when None, what the cache holds now plus half
        the free space of its filesystem."""
        if self.max_bytes is not None:
            return self
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        st = os.statvfs(self.root)
        with self.space.locked() as ledger:
            held = ledger.read()
            if held is None:
                held = ledger.write(self.space.listing()[1])
        return replace(self, max_bytes=max(1, held + st.f_bavail * st.f_frsize // 2))

    def open(self, identity: str, info: dict[str, str], maps: "MappedFiles | None" = None) -> NodeCache:
        """This process's handle on the scope of ``identity`` (options resolved first)."""
        opts = self.resolved()
        assert opts.max_bytes is not None
        return NodeCache.open(self.space, identity, opts.max_bytes, self.policy, info, maps)


@dataclass(frozen=True)
class CachedScope:
    """One scope of a node's disk cache, as :func:`list_disk_cache` reports it."""

    scope: str
    store: str
    version: str
    entries: int
    bytes: int
    in_use: bool


def list_disk_cache(cache_dir: str | None = None) -> list[CachedScope]:
    """What the node's disk cache under ``cache_dir`` holds, by version.

    >>> [(s.version, s.bytes, s.in_use) for s in list_disk_cache("/mnt/nvme/cache")]
    [('cnn-a/train@3f2a9c0e1b7d4a55', 1073741824, True)]
    """
    space = Space.for_disk(cache_dir)
    if not os.path.isdir(space.root):
        return []
    entries, _ = space.recount()
    out = []
    for scope in space.scopes():
        mine = [e for e in entries if e.scope == scope]
        try:
            with open(os.path.join(space.folder(scope), _INFO)) as f:
                info = json.load(f)
        except (OSError, ValueError):
            info = {}
        out.append(CachedScope(scope, str(info.get("store", "?")), str(info.get("version", "?")), len(mine),
                               sum(e.size for e in mine), space.in_use(scope)))
    return out


def clear_disk_cache(cache_dir: str | None = None, *, unused_only: bool = False) -> int:
    """Empty the node's disk cache under ``cache_dir`` (``unused_only``: only the versions no
    live process reads); the bytes removed. Safe while readers run: a reader keeps what it has
    mapped and fetches the rest again.

    >>> clear_disk_cache("/mnt/nvme/cache", unused_only=True)
    536870912
    """
    space = Space.for_disk(cache_dir)
    if not os.path.isdir(space.root):
        return 0
    return space.remove(lambda scope, in_use: not (unused_only and in_use))


# -- mapped files ---------------------------------------------------------------------------------
class MappedFiles:
    """Read-only memory maps of local files, the most recently used kept open up to
    ``max_bytes`` in all (thread-safe): faulting a mapping's pages in again costs about as much
    as copying them. Each map is returned as a ``memoryview``.

    Every ``get`` checks the file (one ``stat``, about a microsecond): a file deleted since it
    was mapped raises ``FileNotFoundError`` (a deleted version reads as deleted, not from a
    stale map), and a file replaced or rewritten is mapped afresh. Each kept map carries the set
    of its chunks whose crc32c the reader has checked (:meth:`checked`): a map is checked once,
    and a rewritten file, being mapped afresh, is checked again.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._maps: OrderedDict[str, tuple[Sig, memoryview, set[int]]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, path: str, keep: bool = True) -> tuple[memoryview, Sig]:
        """The file's bytes, mapped, and the ``(inode, size, mtime_ns)`` of the very file mapped
        (raises ``FileNotFoundError``). ``keep=False``: a file not held already is mapped for this
        use alone (unmapped once the caller drops it): bytes read once, such as a compressed
        shard decoded into the memory cache, would otherwise stay resident in every process."""
        # The signature is the opened file's: a stat of the path before the open would describe
        # whatever file the path named then (a file replaced in between would be kept under the
        # new file's signature with the old one's bytes and checks).
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
        if keep:
            self.remember(path, view, sig)
        return view, sig

    def remember(self, path: str, view: memoryview, sig: Sig | None = None) -> None:
        """Keep ``view`` as the map of ``path`` (``sig``: its file's, else stat now)."""
        if sig is None and (sig := file_sig(path)) is None:
            return
        with self._lock:
            old = self._maps.pop(path, None)
            self._bytes += len(view) - (len(old[1]) if old is not None else 0)
            self._maps[path] = (sig, view, set())
            while self._bytes > self.max_bytes and len(self._maps) > 1:
                _, (_, evicted, _) = self._maps.popitem(last=False)  # unmapped once its last array is freed
                self._bytes -= len(evicted)

    def checked(self, path: str, view: memoryview) -> set[int]:
        """The chunks of ``view`` (the map of ``path`` that :meth:`get` returned) already checked
        in this process; the caller adds those it checks. A map not kept gets a fresh set."""
        with self._lock:
            hit = self._maps.get(path)
        return hit[2] if hit is not None and hit[1] is view else set()

    def drop_stale(self) -> None:
        """Forget the maps of files removed or replaced since (another process evicted them:
        their memory is freed once no array uses them)."""
        with self._lock:
            for path, (sig, view, _) in list(self._maps.items()):
                if file_sig(path) != sig:
                    del self._maps[path]
                    self._bytes -= len(view)


def file_sig(path: str) -> Sig | None:
    """The ``(inode, size, mtime_ns)`` of the file at ``path`` now (None: there is none)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _map_fd(fd: int, writable: bool = False) -> memoryview:
    size = os.fstat(fd).st_size
    if size == 0:
        return memoryview(b"")
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    # Read maps are faulted in here, in a reader thread, not page by page in the batch gather.
    flags = mmap.MAP_SHARED | (0 if writable else getattr(mmap, "MAP_POPULATE", 0))
    return memoryview(mmap.mmap(fd, size, flags=flags, prot=prot))


# -- what each process makes once --------------------------------------------------------------
_PROCESS: dict[tuple[Hashable, ...], Any] = {}
_PROCESS_LOCK = threading.RLock()


def process_local(key: tuple[Hashable, ...], make: Callable[[], T]) -> T:
    """This process's one value under ``key`` (a node cache's handle, the mapped files, an
    arena): ``make()`` on first use, again next time if it raised. A forked child makes its
    own: the parent's are the parent's, and another thread may have held a lock at the fork."""
    with _PROCESS_LOCK:
        if key not in _PROCESS:
            _PROCESS[key] = make()
        return cast(T, _PROCESS[key])


def forget_process_local(key: tuple[Hashable, ...]) -> None:
    """Drop this process's value under ``key`` (the next :func:`process_local` makes it anew)."""
    with _PROCESS_LOCK:
        _PROCESS.pop(key, None)


def _handle_key(root: str, scope: str, budget: int, policy: str) -> tuple[Hashable, ...]:
    return ("cache", root, scope, budget, policy)


def _forget_in_child() -> None:
    global _PROCESS_LOCK
    _PROCESS.clear()
    _PROCESS_LOCK = threading.RLock()


os.register_at_fork(after_in_child=_forget_in_child)


# -- locks that a forked child does not keep ------------------------------------------------------
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
def flocked(path: str, how: int = fcntl.LOCK_EX) -> Iterator[int]:
    """``flock(path, how)`` held for the block (a child forked meanwhile does not keep it)."""
    fd = held_open(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, how)
        yield fd
    finally:
        held_close(fd)


@contextlib.contextmanager
def _sole(lock_path: str, missing: bool) -> Iterator[bool]:
    """Whether no live process holds ``lock_path`` (a non-blocking exclusive lock succeeds; it
    is held for the block), ``missing`` when there is no such file."""
    try:
        fd = held_open(lock_path, os.O_RDWR)
    except FileNotFoundError:
        yield missing
        return
    try:
        free = False
        with contextlib.suppress(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            free = True
        yield free
    finally:
        held_close(fd)


def _unused(lock_path: str) -> bool:
    """Whether no live process holds ``lock_path`` (nor could: it is missing)."""
    with _sole(lock_path, missing=True) as free:
        return free


def _join(folder: str) -> int:
    """Create ``folder`` if needed and return a descriptor holding a shared lock on its users
    file (one that takes it exclusively knows no process uses the folder)."""
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


def _try_remove(folder: str) -> bool:
    """Remove ``folder`` if no process holds its users lock (checked under that lock)."""
    with _sole(os.path.join(folder, _USERS), missing=False) as free:
        if free:
            shutil.rmtree(folder, ignore_errors=True)
    return free


def _leave(folder: str, fd: int) -> None:
    """At process exit: drop this process's use of a memory scope; the last user removes it."""
    with contextlib.suppress(OSError):
        os.close(fd)
    _try_remove(folder)


def sweep_stale(root: str) -> list[str]:
    """Remove every memory cache folder under ``root`` that no live process uses (all its users
    were killed); return the folders removed."""
    try:
        names = [n for n in os.listdir(root) if n.startswith(MEMORY_PREFIX)]
    except OSError:
        return []
    folders = [os.path.join(root, n) for n in names]
    return [f for f in folders if os.path.exists(os.path.join(f, _USERS)) and _try_remove(f)]
