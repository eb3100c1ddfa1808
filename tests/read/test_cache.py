"""The reader's in-place paths: mapped local shards and the shared decoded cache (cache="memory").

Real parts only: real DataLoader worker processes, a real child process killed with SIGKILL,
files in /dev/shm, damaged shard objects on disk.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import featstore
from featstore.versions import stored
from featstore import CorruptChunk, InvalidInput
from featstore.read.shards._cache import NodeCache, Space, sweep_stale
from tests.helpers import served


N = 333
SPP = 32
REPO = Path(__file__).resolve().parents[2]


#: This file's names for the shared versions it reads (tests/helpers.py: SharedVersions): local
#: zstd (decoded through the cache), local uncompressed (mapped in place), S3 (compression "auto":
#: zstd) and S3 uncompressed.
KINDS = {"zstd": "local-zstd", "raw": "local-raw", "s3": "s3", "s3-raw": "s3-raw"}


class _Versions(dict):
    """The shared versions by this file's names, each written on first use."""

    def __init__(self, shared, endpoint: str) -> None:
        super().__init__()
        self.shared, self.endpoint = shared, endpoint

    def __missing__(self, kind: str) -> featstore.Version:
        return self.shared[KINDS[kind]]


@pytest.fixture(scope="module")
def versions(shared_versions, moto_endpoint):
    return _Versions(shared_versions, moto_endpoint)


def batches(ds, workers: int = 0) -> list[dict[str, torch.Tensor]]:
    if not workers:
        return list(ds)
    return list(DataLoader(ds, batch_size=None, num_workers=workers, timeout=120))


def same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b, strict=True))


def folder_of(ds) -> Path:
    return Path(ds.process_reads().memory.folder)


def entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


def own_copy(versions: _Versions, kind: str, tmp_path: Path) -> featstore.Version:
    """``versions[kind]`` copied into a store of its own (local folder or S3 bucket): a cache
    folder of its own, and shard objects a test may delete."""
    v = versions[kind]
    if not kind.startswith("s3"):
        return private_copy(v, tmp_path)
    import uuid

    import boto3

    s3 = boto3.client("s3", endpoint_url=versions.endpoint)
    src, prefix = stored(v).storage.url[len("s3://"):].split("/", 1)
    dst = f"cache-copy-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(Bucket=dst)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=src):
        for obj in page.get("Contents", []):
            s3.copy_object(Bucket=dst, Key=obj["Key"], CopySource={"Bucket": src, "Key": obj["Key"]})
    return featstore.open_store(f"s3://{dst}/{prefix}", {"endpoint_url": versions.endpoint}).open(v.ref)


def delete_shard_objects(v: featstore.Version) -> int:
    """Delete every stored shard object of the arrays a reader serves of ``v`` (local or S3);
    from then on only a cache can serve its batches. Returns how many were deleted."""
    arrays = tuple(f"{f}/c/" for f in served(v))
    keys = [k for k in stored(v).storage.find(stored(v).key) if k[len(stored(v).key) + 1:].startswith(arrays)]
    stored(v).storage.delete_many(keys)
    assert not [k for k in stored(v).storage.find(stored(v).key) if k[len(stored(v).key) + 1:].startswith(arrays)]
    return len(keys)


def all_entries(v: featstore.Version) -> list[str]:
    """The cache entries of every shard of every array a reader serves of ``v``."""
    return sorted(f"{f}.{s}" for f in served(v) for s in range(v.manifest.layout.n_shards))


@pytest.mark.parametrize("kind", ["zstd", "s3", "s3-raw"])
@pytest.mark.parametrize("shuffle,partition,world", [(True, None, 1), (False, None, 1), (True, "pad", 3),
                                                      (True, "drop", 2), (False, "even", 2)])
def test_cache_gives_identical_batches(versions, kind, shuffle, partition, world, tmp_path):
    """Batches through the shared cache equal plain reads, in every order and partition: epoch 0
    decodes every shard into a fresh cache (each rank its own), epoch 1 is served by the cache
    alone (every stored shard object is deleted in between). Local zstd, S3 zstd and S3
    uncompressed (a remote array goes through the cache whatever its compression)."""
    v = own_copy(versions, kind, tmp_path)
    assert {a.compression for a in served(v).values()} == {"none" if kind == "s3-raw" else "zstd"}

    def opts(rank):
        return dict(batch_size=20, shuffle=shuffle, seed=5, partition=partition, rank=rank, world_size=world)

    want = {}
    for rank in range(world):
        plain = v.dataset(**opts(rank))
        for epoch in (0, 1):
            plain.set_epoch(epoch)
            want[rank, epoch] = batches(plain)
    cached = [v.dataset(**opts(rank), cache="memory", cache_bytes=2**24) for rank in range(world)]
    assert entries(folder_of(cached[0])) == []
    for rank in range(world):
        assert same(batches(cached[rank]), want[rank, 0]), (0, rank)  # decoded and inserted
    assert entries(folder_of(cached[0])) == all_entries(v)
    assert delete_shard_objects(v) == len(all_entries(v))
    for rank in range(world):
        cached[rank].set_epoch(1)
        assert same(batches(cached[rank]), want[rank, 1]), (1, rank)  # served by the cache alone


@pytest.mark.parametrize("arena", ["1", "0"])
def test_local_uncompressed_arrays_are_read_in_place_not_copied_into_the_cache(versions, tmp_path, arena,
                                                                               monkeypatch):
    """The README's rule: uncompressed arrays of a local store are not copied into the cache
    (the page cache holds them once for the machine). With cache="memory" they are read from
    their mapped objects: the same batches, and the cache folder stays empty."""
    monkeypatch.setenv("FEATSTORE_ARENA", arena)
    v = private_copy(versions["raw"], tmp_path)
    assert {a.compression for a in served(v).values()} == {"none"}
    plain = v.dataset(batch_size=20, seed=5)
    ds = v.dataset(batch_size=20, seed=5, cache="memory", cache_bytes=2**24)
    for epoch in (0, 1):
        plain.set_epoch(epoch)
        ds.set_epoch(epoch)
        assert same(batches(ds), batches(plain)), epoch
    assert entries(folder_of(ds)) == []


def test_resume_with_cache_continues_like_without(versions):
    v = versions["zstd"]
    plain = list(v.dataset(batch_size=16, seed=9))
    first = v.dataset(batch_size=16, seed=9, cache="memory", cache_bytes=2**24)
    it = iter(first)
    for _ in range(7):
        next(it)
    state = first.state_dict()
    resumed = v.dataset(batch_size=16, seed=9, cache="memory", cache_bytes=2**24)
    resumed.load_state_dict(state)
    assert same(list(resumed), plain[7:])


def test_budget_is_respected_and_oversized_shards_still_read(versions):
    v = versions["zstd"]
    shard = SPP * 5 * 4  # one logits shard, decoded (the largest entry)
    big = v.dataset(batch_size=32, seed=1, cache="memory", cache_bytes=2**24)
    batches(big)  # fills the version's cache beyond the next reader's budget
    assert big.process_reads().memory.used_bytes() > 3 * shard
    ds = v.dataset(batch_size=32, seed=1, cache="memory", cache_bytes=3 * shard)
    ref = batches(v.dataset(batch_size=32, seed=1))
    for _ in range(2):
        ds.set_epoch(0)  # the same epoch twice (a new iteration would read the next)
        assert same(batches(ds), ref)
        # within the budget: an insert renames its shard into place under the eviction lock, so
        # a concurrent insert making room never misses it in its listing
        assert 0 < ds.process_reads().memory.used_bytes() <= 3 * shard
    tiny = v.dataset(batch_size=32, seed=1, cache="memory", cache_bytes=8)  # nothing fits
    assert same(batches(tiny), ref)


def test_workers_share_one_copy_and_later_epochs_read_no_storage(versions, tmp_path):
    src = versions["zstd"]
    root = tmp_path / "store"
    shutil.copytree(stored(src).storage.root, root)
    v = featstore.open_store(root).open(src.ref)
    plain = v.dataset(batch_size=16, seed=2)
    plain.set_epoch(1)
    want = batches(plain, workers=2)

    ds = v.dataset(batch_size=16, seed=2, cache="memory", cache_bytes=2**24)
    batches(ds, workers=2)  # epoch 0: each worker decodes its own shards into the one folder
    folder = folder_of(ds)
    n_shards = -(-N // SPP)
    assert entries(folder) == sorted(f"{f}.{s}" for f in ("features", "logits", "target") for s in range(n_shards))
    for chunks in Path(stored(v).storage.path(stored(v).key)).glob("*/c"):
        shutil.rmtree(chunks)  # from now on, only the cache can serve
    ds.set_epoch(1)
    assert same(batches(ds, workers=2), want)  # new worker processes, other shards each


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
def test_compressed_objects_not_kept_mapped_once_cached(versions, tmp_path):
    """A compressed shard decoded into the cache is read once: its stored object does not stay
    mapped (resident) in the process that decoded it."""
    v = private_copy(versions["zstd"], tmp_path)
    ds = v.dataset(batch_size=16, seed=3, cache="memory", cache_bytes=2**24)
    want = batches(versions["zstd"].dataset(batch_size=16, seed=3))  # mapped in another folder
    assert same(batches(ds), want)  # decoded and inserted
    ds.set_epoch(0)
    assert same(batches(ds), want)  # served from the cache
    folder = os.path.realpath(stored(v).storage.path(stored(v).key))
    with open("/proc/self/maps") as f:
        mapped = [ln for ln in f if folder in ln]
    assert mapped == []
    assert entries(folder_of(ds))  # the cache itself is mapped and kept


def test_bad_options_are_refused(versions):
    with pytest.raises(InvalidInput, match="cache must be one of"):
        versions["raw"].dataset(cache="disk-please")
    with pytest.raises(InvalidInput, match="cache_bytes"):
        versions["raw"].dataset(cache="memory", cache_bytes=0)


# -- lifetime: the folder goes with its last user ---------------------------------------------
def child(root: str, ref: str, mode: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-m", "tests.cache_child", root, ref, mode, *extra], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_two_ranks_share_the_cache(versions, tmp_path):
    """Two rank processes on one machine, one cache: epoch 0 each decodes its own shards, then
    every stored shard object is deleted; epoch 1 gives each rank exactly the batches of a plain
    read, including shards only the other rank decoded."""
    import numpy as np

    from tests.cache_child import RANK_OPTIONS

    src = versions["zstd"]
    root = tmp_path / "store"
    shutil.copytree(stored(src).storage.root, root)
    v = featstore.open_store(root).open(src.ref)
    plain = {k: v for k, v in RANK_OPTIONS.items() if not k.startswith("cache")}
    want, shards = {}, {}
    for r in (0, 1):
        ds = src.dataset(rank=r, **plain)  # the untouched original: plain reads
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            read = list(ds)  # once: iterating again without set_epoch would read the next epoch
            want[r, epoch] = {k: torch.cat([b[k] for b in read]).numpy() for k in ("index", *served(v))}
            shards[r, epoch] = {p.shard for w in ds.plan().windows for p in w}
    for r in (0, 1):  # each rank's epoch 1 needs shards only the other rank decoded in epoch 0
        assert shards[r, 1] - shards[r, 0] and shards[r, 1] - shards[r, 0] <= shards[1 - r, 0]
    sync = tmp_path / "sync"
    sync.mkdir()
    ranks = [child(str(root), src.ref, "rank", str(r), str(sync)) for r in (0, 1)]
    deadline = time.monotonic() + 240
    while not all((sync / f"done-{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in ranks), [p.communicate() for p in ranks]
        time.sleep(0.05)
    assert delete_shard_objects(v) == len(all_entries(v))  # epoch 1: only what the two ranks cached
    (sync / "deleted").touch()
    for p in ranks:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
    for r in (0, 1):
        for epoch in (0, 1):
            with np.load(sync / f"epoch{epoch}-{r}.npz") as got:
                assert sorted(got.files) == sorted(want[r, epoch])
                for k in got.files:
                    np.testing.assert_array_equal(got[k], want[r, epoch][k], err_msg=f"rank {r} epoch {epoch} {k}")


def private_copy(v, tmp_path: Path) -> featstore.Version:
    """The version in a store of its own: a cache folder no other test (or this process) uses."""
    shutil.copytree(stored(v).storage.root, tmp_path / "store")
    return featstore.open_store(tmp_path / "store").open(v.ref)


@pytest.mark.parametrize("mode", ["normal", "kill-worker"])
def test_folder_removed_when_the_last_user_exits(versions, mode, tmp_path):
    v = private_copy(versions["zstd"], tmp_path)
    proc = child(stored(v).storage.root, v.ref, mode)
    folder = Path(proc.stdout.readline().strip())
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    assert folder.name.startswith("featstore-cache-")
    if mode == "kill-worker":
        assert "worker lost" in out
    else:
        assert f"samples {N}" in out
    assert not folder.exists()  # no leaked segment, also after a worker's SIGKILL


def test_folder_of_killed_users_is_swept_by_the_next_user(versions, tmp_path):
    v = private_copy(versions["zstd"], tmp_path)
    proc = child(stored(v).storage.root, v.ref, "hang")
    folder = Path(proc.stdout.readline().strip())
    assert proc.stdout.readline().startswith("samples") and proc.stdout.readline().strip() == "ready"
    assert entries(folder)  # decoded shards in shared memory
    os.killpg(proc.pid, signal.SIGKILL)  # the process and its workers at once: nobody cleans up
    proc.communicate(timeout=60)
    assert folder.exists()
    deadline = time.monotonic() + 120  # a hang guard, not a time bound: a loaded machine reaps slowly
    while folder.exists() and time.monotonic() < deadline:  # the workers' locks go as they die
        sweep_stale(str(folder.parent))  # what the next user's open does
        time.sleep(0.05)
    assert not folder.exists()


def test_crashed_writer_temp_file_is_reclaimed(tmp_path):
    cache = NodeCache.open(Space.for_memory("x", root=str(tmp_path)), "x", 4096)
    orphan = Path(cache.folder) / ".tmp-a.0.dead"
    orphan.write_bytes(b"\0" * 4000)  # no process holds its lock: its writer died
    view = cache.put("b", 1000, lambda buf: buf.__setitem__(slice(None), b"\1" * 1000))
    assert bytes(view[:2]) == b"\1\1" and not orphan.exists() and cache.used_bytes() == 1000


# -- damage: detected on the mapped path and never cached --------------------------------------
def flip(path: Path, at: float = 0.3) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x08
    path.write_bytes(bytes(data))


def test_corrupt_shard_detected_on_the_mapped_path(versions, tmp_path):
    src = versions["raw"]
    shutil.copytree(stored(src).storage.root, tmp_path / "store")
    store = featstore.open_store(tmp_path / "store")
    v = store.open(src.ref)
    assert v.manifest.arrays["logits"].compression == "none"
    flip(Path(stored(v).storage.path(stored(v).key)) / "logits" / "c" / "4" / "0")
    with pytest.raises(CorruptChunk, match="logits/c/4/0"):
        list(v.dataset(batch_size=16, fields=("logits",)))
    with pytest.raises(CorruptChunk, match="logits/c/4/0"):
        batches(v.dataset(batch_size=16), workers=2)


def test_mapped_chunks_are_checked_once_per_map_and_again_after_a_rewrite(versions, tmp_path, monkeypatch):
    """Epoch 2 of one reader checks no crc32c of a mapped shard it checked in epoch 1; a shard
    object replaced on disk between epochs is mapped afresh and its damage is caught."""
    import featstore.format._shard_decoder as fmt

    src = versions["raw"]
    shutil.copytree(stored(src).storage.root, tmp_path / "store")
    v = featstore.open_store(tmp_path / "store").open(src.ref)
    checks: list[str] = []
    real = fmt._check_crc
    monkeypatch.setattr(fmt, "_check_crc", lambda data, what, ref: checks.append(what) or real(data, what, ref))
    ds = v.dataset(batch_size=16, fields=("logits",))
    first = batches(ds)
    n_first = len(checks)
    ds.set_epoch(1)
    second = batches(ds)
    first_chunks = [w for w in checks[:n_first] if w.startswith("chunk")]
    chunk_checks = [w for w in checks[n_first:] if w.startswith("chunk")]
    # epoch 1: every chunk of every shard checked once (not only the shard indices); epoch 2: none
    n_chunks = sum(-(-(b - a) // 16) for a, b in map(v.manifest.layout.shard_range, range(v.manifest.layout.n_shards)))
    assert len(first_chunks) == n_chunks and chunk_checks == [] and len(second) == len(first)
    obj = Path(stored(v).storage.path(stored(v).key)) / "logits" / "c" / "4" / "0"
    data = bytearray(obj.read_bytes())
    data[int(len(data) * 0.3)] ^= 0x08
    tmp = obj.with_name("0.new")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, obj)  # as a tool rewrites a file: a new inode
    ds.set_epoch(2)
    with pytest.raises(CorruptChunk, match="logits/c/4/0"):
        batches(ds)


def test_corrupt_shard_never_enters_the_cache(versions, tmp_path):
    src = versions["zstd"]
    shutil.copytree(stored(src).storage.root, tmp_path / "store")
    v = featstore.open_store(tmp_path / "store").open(src.ref)
    flip(Path(stored(v).storage.path(stored(v).key)) / "features" / "c" / "3" / "0", at=0.5)
    ds = v.dataset(batch_size=16, cache="memory", cache_bytes=2**24)
    for _ in range(2):  # the second time too: nothing bad was kept
        with pytest.raises(CorruptChunk, match="features/c/3/0"):
            list(ds)
        assert "features.3" not in entries(folder_of(ds))


@pytest.mark.parametrize("seed", range(6))
def test_in_place_span_equals_the_row_by_row_gather(seed):
    """An unshuffled batch's block copies give exactly the rows the shuffled path's gather gives,
    across pieces that start mid-shard and batches that cross chunk and piece edges."""
    import numpy as np

    from featstore.read.shards._gather import InPlace
    from featstore.read.plans._assignment import Piece

    rng = np.random.default_rng(seed)
    chunk_rows, n_chunks = int(rng.integers(1, 9)), int(rng.integers(1, 6))
    sources, pieces = [], []
    for shard in range(int(rng.integers(1, 5))):
        sources.append(rng.standard_normal((n_chunks, chunk_rows, 3)).astype(np.float32))
        lo = int(rng.integers(0, n_chunks * chunk_rows))
        pieces.append(Piece(shard, lo, int(rng.integers(lo + 1, n_chunks * chunk_rows + 1))))
    place = InPlace(sources, tuple(pieces), chunk_rows)
    total = sum(p.size for p in pieces)
    for _ in range(20):
        lo = int(rng.integers(0, total))
        hi = int(rng.integers(lo + 1, total + 1))
        pos = np.arange(lo, hi)
        assert np.array_equal(place.span(lo, hi), place.take(place.groups(pos), len(pos)))


def _arenas() -> list:
    """This process's arenas (featstore.read.shards._arena.process_arena's)."""
    from featstore.read.shards import _cache
    return [v for k, v in _cache._PROCESS.items() if k[0] == "arena"]


def _fresh_arenas(monkeypatch) -> None:
    """The process's registry without its arenas (restored afterwards)."""
    from featstore.read.shards import _cache
    monkeypatch.setattr(_cache, "_PROCESS", {k: v for k, v in _cache._PROCESS.items() if k[0] != "arena"})


def _held_slots() -> int:
    return sum(s.pins for a in _arenas() for s in a._slots.values())


@pytest.fixture
def windows(monkeypatch) -> Counter:
    """How the reader gathers each (window, array) it places: ``"arena"`` (one ArenaRows) or
    ``"in place"`` (shard by shard, InPlace), counted where the reader decides
    (``FeatureDataset._arena_rows``, wrapped: it still does what it did)."""
    from featstore.read.shards._gather import ArenaRows
    from featstore.read.shards._sources import ArenaSource

    counts: Counter = Counter()
    real = ArenaSource._rows

    def counted(self, *args):
        got = real(self, *args)
        counts["arena" if isinstance(got, ArenaRows) else "in place"] += 1
        return got

    monkeypatch.setattr(ArenaSource, "_rows", counted)
    return counts


@pytest.mark.parametrize("kind,cache", [("raw", None), ("zstd", "memory"), ("s3", "memory")])
@pytest.mark.parametrize("shuffle,partition,world", [(True, None, 1), (False, None, 1), (True, "pad", 3)])
def test_arena_gives_the_batches_of_the_per_shard_gather(versions, kind, cache, shuffle, partition, world,
                                                         monkeypatch, windows):
    """One index_select over the arena == the shard-by-shard numpy gather, for stored objects
    (crc32c between chunks) and the cache's decoded shards, in every order and partition; with
    the arena on, every window of every array is gathered from it."""
    v = versions[kind]
    for rank in range(world):
        opts = dict(batch_size=20, shuffle=shuffle, seed=3, partition=partition, rank=rank, world_size=world,
                    cache=cache, cache_bytes=2**24)
        for epoch in (0, 1):
            got = {}
            for env in ("0", "1"):
                monkeypatch.setenv("FEATSTORE_ARENA", env)
                windows.clear()
                ds = v.dataset(**opts)
                ds.set_epoch(epoch)
                got[env] = batches(ds)
                n_windows = len(ds.plan().windows) * len(served(v))
                assert windows == (Counter(arena=n_windows) if env == "1" else Counter()), (env, epoch, rank)
            assert same(got["1"], got["0"]), (epoch, rank)
    assert _held_slots() == 0


def test_arena_slots_are_let_go_after_an_epoch_an_abandoned_one_and_an_error(versions, tmp_path):
    v = versions["raw"]
    batches(v.dataset(batch_size=16))
    assert _held_slots() == 0
    it = iter(v.dataset(batch_size=16))
    next(it)
    assert _held_slots() > 0  # the windows in flight hold theirs
    it.close()
    assert _held_slots() == 0
    shutil.copytree(stored(v).storage.root, tmp_path / "store")
    bad = featstore.open_store(tmp_path / "store").open(v.ref)
    flip(Path(stored(bad).storage.path(stored(bad).key)) / "features" / "c" / "7" / "0")
    with pytest.raises(CorruptChunk, match="features/c/7/0"):
        list(bad.dataset(batch_size=16, seed=1))
    assert _held_slots() == 0


def test_fork_workers_read_through_their_own_arenas(versions, monkeypatch):
    """The parent read first (its arenas exist when the DataLoader forks): the workers' batches
    are those of the per-shard gather."""
    v = versions["raw"]
    batches(v.dataset(batch_size=16))
    got = batches(v.dataset(batch_size=16, seed=2), workers=2)
    monkeypatch.setenv("FEATSTORE_ARENA", "0")
    assert same(got, batches(v.dataset(batch_size=16, seed=2), workers=2))


@pytest.mark.parametrize("torch_threads,pool", [(os.cpu_count() or 1, False), (1, (os.cpu_count() or 1) > 1)])
def test_local_reads_run_in_the_reading_thread_when_no_core_is_spare(versions, torch_threads, pool):
    """With torch's threads on every core, pool threads would only take turns with Model B:
    local reads run in the consuming thread; with a core to spare, on the pool."""
    import threading

    old = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        seen = set()
        for _ in versions["zstd"].dataset(batch_size=16):
            seen |= {t.name for t in threading.enumerate() if t.name.startswith("featstore-read")}
    finally:
        torch.set_num_threads(old)
    assert bool(seen) == pool


def test_windows_read_shard_by_shard_when_the_arena_has_no_free_slot(versions, monkeypatch, windows):
    """An arena of 2 slots cannot hold the three one-shard windows in flight: some windows are
    gathered shard by shard, the others from the arena, and the batches are the same."""
    from featstore.read.shards import _arena as arena
    from featstore.read.shards import _objects

    v = versions["raw"]
    want = batches(v.dataset(batch_size=16, seed=4, shuffle_window=SPP))
    _fresh_arenas(monkeypatch)
    monkeypatch.setattr(arena, "MIN_SLOTS", 2)
    monkeypatch.setattr(_objects, "MAPPED_BYTES", 1)
    windows.clear()
    got = batches(v.dataset(batch_size=16, seed=4, shuffle_window=SPP))
    assert same(got, want)
    assert all(a.n_slots == 2 for a in _arenas()) and _held_slots() == 0
    assert windows["arena"] > 0 and windows["in place"] > 0, windows  # both ways, in one epoch


def test_a_failed_mapping_falls_back_to_the_per_shard_gather(versions, monkeypatch):
    """mmap failing (ENOMEM: the process's memory maps used up, which a real part cannot be
    made to do here without exhausting the machine) reads shard by shard, same batches."""
    import errno

    from featstore.read.shards import _arena as arena
    v = versions["raw"]
    want = batches(v.dataset(batch_size=16, seed=6))
    _fresh_arenas(monkeypatch)
    real = arena._map

    def no_more_maps(addr, size, prot, flags, fd=-1):
        if fd != -1:
            raise OSError(errno.ENOMEM, "mmap failed: Cannot allocate memory")
        return real(addr, size, prot, flags, fd)

    monkeypatch.setattr(arena, "_map", no_more_maps)
    assert same(batches(v.dataset(batch_size=16, seed=6)), want)
    assert _held_slots() == 0 and all(a.mapped_bytes() == 0 for a in _arenas())
