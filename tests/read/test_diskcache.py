"""The disk tier for remote stores (cache="disk", featstore/read/shards/_cache.py and _objects.py).

Real parts only: the moto S3 server with the loopback proxy in front of it counting every GET
(tests/faultproxy.py), real DataLoader worker processes, real rank processes sharing one cache
folder, real children SIGKILLed mid-fetch and mid-write, cache files damaged on disk.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import featstore
from featstore import InvalidInput
from featstore import list_disk_cache
from featstore.cli import main as cli_main
from featstore.read.shards._cache import DiskCacheOptions
from featstore.read.shards._objects import entry_name, scope_identity
from featstore.versions import StoredVersion, stored

from featstore.testing import FaultProxy, Rule, wait_until
from tests.helpers import served, write_version

N, SPP = 333, 32  # 11 shards x 3 arrays: zstd float16 features, raw float32 logits, zstd int64 target
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def remote(shared_versions, moto_endpoint):
    """One version on S3 (moto), read through a counting proxy: (url, proxy, version, object keys)."""
    v = shared_versions["s3"]
    url = stored(v).storage.url
    keys = [stored(v).object_key(f, s) for f in served(v) for s in range(v.manifest.layout.n_shards)]
    proxy = FaultProxy(moto_endpoint).start()
    yield url, proxy, v, keys
    proxy.stop()


def store(remote, endpoint: str | None = None) -> featstore.FeatureStore:
    url, proxy, _, _ = remote
    return featstore.open_store(url, {"endpoint_url": endpoint or proxy.url})


def gets(proxy: FaultProxy, keys: list[str]) -> dict[str, int]:
    """GETs of each data object the proxy saw (whole or ranged, from any client)."""
    out = dict.fromkeys(keys, 0)
    for (op, path, _), n in list(proxy.clients.items()):
        parts = path.split("/", 2)  # "/bucket/feats/<key>"
        key = parts[2][len("feats/"):] if len(parts) == 3 else ""
        if op == "GET" and key in out:
            out[key] += n
    return out


def sizes(remote) -> dict[str, int]:
    url, _, v, keys = remote
    s = stored(v).storage
    return {k: s.fs.size(s.path(k)) for k in keys}


def batches(ds) -> list[dict[str, torch.Tensor]]:
    """Epoch 0's batches (iterating again without set_epoch would read the next epoch)."""
    ds.set_epoch(0)
    return list(ds)


def same(a, b) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b, strict=True))


def entry_files(cache_dir: Path) -> list[Path]:
    return sorted(p for p in (cache_dir / "featstore-disk").glob("*/*")
                  if p.parent.name != "locks" and p.name not in ("users.lock", "scope.json"))


@pytest.mark.parametrize("kind", ["disk", "memory+disk"])
def test_batches_equal_the_uncached_ones_and_later_epochs_send_no_get(remote, tmp_path, kind):
    """With "memory+disk" the memory tier holds a few decoded shards only (2 KiB): the others
    are decoded from the disk tier every epoch, and still no GET is sent after the first."""
    _, proxy, v, keys = remote
    budget = {"cache_bytes": 2**26} if kind == "disk" else {"cache_bytes": 2048, "disk_bytes": 2**26}
    ds = store(remote).dataset(v.ref, batch_size=16, seed=1, cache=kind, cache_dir=str(tmp_path), **budget)
    plain = store(remote).dataset(v.ref, batch_size=16, seed=1)
    for epoch in range(3):
        ds.set_epoch(epoch)
        plain.set_epoch(epoch)
        proxy.reset_counts()
        got = batches(ds)
        counts = gets(proxy, keys)
        assert same(got, batches(plain))
        # epoch 0 fetches every object exactly once (whole, even the pieces that need a few chunks)
        assert set(counts.values()) == ({1} if epoch == 0 else {0}), (epoch, counts)
        if kind == "memory+disk":
            assert ds.process_reads().memory.used_bytes() <= 2048
    [scope] = list_disk_cache(str(tmp_path))
    assert (scope.version, scope.entries, scope.in_use) == (v.ref, len(keys), True)


def test_workers_and_ranks_on_the_node_download_each_object_once(remote, tmp_path):
    """2 rank processes x 2 DataLoader workers each, started together on one cache folder: every
    object is fetched once in epoch 0 (consumers sharing a shard wait for its one fetch), none in
    epoch 1."""
    url, proxy, v, keys = remote
    sync = tmp_path / "sync"
    sync.mkdir()
    proxy.reset_counts()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.diskcache_child", "rank", url, proxy.url, v.ref,
                               str(tmp_path / "cache"), str(r), "2", str(sync)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        assert wait_until(lambda: all((sync / f"done-{r}-0").exists() for r in range(2))
                          or any(p.poll() is not None for p in procs), timeout=240)
        first = gets(proxy, keys)
        proxy.reset_counts()
        (sync / "go-1").touch()
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
    assert set(first.values()) == {1}, first
    assert set(gets(proxy, keys).values()) == {0}
    per_rank = [list(map(int, o[0].split()[1:])) for o in outs]
    assert [sum(r[e] for r in per_rank) for e in (0, 1)] == [4 * -(-N // 4)] * 2  # "pad": ceil(N/4) per consumer


def test_half_the_version_as_budget_fetches_half_per_epoch_and_keeps_one_set(remote, tmp_path):
    """Policy "keep": with a budget of half the version, epochs after the first fetch at most 0.55
    of the version's bytes, the cached set stays the same, and the folder never exceeds the budget."""
    _, proxy, v, keys = remote
    size = sizes(remote)
    total = sum(size.values())
    budget = total // 2
    ds = store(remote).dataset(v.ref, batch_size=16, seed=2, cache="disk", cache_dir=str(tmp_path),
                               cache_bytes=budget)
    cache = ds.process_reads().disk
    fetched, held = [], []
    for epoch in range(3):
        ds.set_epoch(epoch)
        proxy.reset_counts()
        batches(ds)
        fetched.append(sum(size[k] * n for k, n in gets(proxy, keys).items()) / total)
        held.append([p.name for p in entry_files(tmp_path)])
        assert cache.used_bytes() <= budget
    print(f"bytes fetched per epoch / version, budget 0.5 (keep): {[round(f, 3) for f in fetched]}")
    assert fetched[0] == 1.0 and max(fetched[1:]) <= 0.55, fetched
    assert held[0] == held[1] == held[2] and held[0]


def test_damaged_or_torn_entries_are_fetched_again_never_served(remote, tmp_path):
    """A flipped byte (caught by the entry's crc32c), a truncated file (by its length) and a
    flipped byte with the trailer's crc32c rewritten to match (by the chunk's crc32c in the
    decoder): each read gives the stored values and re-fetches exactly that object."""
    import crc32c

    _, proxy, v, keys = remote
    ds = store(remote).dataset(v.ref, batch_size=16, seed=3, cache="disk", cache_dir=str(tmp_path),
                               cache_bytes=2**26)
    ref = batches(store(remote).dataset(v.ref, batch_size=16, seed=3))
    assert same(batches(ds), ref)
    folder = Path(ds.process_reads().disk.folder)
    flipped, torn, forged = (stored(v).object_key(f, s) for f, s in (("logits", 1), ("target", 2), ("features", 3)))
    with open(folder / entry_name(flipped), "r+b") as f:
        f.seek(5)
        b = f.read(1)
        f.seek(5)
        f.write(bytes([b[0] ^ 0x10]))
    data = (folder / entry_name(torn)).read_bytes()
    (folder / entry_name(torn)).write_bytes(data[:-10])
    data = bytearray((folder / entry_name(forged)).read_bytes())
    body = len(data) - 24
    data[2] ^= 0x01  # inside the first chunk (the shard index is at the end)
    data[body + 16:body + 20] = crc32c.crc32c(bytes(data[:body])).to_bytes(4, "little")
    (folder / entry_name(forged)).write_bytes(bytes(data))
    for epoch in (0, 1):
        proxy.reset_counts()
        assert same(batches(ds), ref)
        counts = gets(proxy, keys)
        refetched = {k for k, n in counts.items() if n}
        assert refetched == ({flipped, torn, forged} if epoch == 0 else set()), counts
        assert max(counts.values()) <= 1


def test_a_reader_killed_mid_fetch_leaves_the_cache_usable_and_counted(remote, tmp_path, moto_endpoint):
    """A reader SIGKILLed while it holds the fetch lock of an object (its GET stalls at the
    proxy): the next reader does not wait for it, reads the stored values, fetches only what the
    dead one did not keep, and the folder's count is its files' sizes, with no temporary left."""
    url, _, v, keys = remote
    stall = FaultProxy(moto_endpoint, stall=60).start()
    victim = stored(v).object_key("features", 4)
    stall.set_rules(Rule("timeout", ops=("GET",), path=re.escape(victim) + r"\?", times=None))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-m", "tests.diskcache_child", "fetch", url, stall.url, v.ref,
                              str(tmp_path)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert wait_until(lambda: gets(stall, [victim])[victim] or child.poll() is not None, timeout=120)
        assert child.poll() is None, child.communicate()[1][-2000:]
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        stall.set_rules()
        before = {p.name for p in entry_files(tmp_path)}
        assert entry_name(victim) not in before
        stall.reset_counts()
        ds = featstore.open_store(url, {"endpoint_url": stall.url}).dataset(
            v.ref, batch_size=16, seed=5, cache="disk", cache_dir=str(tmp_path), cache_bytes=2**26)
        assert same(batches(ds), batches(store(remote).dataset(v.ref, batch_size=16, seed=5)))
        counts = gets(stall, keys)
    finally:
        child.kill()
        stall.stop()
    assert {k for k, n in counts.items() if n} == {k for k in keys if entry_name(k) not in before}
    assert max(counts.values()) == 1
    files = entry_files(tmp_path)
    assert not [p for p in files if p.name.startswith(".tmp-")]
    assert ds.process_reads().disk.used_bytes() == sum(p.stat().st_size for p in files)


def test_a_writer_killed_mid_write_gives_its_reservation_back(tmp_path):
    """A process SIGKILLed halfway through writing an entry: its temporary file is removed by the
    next listing and its reserved bytes count no more, so an entry that needs the whole budget
    but for those bytes still fits."""
    budget, n = 10_000, 6_000
    opts = DiskCacheOptions(str(tmp_path), budget)
    ready_r, ready_w = os.pipe()
    pid = os.fork()  # a real process (no imports to wait for): reserve, write half, wait to be killed
    if pid == 0:
        try:
            cache = opts.open("a killed writer", {})
            fd = cache._reserve(os.path.join(cache.folder, ".tmp-entry.killed"), n)
            os.pwrite(fd, b"x" * (n // 2), 0)
            os.write(ready_w, b"1")
            time.sleep(600)
        finally:
            os._exit(1)
    try:
        assert os.read(ready_r, 1) == b"1"
        cache = opts.open("another reader", {})
        assert cache.used_bytes() == n  # a live writer's reservation counts
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert insert(cache, "big", b"y" * (budget - 100))  # the ledger still says 6,000 held: recounted
    assert cache.used_bytes() == budget - 100 + 24
    assert not list((tmp_path / "featstore-disk").glob("*/.tmp-*"))
    cache.close()


def used_in_order(tmp_path: Path, names: list[str]) -> None:
    """Set the entries' last uses (access times) in this order: timestamps are coarse."""
    for i, name in enumerate(names):
        [path] = [p for p in entry_files(tmp_path) if p.name == name]
        os.utime(path, ns=(10**18 + i, path.stat().st_mtime_ns))


def insert(cache, name: str, data: bytes) -> bool:
    """Keep ``data`` as entry ``name``; whether it fit."""
    return cache.put(name, len(data), lambda buf: buf.__setitem__(slice(None), data)) is not None


def test_keep_evicts_only_versions_no_process_reads_and_lru_evicts_anything(tmp_path):
    opts = DiskCacheOptions(str(tmp_path), 1000)
    gone = opts.open("version nobody reads any more", {})
    for i in range(3):
        assert insert(gone, f"g{i}", b"g" * 176)  # 200 bytes with the trailer
    used_in_order(tmp_path, ["g0", "g1", "g2"])
    gone.close()  # as when its last reader exits
    live = opts.open("version another process reads", {})
    mine = opts.open("version this reader reads", {})
    assert insert(live, "l0", b"l" * 176) and insert(mine, "m0", b"m" * 176)
    assert insert(mine, "m1", b"m" * 176) and insert(mine, "m2", b"m" * 176)  # evicts g0 then g1
    names = {p.name for p in entry_files(tmp_path)}
    assert names == {"g2", "l0", "m0", "m1", "m2"}
    assert insert(mine, "m3", b"m" * 176)  # the last stale entry goes, and its scope folder
    assert not os.path.exists(gone.folder)
    mine._full = (0.0, 0)
    assert not insert(mine, "m4", b"m" * 176)  # full: a version in use keeps what it has
    assert {p.name for p in entry_files(tmp_path)} == {"l0", "m0", "m1", "m2", "m3"}
    lru = replace(opts, policy="lru").open("version this reader reads", {})
    lru._full = (0.0, 0)
    used_in_order(tmp_path, ["l0", "m0", "m1", "m2", "m3"])
    assert insert(lru, "m4", b"m" * 176)  # "lru": the least recently used entry of any version
    assert "l0" not in {p.name for p in entry_files(tmp_path)}
    for c in (live, mine):
        c.close()


def test_two_stores_two_versions_and_two_commits_never_share_a_scope(remote, tmp_path, moto_endpoint):
    _, proxy, v, _ = remote
    here, there = stored(store(remote).open(v.ref)), stored(store(remote, moto_endpoint).open(v.ref))
    other = StoredVersion(stored(v).storage, replace(v.manifest, id="0123456789abcdef"))
    recommitted = StoredVersion(stored(v).storage, replace(v.manifest, created_at="2000-01-01T00:00:00Z"))
    ids = {scope_identity(x) for x in (here, there, other, recommitted)}
    assert len(ids) == 4
    for s in (store(remote), store(remote, moto_endpoint)):
        batches(s.dataset(v.ref, batch_size=64, cache="disk", cache_dir=str(tmp_path), cache_bytes=2**26))
    scopes = list_disk_cache(str(tmp_path))
    assert len(scopes) == 2 and all(s.entries == 33 for s in scopes)


def test_cache_command_and_api_list_and_clear(remote, tmp_path, capsys):
    _, _, v, keys = remote
    ds = store(remote).dataset(v.ref, batch_size=64, cache="disk", cache_dir=str(tmp_path), cache_bytes=2**26)
    batches(ds)
    assert cli_main(["cache", "list", "--dir", str(tmp_path), "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert (row["version"], row["entries"], row["in_use"]) == (v.ref, len(keys), True)
    assert cli_main(["cache", "clear", "--dir", str(tmp_path), "--unused"]) == 0  # in use: kept
    assert "removed 0 bytes" in capsys.readouterr().out
    assert cli_main(["cache", "clear", "--dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cleared_bytes"] == row["bytes"]
    assert featstore.list_disk_cache(str(tmp_path))[0].entries == 0
    assert same(batches(ds), batches(store(remote).dataset(v.ref, batch_size=64)))  # fetched again
    assert featstore.clear_disk_cache(str(tmp_path)) == row["bytes"]


def test_bad_disk_options_are_refused_and_a_local_store_has_no_disk_tier(remote, tmp_path, local_store):
    v = remote[2]
    for bad, match in [({"cache": "ssd"}, "cache must be"), ({"cache_dir": "x"}, "cache_dir"),
                       ({"cache": "disk", "disk_bytes": 5}, "disk_bytes"),
                       ({"cache": "disk", "disk_policy": "fifo"}, "disk_policy"),
                       ({"cache": "memory+disk", "disk_bytes": 0}, "disk_bytes")]:
        with pytest.raises(InvalidInput, match=match):
            v.dataset(**bad)
    lv = write_version(local_store, "d/local", n=40, outputs={"features": "float16"})
    ds = lv.dataset(cache="disk", cache_dir=str(tmp_path / "c"))
    assert ds.process_reads().disk is None and len(batches(ds)) == 1 and not (tmp_path / "c").exists()


def test_a_child_forked_while_a_lock_is_held_does_not_keep_it(tmp_path):
    """A DataLoader worker forked while a reader thread holds a fetch or eviction lock: the
    child's copy of the descriptor is closed at the fork, so the lock ends with the parent's."""
    import fcntl

    from featstore.read.shards._cache import flocked

    lock = str(tmp_path / "lock")
    ready_r, ready_w = os.pipe()
    with flocked(lock, fcntl.LOCK_EX):
        pid = os.fork()
        if pid == 0:  # the fork's handlers have run by now
            os.write(ready_w, b"1")
            time.sleep(60)
            os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"1"
        fd = os.open(lock, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if the child kept it
        os.close(fd)
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)  # the child is still alive
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
