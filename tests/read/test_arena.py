"""The arena (:mod:`featstore.read`): files mapped back to back in one address range, rows
gathered from any of them with one ``index_select``. Real files, real mappings."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from featstore.read.shards._arena import Arena

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the arena maps with Linux's flags")

PAGE = os.sysconf("SC_PAGE_SIZE")


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def held(arena: Arena, slot, n: int) -> bytes:
    return bytes(arena.view(slot)[:n])


def test_rows_are_the_bytes_at_their_offsets_across_files(tmp_path):
    rng = np.random.default_rng(0)
    files = [write(tmp_path / f"f{i}", rng.bytes(int(rng.integers(PAGE, 3 * PAGE)))) for i in range(4)]
    arena = Arena(slot_bytes=3 * PAGE, slots=8, max_bytes=2**30)
    slots = [arena.pin(str(f)) for f in files]
    assert len({s.index for s in slots}) == 4
    row = 12  # int32 units: 48 bytes
    want, offsets = [], []
    for _ in range(200):
        i = int(rng.integers(0, 4))
        data = files[i].read_bytes()
        start = int(rng.integers(0, (len(data) - 4 * row) // 4)) * 4
        want.append(np.frombuffer(data[start:start + 4 * row], dtype=np.int32))
        offsets.append((slots[i].index * arena.slot_bytes + start) // 4)
    got = torch.index_select(arena.rows(4, row), 0, torch.tensor(offsets)).numpy()
    assert np.array_equal(got, np.stack(want))


def test_a_held_file_is_found_again_and_a_replaced_one_is_mapped_afresh(tmp_path):
    f = write(tmp_path / "shard", b"a" * PAGE)
    arena = Arena(slot_bytes=PAGE, slots=4, max_bytes=2**30)
    first = arena.pin(str(f))
    assert arena.pin(str(f)) is first and first.pins == 2
    tmp = write(tmp_path / "shard.new", b"b" * PAGE)
    os.replace(tmp, f)  # a new inode, as a tool rewrites a file
    fresh = arena.pin(str(f))
    assert fresh is not first and fresh.index != first.index
    assert held(arena, fresh, 4) == b"bbbb" and held(arena, first, 4) == b"aaaa"  # the old one, still held
    arena.unpin(first)
    assert arena.mapped_bytes() == 2 * PAGE  # held twice: still mapped
    arena.unpin(first)
    assert arena.mapped_bytes() == PAGE and fresh.pins == 1


def test_budget_holds_once_windows_let_go_and_no_slot_is_taken_while_held(tmp_path):
    files = [write(tmp_path / f"f{i}", bytes([i]) * PAGE) for i in range(6)]
    arena = Arena(slot_bytes=PAGE, slots=3, max_bytes=2 * PAGE)
    slots = [arena.pin(str(f)) for f in files[:3]]
    assert arena.mapped_bytes() == 3 * PAGE  # over the budget while all are held
    assert arena.pin(str(files[3])) is None  # every slot held: the caller reads another way
    arena.unpin(slots[0])
    assert arena.mapped_bytes() == 2 * PAGE  # trimmed as soon as one is free
    fourth = arena.pin(str(files[3]))
    assert fourth is not None and fourth.index == slots[0].index
    assert [held(arena, s, 1) for s in (slots[1], slots[2], fourth)] == [b"\x01", b"\x02", b"\x03"]
    for s in (slots[1], slots[2], fourth):
        arena.unpin(s)
    assert arena.mapped_bytes() <= 2 * PAGE


def test_oversized_missing_and_removed_files(tmp_path):
    arena = Arena(slot_bytes=PAGE, slots=2, max_bytes=2**30)
    assert arena.pin(str(write(tmp_path / "big", b"x" * (PAGE + 1)))) is None
    assert arena.pin(str(write(tmp_path / "empty", b""))) is None
    with pytest.raises(FileNotFoundError):
        arena.pin(str(tmp_path / "nothing"))
    f = write(tmp_path / "evicted", b"y" * 100)
    arena.unpin(arena.pin(str(f)))
    assert arena.mapped_bytes() == 100
    f.unlink()  # as another process evicts a cached shard
    arena.drop_stale()
    assert arena.mapped_bytes() == 0
