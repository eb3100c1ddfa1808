"""Objects of remote stores kept on a node's local disk, shared by every process on the node.
Reader side only (used through :mod:`featstore.read`).

Everything lives under ``<cache_dir>/featstore-disk/``:

- ``<scope>/``: one commit of one version of one store. The scope is a digest of the store's URL
  and endpoint, the version's key and id and its manifest's digest, so two stores, two versions,
  or a version deleted and recomputed under the same id never share an entry. Every process
  reading a scope holds a shared ``flock`` on its ``users.lock`` until it exits (the kernel drops
  it when a process is killed); ``scope.json`` says what the scope is (``featstore cache list``).
- ``<scope>/<digest of the object's key>``: the object's bytes, then a 24-byte trailer (magic,
  length, crc32c of the bytes). Written under a temporary name that its writer holds an
  exclusive ``flock`` on, and renamed once whole: a reader never sees a torn entry by name, and
  a killed writer's file is recognised (its lock is gone) and removed by the next listing.
- Recency: an entry's access time is set at its creation and, under ``"lru"``, at every use.
- ``usage``: the bytes the folder holds, an upper bound, read and written under an exclusive
  ``flock`` on the file itself (the eviction lock). It is raised before a file is created and
  lowered after one is removed, so a kill in between can only over-count; whenever an insert
  does not fit by it, the folder is listed under the lock and the count reset to the truth.
- ``locks/<n>``: fetch locks, by a hash of the object's name. A miss takes its lock, looks
  again, and only then fetches: concurrent readers of a missing object on the node (DataLoader
  workers, DDP ranks) wait for the one fetch instead of each sending a GET. A killed fetcher's
  lock goes with it; the next waiter then fetches.

**Policy** (``"keep"``, the default): an object is admitted while the folder stays within the
inserting reader's budget. To make room, only entries of scopes that no live process reads are
evicted (oldest first); a scope in use keeps what it has. An epoch scan over a
version larger than the budget thus keeps one fixed set of objects on disk and fetches only the
rest, every epoch: ``version - budget`` bytes per epoch, the least any policy can fetch when each
epoch reads a fresh random order. LRU evicts every entry before its next use in a scan (Mosaic
#658) and fetched 0.82 of the version per epoch with a budget of half of it, "keep" 0.501
(docs/benchmarks.md; ``policy="lru"`` is kept for that comparison). ``"lru"`` evicts the least recently used entries
of any scope.

**Reads** map the entry (an entry evicted meanwhile is a miss, never an error: LitData #140). A
file a reader has mapped stays readable after it is unlinked (Linux keeps an unlinked file while
it is open or mapped), so no eviction can pull data from under a reader. Every read checks that
the file is the one already checked (its inode, size and mtime: one ``stat``); a file new to the
process, or changed since, has its trailer and length checked, and its crc32c once per file in
each process; the reader's decoder checks the crc32c of every chunk it serves. A failed check
removes the entry and the object is fetched again: damaged or torn cache files are never served.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from featstore.read._memory_cache import (MappedFiles, _flocked, _try_remove, _unused, held_close, held_open,
                                          join_users)
from featstore.errors import InvalidInput

FOLDER = "featstore-disk"
POLICIES = ("keep", "lru")
CACHE_DIR_ENV = "FEATSTORE_CACHE_DIR"
_MAGIC = b"FSDISK01"
_TRAILER = struct.Struct("<8sQI4x")  # magic, length of the object, crc32c of the object
_USERS, _INFO, _USAGE, _LOCKS, _TMP = "users.lock", "scope.json", "usage", "locks", ".tmp-"
_LOCK_BUCKETS = 1024
#: A process that found no room skips further inserts bigger than the room it saw for this long
#: (a miss then costs no listing of the whole folder); what another process frees meanwhile is
#: used after it.
_FULL_MEMO_S = 1.0
#: Bytes an entry holds beyond its object (the trailer at its end).
ENTRY_TRAILER = _TRAILER.size
#: Marks, in a mapping's checked set (:meth:`MappedFiles.checked`), that the entry's trailer
#: and crc32c were checked for that mapping.
ENTRY_CHECKED = -1


def default_dir() -> str:
    """``$FEATSTORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/featstore``, else ``~/.cache/featstore``
    (a disk, not ``/tmp``, which is often RAM)."""
    if os.environ.get(CACHE_DIR_ENV):
        return os.environ[CACHE_DIR_ENV]
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                        "featstore")


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
    def root(self) -> str:
        """The folder featstore owns: ``<dir>/featstore-disk``."""
        return os.path.join(os.path.abspath(os.path.expanduser(self.dir or default_dir())), FOLDER)

    def resolved(self) -> "DiskCacheOptions":
        """These options with ``max_bytes`` set: when None, what the cache holds now plus half
        the free space of its filesystem."""
        if self.max_bytes is not None:
            return self
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        st = os.statvfs(self.root)
        with _Ledger.locked(self.root) as ledger:
            held = ledger.read()
            if held is None:
                held = ledger.write(_listing(self.root)[1])
        return replace(self, max_bytes=max(1, held + st.f_bavail * st.f_frsize // 2))


class _Ledger:
    """The ``usage`` file, open and exclusively locked (it is the eviction lock too)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    @contextlib.contextmanager
    def locked(cls, root: str) -> Iterator["_Ledger"]:
        with _flocked(os.path.join(root, _USAGE), fcntl.LOCK_EX) as fd:
            yield cls(fd)

    def read(self) -> int | None:
        raw = os.pread(self.fd, 8, 0)
        return int.from_bytes(raw, "little") if len(raw) == 8 else None

    def write(self, used: int) -> int:
        used = max(0, int(used))
        os.pwrite(self.fd, used.to_bytes(8, "little"), 0)
        return used


@dataclass(frozen=True)
class _Entry:
    used_ns: int  # last use (the file's atime, which every hit sets)
    size: int
    path: str
    scope: str


def _scopes(root: str) -> list[str]:
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if len(n) == 32 and all(c in "0123456789abcdef" for c in n))


def _listing(root: str) -> tuple[list[_Entry], int]:
    """Every entry of every scope, and the bytes the folder holds (inserts in progress
    included). A killed writer's temporary file is removed here. Call under the ledger's lock."""
    entries: list[_Entry] = []
    used = 0
    for scope in _scopes(root):
        folder = os.path.join(root, scope)
        try:
            names = os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for name in names:
            if name == _USERS or name.startswith(_INFO):  # scope.json, or one being written
                continue
            path = os.path.join(folder, name)
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


def entry_body(view: memoryview) -> memoryview | None:
    """A mapped entry's object (its trailer off), or None when the entry is torn."""
    return view[:len(view) - _TRAILER.size] if _trailer_ok(view) else None


def _trailer_ok(view: memoryview) -> bool:
    """Whether a mapped entry ends with its trailer and has the length it names (not torn)."""
    if len(view) < _TRAILER.size:
        return False
    magic, size, _ = _TRAILER.unpack(view[len(view) - _TRAILER.size:])
    return magic == _MAGIC and size == len(view) - _TRAILER.size


def _intact(view: memoryview) -> bool:
    """Whether a mapped entry is whole: its trailer, and the crc32c of the object it names."""
    import crc32c

    if not _trailer_ok(view):
        return False
    size, crc = _TRAILER.unpack(view[len(view) - _TRAILER.size:])[1:]
    return crc32c.crc32c(view[:size]) == crc


class DiskCache:
    """One process's handle on one scope of a node's disk cache (see the module docstring).

    >>> cache = DiskCache.open(DiskCacheOptions("/mnt/nvme/cache").resolved(), identity, info)
    >>> data, cached = cache.fetch(name, lambda: storage.read_bytes(key), intact, maps)
    """

    _open: dict[tuple[int, str, str, int, str], "DiskCache"] = {}
    _open_lock = threading.Lock()  # replaced in a forked child (another thread may hold it)

    def __init__(self, options: DiskCacheOptions, scope: str, info: dict[str, Any]) -> None:
        assert options.max_bytes is not None, "resolve the options first"
        self.root, self.scope, self.budget, self.policy = options.root, scope, options.max_bytes, options.policy
        self.folder = os.path.join(self.root, scope)
        self._full = (0.0, 0)  # (monotonic time until which, room then) after an insert found no room
        self._verified: set[tuple[int, int, int]] = set()  # (inode, size, mtime) whose crc32c passed
        os.makedirs(os.path.join(self.root, _LOCKS), mode=0o700, exist_ok=True)
        self._users_fd = self._join()  # held until this process exits
        self._describe(info)

    @classmethod
    def open(cls, options: DiskCacheOptions, identity: str, info: dict[str, Any]) -> "DiskCache":
        """This process's handle on the scope of ``identity`` (one per process, root, scope,
        budget and policy)."""
        scope = hashlib.sha256(identity.encode()).hexdigest()[:32]
        assert options.max_bytes is not None, "resolve the options first"
        key = (os.getpid(), options.root, scope, options.max_bytes, options.policy)
        with cls._open_lock:
            if key not in cls._open:
                cls._open[key] = cls(options, scope, info)
            return cls._open[key]

    def _join(self) -> int:
        """Create the scope's folder if needed and hold a shared lock on its users file."""
        return join_users(self.folder)

    def _describe(self, info: dict[str, Any]) -> None:
        path = os.path.join(self.folder, _INFO)
        if os.path.exists(path):
            return
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as f:
            json.dump({"schema": "featstore.diskcache.scope", "schema_version": 1, **info}, f, sort_keys=True)
        os.replace(tmp, path)

    def close(self) -> None:
        """Stop using this scope in this process (its entries may then be evicted, once no other
        process reads the version either); the handle must not be used afterwards."""
        with DiskCache._open_lock:
            DiskCache._open.pop((os.getpid(), self.root, self.scope, self.budget, self.policy), None)
        with contextlib.suppress(OSError):
            os.close(self._users_fd)

    def path(self, name: str) -> str:
        """The file of entry ``name`` (it may not exist)."""
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"bad cache entry name {name!r}")
        return os.path.join(self.folder, name)

    # -- reading ------------------------------------------------------------------------
    def get(self, name: str, maps: MappedFiles, keep: bool = True) -> memoryview | None:
        """Entry ``name``'s object (mapped, checked), or None: absent, or damaged (then removed)."""
        path = self.path(name)
        try:
            view, sig = maps.get_signed(path, keep)  # a file replaced or changed since is mapped afresh
            checked = maps.checked(path, view)
            if ENTRY_CHECKED not in checked:
                # The whole crc32c once per file in this process (a file changed since has
                # another signature), the length and the trailer once per mapping: a version
                # bigger than the process's kept mappings is mapped afresh each epoch without
                # hashing it again.
                if not (_trailer_ok(view) and (sig in self._verified or _intact(view))):
                    self.discard(name)
                    return None
                checked.add(ENTRY_CHECKED)
                self._verified.add(sig)
            if self.policy == "lru":  # a use (atime only: the mapping's mtime stays); "keep" needs none
                st = os.stat(path)
                os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))
        except FileNotFoundError:
            return None
        return view[:len(view) - _TRAILER.size]

    def fetch(self, name: str, fetch: Callable[[], bytes | None], intact: Callable[[memoryview], bool],
              maps: MappedFiles, keep: bool = True) -> tuple[Any, bool]:
        """``(object, True)`` from the cache, or ``(object, False)`` fetched by ``fetch()`` (None:
        it does not exist) and kept when ``intact`` accepts it and it fits. One fetch per object
        on the node: a miss waits for another process's fetch of the same object."""
        view = self.get(name, maps, keep)
        if view is not None:
            return view, True
        with self._fetch_lock(name):
            view = self.get(name, maps, keep)
            if view is not None:
                return view, True
            data = fetch()
            if data is not None and len(data) and intact(memoryview(data)):
                self._insert(name, data)
        return data, False

    def _fetch_lock(self, name: str) -> contextlib.AbstractContextManager[int]:
        """The node-wide lock a miss of ``name`` takes before it fetches (by a hash of the name)."""
        bucket = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % _LOCK_BUCKETS
        return _flocked(os.path.join(self.root, _LOCKS, str(bucket)), fcntl.LOCK_EX)

    def ensure(self, name: str, fetch: Callable[[], bytes | None], intact: Callable[[memoryview], bool]) -> Any:
        """The path of entry ``name``, fetched and kept first if needed (one fetch per node, as in
        :meth:`fetch`); or, when the object could not be kept, what ``fetch()`` returned."""
        path = self.path(name)
        if os.path.exists(path):
            return path
        with self._fetch_lock(name):
            if os.path.exists(path):
                return path
            data = fetch()
            if data is not None and len(data) and intact(memoryview(data)) and self._insert(name, data):
                return path
        return data

    def discard(self, name: str) -> None:
        """Remove entry ``name`` (it failed a check). A process that maps it keeps its copy."""
        path = self.path(name)
        with _Ledger.locked(self.root) as ledger:
            try:
                size = os.stat(path).st_size
                os.unlink(path)
            except FileNotFoundError:
                return
            held = ledger.read()
            if held is not None:
                ledger.write(held - size)

    # -- writing ------------------------------------------------------------------------
    def _insert(self, name: str, data: bytes) -> bool:
        """Keep ``data`` as entry ``name`` if it fits; False when it does not."""
        import crc32c

        n = len(data) + _TRAILER.size
        until, room = self._full
        if n > room and time.monotonic() < until:
            return False
        tmp = os.path.join(self.folder, f"{_TMP}{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        fd = self._reserve(tmp, n)
        if fd is None:
            return False
        try:
            view = memoryview(data)
            _write_all(fd, view, 0)
            _write_all(fd, memoryview(_TRAILER.pack(_MAGIC, len(view), crc32c.crc32c(view))), len(view))
            with _Ledger.locked(self.root):  # no listing sees neither name
                os.rename(tmp, self.path(name))
        except BaseException as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            self._release(n)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                return False
            raise
        finally:
            held_close(fd)  # drops the writer's lock on the temporary file
        return True

    def _reserve(self, tmp: str, n: int) -> int | None:
        """Make room for ``n`` bytes (by the policy) and create ``tmp`` at that size, locked by
        this writer; None when they do not fit."""
        with _Ledger.locked(self.root) as ledger:
            used = ledger.read()
            if used is None or used + n > self.budget:
                used = self._make_room(n, ledger)
            if used + n > self.budget:
                self._full = (time.monotonic() + _FULL_MEMO_S, self.budget - used)
                return None
            ledger.write(used + n)  # before the file exists: a kill from here on over-counts
            fd = held_open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                os.posix_fallocate(fd, 0, n)  # the disk is full now, not halfway through the write
            except OSError as exc:
                held_close(fd)
                os.unlink(tmp)
                ledger.write(used)
                if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    return None
                raise
            return fd

    def _make_room(self, n: int, ledger: _Ledger) -> int:
        """List the folder, evict what the policy allows until ``n`` more bytes fit, and reset
        the ledger to what is left (under its lock)."""
        entries, used = _listing(self.root)
        if used + n > self.budget:
            scopes = {e.scope for e in entries}
            stale = {s: s != self.scope and _unused(os.path.join(self.root, s, _USERS)) for s in scopes}
            victims = entries if self.policy == "lru" else [e for e in entries if stale[e.scope]]
            for e in sorted(victims, key=lambda e: e.used_ns):
                if used + n <= self.budget:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)
                    used -= e.size
            left = {e.scope for e in entries if os.path.exists(e.path)}
            for s in stale:
                if stale[s] and s not in left:
                    _try_remove(os.path.join(self.root, s))
        return ledger.write(used)

    def _release(self, n: int) -> None:
        with _Ledger.locked(self.root) as ledger:
            held = ledger.read()
            if held is not None:
                ledger.write(held - n)

    def clear(self) -> int:
        """Remove this scope's entries (readers that map one keep it); the bytes removed."""
        return _clear(self.root, lambda scope, in_use: scope == self.scope)

    def used_bytes(self) -> int:
        """Bytes the whole folder holds now, counted afresh (the ledger is reset to it)."""
        with _Ledger.locked(self.root) as ledger:
            return ledger.write(_listing(self.root)[1])


def _fresh_lock_in_child() -> None:
    DiskCache._open_lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


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
    root = DiskCacheOptions(cache_dir).root
    if not os.path.isdir(root):
        return []
    with _Ledger.locked(root) as ledger:
        entries, used = _listing(root)
        ledger.write(used)
    out = []
    for scope in _scopes(root):
        mine = [e for e in entries if e.scope == scope]
        try:
            with open(os.path.join(root, scope, _INFO)) as f:
                info = json.load(f)
        except (OSError, ValueError):
            info = {}
        out.append(CachedScope(scope, str(info.get("store", "?")), str(info.get("version", "?")), len(mine),
                               sum(e.size for e in mine), not _unused(os.path.join(root, scope, _USERS))))
    return out


def clear_disk_cache(cache_dir: str | None = None, *, unused_only: bool = False) -> int:
    """Empty the node's disk cache under ``cache_dir`` (``unused_only``: only the versions no
    live process reads); the bytes removed. Safe while readers run: a reader keeps what it has
    mapped and fetches the rest again.

    >>> clear_disk_cache("/mnt/nvme/cache", unused_only=True)
    536870912
    """
    root = DiskCacheOptions(cache_dir).root
    if not os.path.isdir(root):
        return 0
    return _clear(root, lambda scope, in_use: not (unused_only and in_use))


def _clear(root: str, chosen: Callable[[str, bool], bool]) -> int:
    freed = 0
    with _Ledger.locked(root) as ledger:
        entries, used = _listing(root)
        in_use = {s: not _unused(os.path.join(root, s, _USERS)) for s in _scopes(root)}
        for e in entries:
            if chosen(e.scope, in_use.get(e.scope, False)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)
                    freed += e.size
        for s, busy in in_use.items():
            if not busy and chosen(s, busy):
                _try_remove(os.path.join(root, s))
        ledger.write(used - freed)
    return freed
