"""Shard objects of one array mapped back to back in one reserved address range (Linux).

A shuffled batch takes rows from every shard of its window. Gathered shard by shard with numpy
(one thread) and put in place in the batch, that took ~3x one ``torch.index_select`` over a
single tensor (docs/benchmarks.md, issue 12). An :class:`Arena` reserves one address range per
process and maps each shard object into a *slot* of it (``mmap`` with ``MAP_FIXED``), so the rows
of all of a window's shards are rows of one strided tensor view over the range, and a batch of an
array is one ``index_select`` over it: one copy, straight from the page cache, on torch's
intra-op threads, as from an in-memory tensor.

Slots are reused least recently used beyond a byte budget (faulting a mapping in again costs
about as much as copying it), and a slot is never remapped while a window holds it
(:meth:`Arena.pin` / :meth:`Arena.unpin`): a row offset always lands on a mapping of the file it
was computed for. A file rewritten or replaced since it was mapped gets a fresh slot (its chunks
checked again, see :class:`Slot`). Where this is unavailable (not Linux, or
``FEATSTORE_ARENA=0``) :func:`process_arena` returns None and the reader gathers shard by shard.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from featstore.read.shards._cache import Sig, file_sig, process_local

# Linux's values (asm-generic/mman-common.h); the arena is only used on Linux.
_PROT_NONE, _PROT_READ = 0x0, 0x1
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
_MAP_NORESERVE, _MAP_POPULATE = 0x4000, 0x8000
_MAP_FAILED = ctypes.c_void_p(-1).value

#: Torch dtype of each unit size the rows are addressed in.
_UNITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@functools.cache
def _libc_mmap() -> Callable[..., int | None]:
    fn = ctypes.CDLL(None, use_errno=True).mmap  # the process's own C library
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return fn


def _map(addr: int | None, size: int, prot: int, flags: int, fd: int = -1) -> int:
    got = _libc_mmap()(addr, size, prot, flags, fd, 0)
    if got is None or got == _MAP_FAILED or (addr is not None and got != addr):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap failed: {os.strerror(err)}")
    return int(got)


def supported() -> bool:
    """Whether shards can be mapped into an arena here (64-bit Linux, not switched off with
    ``FEATSTORE_ARENA=0``)."""
    return sys.platform.startswith("linux") and sys.maxsize > 2**32 and os.environ.get("FEATSTORE_ARENA") != "0"


@dataclass(eq=False)
class Slot:
    """One mapped file in the arena: ``index`` of its slot, the file's identity when mapped,
    the windows holding it, and the chunks whose crc32c has been checked on this mapping."""

    index: int
    sig: Sig
    nbytes: int
    pins: int = 0
    checked: set[int] = field(default_factory=set)
    retired: bool = False


class Arena:
    """``slots`` slots of ``slot_bytes`` each in one reserved address range; the files mapped
    into them add up to at most ``max_bytes`` once no window holds the older ones (thread-safe).

    >>> arena = Arena(slot_bytes=2**20, slots=8, max_bytes=4 * 2**20)
    >>> slot = arena.pin("/data/store/v/logits/c/0/0")       # doctest: +SKIP
    >>> rows = arena.rows(unit=4, row_units=1000)             # every 1000 int32 units from any offset
    >>> arena.unpin(slot)                                     # doctest: +SKIP
    """

    def __init__(self, slot_bytes: int, slots: int, max_bytes: int) -> None:
        page = mmap.PAGESIZE
        self.slot_bytes = -(-slot_bytes // page) * page
        self.n_slots = slots
        self.max_bytes = max_bytes
        self.total = self.slot_bytes * slots
        # Address space only: no memory, no swap is reserved for the range.
        self.base = _map(None, self.total, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE)
        self._flat = torch.from_numpy(np.frombuffer(memoryview((ctypes.c_char * self.total).from_address(self.base)),
                                                    dtype=np.uint8))
        self._views: dict[tuple[int, int], torch.Tensor] = {}
        self._slots: OrderedDict[str, Slot] = OrderedDict()  # least recently used first
        self._free = list(range(slots - 1, -1, -1))
        self._mapped = 0
        self._lock = threading.Lock()

    # -- slots --------------------------------------------------------------------------
    def pin(self, path: str) -> Slot | None:
        """Map ``path`` into a slot (or find it mapped with the same content) and hold the slot
        until :meth:`unpin`. None when the file does not fit a slot or every slot is held.
        Raises ``FileNotFoundError`` for a missing file."""
        # The signature is the opened file's (see cache.MappedFiles.get: a path replaced between
        # a stat and the open would be held under the new file's signature with the old bytes).
        fd = os.open(path, os.O_RDONLY)
        try:
            return self._pin_fd(path, fd)
        finally:
            os.close(fd)

    def _pin_fd(self, path: str, fd: int) -> Slot | None:
        st = os.fstat(fd)
        sig = (st.st_ino, st.st_size, st.st_mtime_ns)
        if not 0 < st.st_size <= self.slot_bytes:
            return None
        with self._lock:
            slot = self._slots.get(path)
            if slot is not None and slot.sig == sig:
                slot.pins += 1
                self._slots.move_to_end(path)
                return slot
            if slot is not None:  # rewritten or replaced since: its old mapping goes once free
                del self._slots[path]
                if slot.pins == 0:
                    self._unmap(slot)
                else:
                    slot.retired = True
            if not self._free and not self._evict_one():
                return None
            index = self._free.pop()
            try:
                # Faulted in here, in one call, not page by page in the batch gathers.
                _map(self.base + index * self.slot_bytes, st.st_size, _PROT_READ,
                     _MAP_SHARED | _MAP_FIXED | _MAP_POPULATE, fd)
            except OSError:
                self._free.append(index)
                raise
            slot = Slot(index, sig, st.st_size, pins=1)
            self._slots[path] = slot
            self._mapped += slot.nbytes
            self._trim()
            return slot

    def unpin(self, slot: Slot) -> None:
        """Release one hold on ``slot`` (from :meth:`pin`)."""
        with self._lock:
            slot.pins -= 1
            if slot.retired and slot.pins == 0:
                self._unmap(slot)
            else:
                self._trim()

    def view(self, slot: Slot) -> memoryview:
        """The mapped file's bytes (valid while ``slot`` is held)."""
        at = slot.index * self.slot_bytes
        return self._flat.numpy().data[at:at + slot.nbytes]

    def rows(self, unit: int, row_units: int) -> torch.Tensor:
        """The whole range as overlapping rows of ``row_units`` units of ``unit`` bytes: row
        ``k`` starts at unit ``k``. ``index_select`` over it copies rows from any unit offset
        (one ``memcpy`` per row); offsets must lie in held slots."""
        key = (unit, row_units)
        if key not in self._views:
            flat = self._flat.view(_UNITS[unit])
            self._views[key] = torch.as_strided(flat, (flat.numel() - row_units + 1, row_units), (1, 1))
        return self._views[key]

    def drop_stale(self) -> None:
        """Unmap every slot no window holds whose file was removed or replaced since (a shard
        another process evicted from the shared cache: its memory is freed once unmapped)."""
        with self._lock:
            for path, slot in list(self._slots.items()):
                if slot.pins == 0 and file_sig(path) != slot.sig:
                    del self._slots[path]
                    self._unmap(slot)

    def mapped_bytes(self) -> int:
        """Bytes of files mapped now, held or not."""
        with self._lock:
            return self._mapped

    # -- under the lock -----------------------------------------------------------------
    def _evict_one(self) -> bool:
        """Unmap the least recently used slot no window holds; False: every slot is held."""
        victim = next((p for p, s in self._slots.items() if s.pins == 0), None)
        if victim is not None:
            self._unmap(self._slots.pop(victim))
        return victim is not None

    def _trim(self) -> None:
        while self._mapped > self.max_bytes and self._evict_one():
            pass

    def _unmap(self, slot: Slot) -> None:
        # Back to reserved address space: the file is no longer mapped, the range stays ours.
        _map(self.base + slot.index * self.slot_bytes, self.slot_bytes, _PROT_NONE,
             _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED)
        self._mapped -= slot.nbytes
        self._free.append(slot.index)


#: Slots of an arena at least (address space only): a window's pieces are held together, and
#: up to three windows are in flight.
MIN_SLOTS = 64
#: ... and at most: each mapped slot is a memory map of its own, and Linux allows a process
#: ~65,000 (``vm.max_map_count``); an array of tiny shards (labels) must not use them up.
MAX_SLOTS = 2048


def process_arena(object_bytes: int, max_bytes: int) -> Arena | None:
    """This process's arena for shard objects of up to ``object_bytes`` (one per slot size,
    shared by every reader of the process), or None where arenas are unavailable."""
    if not supported():
        return None
    slot_bytes = -(-object_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    slots = max(MIN_SLOTS, min(MAX_SLOTS, max_bytes // slot_bytes + 1))
    try:
        return process_local(("arena", slot_bytes), lambda: Arena(slot_bytes, slots, max_bytes))
    except OSError:  # no address space for it: gather shard by shard
        return None
