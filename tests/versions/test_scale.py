"""Scale properties without payload: opening a version and planning a reader read the same
few small objects at 500 and at 125,000 shards; finished shards are found by listing; receipts
are compacted into runs; records round-trip."""

from __future__ import annotations

import tracemalloc

import numpy as np

import pytest

import featstore
from benchmarks.synthetic import synthetic_version
from featstore.format._manifests import Layout, ShardReceipt
from featstore.storage import Storage, backend_for
from featstore.store import FeatureStore
from featstore.format._manifests import RECORDS_PER_OBJECT
from featstore.versions._keys import version_key
from featstore.versions._receipts import compact_receipts, finished_shards, read_receipts, write_receipt
from featstore.compute._driver import choose_layout
from featstore.compute._options import LOCAL_SHARD_BYTES, OBJECT_STORE_SHARD_BYTES, default_shard_bytes
from featstore.versions import stored

from tests.models import TinyA, VectorData


class Counting:
    """The real storage, counting the requests featstore makes through it (mixed into the
    backend of the store's URL: see :func:`CountingStorage`)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.reads: list[tuple[str, int]] = []
        self.lists: list[str] = []

    def read_bytes(self, key, *, metadata=False):
        data = super().read_bytes(key, metadata=metadata)
        self.reads.append((key, len(data or b"")))
        return data

    def read_buffer(self, key):
        before = len(self.reads)
        data = super().read_buffer(key)
        if len(self.reads) == before:  # the backend's own copy-free GET, not through read_bytes
            self.reads.append((key, len(data or b"")))
        return data

    def list_dirs(self, key):
        self.lists.append(key)
        return super().list_dirs(key)


def CountingStorage(url: str, options) -> Storage:  # noqa: N802 - reads like the class it makes
    """The backend :class:`Storage` picks for ``url``, counting its reads and listings."""
    backend = backend_for(url)
    return type(f"Counting{backend.__name__}", (Counting, backend), {})(url, options)


def counted(storage: Storage) -> FeatureStore:
    return FeatureStore(CountingStorage(storage.url, storage._options))


def open_and_plan(store: FeatureStore, ref: str) -> tuple[int, int, int]:
    """Open ``ref`` and plan 8 consumers of a 1,024-rank x 8-worker job: (objects, bytes, lists)."""
    st = store.storage
    v = store.open(ref)
    ds = v.dataset(batch_size=256, shuffle=True, seed=0, rank=1023, world_size=1024)
    plans = [ds.plan(w, 8) for w in range(8)]
    assert all(p.n_samples > 0 for p in plans)
    return len(st.reads), sum(n for _, n in st.reads), len(st.lists)


def test_open_and_plan_read_the_same_small_objects_at_500_and_125000_shards(tmp_path):
    base = featstore.open_store(tmp_path / "store")
    small = synthetic_version(base, "scale/small", 500, with_records=False)
    big = synthetic_version(base, "scale/big", 125_000, with_records=False)
    got = {}
    for m in (small, big):
        store = counted(base.storage)
        tracemalloc.start()
        store.open(f"{m.name}@{m.id}")
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        got[m.layout.n_shards] = (*open_and_plan(counted(base.storage), f"{m.name}@{m.id}"), peak)
    (n1, b1, l1, p1), (n2, b2, l2, p2) = got[500], got[125_000]
    assert (n1, l1) == (n2, l2) == (1, 0)  # one GET (the manifest), no listing, no records
    # A constant-size manifest: it grows by one records digest (~80 bytes) per 65,536 shards.
    assert b2 < 4096 and abs(b2 - b1) < 100
    assert p2 < 2 * p1 + 64 * 1024  # and opening it takes the same memory
    print(f"\n[scale] open+plan: {n2} object, {b1} vs {b2} manifest bytes, open peak {p1} vs {p2} B")


def test_records_hold_every_shard_and_are_read_only_by_verify(tmp_path, monkeypatch):
    import featstore.versions._receipts

    assert RECORDS_PER_OBJECT == 65536  # 6 MiB objects at 3 arrays; smaller here to test several
    monkeypatch.setattr(featstore.versions._receipts, "RECORDS_PER_OBJECT", 1000)
    base = featstore.open_store(tmp_path / "store")
    m = synthetic_version(base, "scale/rec", 1010, samples_per_shard=4)
    store = counted(base.storage)
    receipts = stored(store.open(f"{m.name}@{m.id}")).shard_receipts()
    assert [r.index for r in receipts] == list(range(m.layout.n_shards))
    assert receipts[-1].start == 4 * (m.layout.n_shards - 1) and set(receipts[7].stats) == set(m.arrays)
    assert len(store.storage.reads) == 1 + 2  # the manifest, then two records objects (concurrently)
    key = version_key(m.name, m.id)
    victim = next(k for k in base.storage.find(f"{key}/_records"))
    base.storage.write_bytes(victim, b"\0" * 96)
    problems = base.open(f"{m.name}@{m.id}").verify()
    assert len(problems) == 1 and "fails its sha256" in problems[0]


def test_finished_shards_are_found_by_listing_and_runs_read_concurrently(store):
    vkey = version_key("scale/resume", "0" * 16)
    layout = Layout(40 * 8, 8, 8)
    receipts = [ShardReceipt(i, *layout.shard_range(i), {"x": f"{i:064x}"}) for i in range(40)]
    for r in receipts:
        write_receipt(store.storage, vkey, r)
    compact_receipts(store.storage, vkey, receipts[:32] + receipts[33:36])  # two runs; 32 stays alone
    names = store.storage.list_dirs(f"{vkey}/_receipts")
    assert "run-000000-000031.json" in names and "run-000033-000035.json" in names and len(names) == 2 + 5
    counting = CountingStorage(store.storage.url, store.storage._options)
    assert finished_shards(counting, vkey) == set(range(40))
    assert counting.reads == [] and len(counting.lists) == 1  # resume: names only, no GET
    got = read_receipts(counting, vkey, [3, 32, 39])
    assert got == {i: receipts[i] for i in (3, 32, 39)}
    assert sorted(k.rsplit("/", 1)[1] for k, _ in counting.reads) == ["000032.json", "000039.json",
                                                                        "run-000000-000031.json"]
    assert read_receipts(store.storage, vkey) == {r.index: r for r in receipts}


def test_a_task_compacts_its_receipts_and_a_resume_reads_the_runs(local_store, monkeypatch):
    import featstore.versions._receipts

    monkeypatch.setattr(featstore.versions._receipts, "RUN_EVERY", 4)  # the driver folds receipts as tasks finish
    kw = dict(model=TinyA(), dataset=VectorData(80),
              keep=["target"], outputs={"features": "float32", "logits": "float32"}, batch_size=8, samples_per_shard=8,
              options=featstore.ComputeOptions(progress=False, processes=False, n_workers=1, shards_per_task=2))
    v = local_store.compute("scale/runs", **kw)
    names = local_store.storage.list_dirs(f"{stored(v).key}/_receipts")
    # Each time 4 receipts are pending they are folded, a run per contiguous stretch: which stretches
    # depends on the order tasks finish (a busy machine reorders them), but a task's 2 shards are
    # contiguous, so every fold makes a run, and every shard is in exactly one object.
    runs = [n for n in names if n.startswith("run-")]
    assert runs and len(names) < 10, names
    spans = [range(int(a), int(b) + 1) for a, b in (n.removesuffix(".json").split("-")[1:] for n in runs)]
    singles = [int(n.removesuffix(".json")) for n in names if not n.startswith("run-")]
    assert sorted([i for r in spans for i in r] + singles) == list(range(10)), names
    assert finished_shards(local_store.storage, stored(v).key) == set(range(10))
    local_store.storage.delete(f"{stored(v).key}/manifest.json")  # killed right before the commit
    again = local_store.compute("scale/runs", **kw)
    assert again.manifest.timings["shards_computed"] == 0 and again.verify() == []
    assert [r.digests for r in stored(again).shard_receipts()] == [r.digests for r in stored(v).shard_receipts()]


@pytest.mark.parametrize("local", [True, False])
def test_shards_are_bigger_on_object_stores(local):
    target = default_shard_bytes(local)
    assert target == (LOCAL_SHARD_BYTES if local else OBJECT_STORE_SHARD_BYTES)
    layout = choose_layout(10**9, [1024, 4000, 8], None, None, target)
    assert layout.samples_per_shard * 5032 <= target + layout.chunk_rows * 5032
    assert layout.n_shards == -(-10**9 // layout.samples_per_shard)


def test_a_few_rows_of_a_big_shard_are_read_by_range(store, dask_client):
    v = store.compute("scale/ranged", model=TinyA(), dataset=VectorData(256), keep=["target"],
                      outputs={"features": "float32", "logits": "float32"}, batch_size=32,
                      samples_per_shard=128, client=dask_client,
                      options=featstore.ComputeOptions(progress=False, chunk_rows=16))
    counting = CountingStorage(store.storage.url, store.storage._options)
    ranges: list[tuple[int, int | None]] = []
    real = counting.read_range

    def spy(key, start, stop=None):
        ranges.append((start, stop))
        return real(key, start, stop)

    counting.read_range = spy
    ds = v.dataset(batch_size=8, shuffle=False)
    fmt = ds.process_reads().shard_format("features")
    out = np.empty((10, 8), dtype=np.float32)
    stored(v).read_shard_rows(counting, "features", fmt, 1, 20, 30, out)  # chunks 1-1 of 8: by range
    np.testing.assert_array_equal(out, stored(v).read_rows("features", 148, 158))
    assert counting.reads == [] and len(ranges) == 2 and ranges[0][1] is None  # index suffix, then the chunks
    assert ranges[1][1] - ranges[1][0] < 2 * 16 * 8 * 4 + 64  # about two chunks' bytes, not the shard
    stored(v).read_shard_rows(counting, "features", fmt, 1, 0, 128, np.empty((128, 8), dtype=np.float32))
    assert len(counting.reads) == 1  # most of the shard: one whole-object GET
