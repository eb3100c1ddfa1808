"""The clients users train with, for real: torchdata's StatefulDataLoader (exactly-once resume per
worker), epochs without ``set_epoch``, ranks found where they are, Hugging Face ``datasets``.
Lightning and torchrun run in tests/test_lightning.py."""

from __future__ import annotations

import multiprocessing
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import featstore
from featstore import DistributedSetupError, InvalidInput

from tests.helpers import QUIET16, SharedVersions, TinyA, VectorData

N, BS = SharedVersions.KINDS["local-400"][0], 20


@pytest.fixture(scope="module")
def version(shared_versions):
    return shared_versions["local-400"]


def _indices(batches) -> list[list[int]]:
    return [b["index"].tolist() for b in batches]


def figures(rows: list[int], n: int = N) -> dict[str, int]:
    """rows, duplicates and missing samples of one epoch's indices."""
    count = Counter(rows)
    return {"rows": len(rows), "duplicates": sum(c - 1 for c in count.values()), "missing": n - len(count)}


# -- torchdata's StatefulDataLoader ---------------------------------------------------------------
# 0, 2 and 4 workers; persistent or not; fork and spawn (spawned workers are slow to start: one case)
MATRIX = [(0, None, False), (2, "fork", False), (2, "fork", True), (2, "spawn", True), (4, "fork", True),
          (4, "fork", False)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers,context,persistent", MATRIX)
def test_stateful_dataloader_resumes_every_sample_exactly_once(version, workers, context, persistent):
    """State taken mid-epoch 0; the resumed loader (a new dataset, as after a crash) finishes
    epoch 0 with exactly the batches the original had left, then reads epoch 1 like it."""
    if context is not None and context not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {context!r} start method here")
    kw = dict(batch_size=None, num_workers=workers, persistent_workers=persistent,
              multiprocessing_context=context, timeout=120 if workers else 0)
    k = 7
    loader = StatefulDataLoader(version.dataset(batch_size=BS, seed=2), **kw)
    epoch0, state = [], None
    for i, b in enumerate(loader):
        epoch0.append(b["index"].tolist())
        if i + 1 == k:
            state = loader.state_dict()
    epoch1 = _indices(loader)
    resumed = StatefulDataLoader(version.dataset(batch_size=BS, seed=2), **kw)
    resumed.load_state_dict(state)
    rest, after = _indices(resumed), _indices(resumed)
    assert rest == epoch0[k:]  # the rest of the epoch, in the original order
    assert figures(sum(epoch0[:k] + rest, [])) == {"rows": N, "duplicates": 0, "missing": 0}
    assert after == epoch1 and after != epoch0  # across the boundary: the next epoch, not epoch 0 again
    print(f"\nStatefulDataLoader workers={workers} {context} persistent={persistent}: "
          f"{figures(sum(epoch0[:k] + rest, []))}")


def test_stateful_dataloader_refuses_another_number_of_workers(version):
    loader = StatefulDataLoader(version.dataset(batch_size=BS, seed=2), batch_size=None, num_workers=2)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    del it
    other = StatefulDataLoader(version.dataset(batch_size=BS, seed=2), batch_size=None, num_workers=4)
    other.load_state_dict(state)
    with pytest.raises(InvalidInput, match="saved with 2 DataLoader workers"):
        next(iter(other))
    single = StatefulDataLoader(version.dataset(batch_size=BS, seed=2), batch_size=None, num_workers=0)
    single.load_state_dict(state)  # torchdata itself refuses a multi-worker state without workers
    with pytest.raises(AssertionError, match="_num_yielded"):
        next(iter(single))


# -- epochs without set_epoch -------------------------------------------------------------------
@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_iterating_again_reads_the_next_epoch_and_set_epoch_wins(version, workers, persistent):
    ds = version.dataset(batch_size=BS, seed=4)
    loader = DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=persistent,
                        timeout=120 if workers else 0)
    counted = [_indices(loader) for _ in range(3)]
    fresh = version.dataset(batch_size=BS, seed=4)
    explicit = []
    for e in range(3):
        fresh.set_epoch(e)
        explicit.append(_indices(DataLoader(fresh, batch_size=None, num_workers=workers,
                                            timeout=120 if workers else 0)))
    assert counted == explicit  # epoch e is epoch e, counted or set
    assert counted[0] != counted[1] != counted[2] and all(figures(sum(c, []))["missing"] == 0 for c in counted)
    ds.set_epoch(1)  # explicit wins: epoch 1 again, then the count goes on from it
    assert [_indices(loader), _indices(loader)] == explicit[1:3]
    assert ds.epoch == 2 and ds.state_dict(batches_seen=0)["epoch"] == 2


def test_a_late_worker_joins_its_iterations_epoch(version):
    """Each worker finds its DataLoader iteration by key, whatever order the workers start in."""
    from featstore.read.state._worker_share import SLOTS, SharedProgress, iteration_key

    p = SharedProgress()
    keys = [iteration_key(1234, i) for i in range(3)]
    assert [p.begin(2, keys[0], True).epoch, p.begin(1, keys[0], True).epoch] == [0, 0]
    assert [p.begin(1, keys[1], False).epoch, p.begin(2, keys[1], False).epoch] == [1, 1]
    p.set_epoch(7)
    assert [p.begin(2, keys[2], False).epoch, p.begin(1, keys[2], False).epoch] == [7, 7]
    p._set(SLOTS + 2 * 1 + 1, 1)  # slot 1's last iteration was another process's (a former worker)
    with pytest.raises(InvalidInput, match="same base seed"):  # a fresh worker seeing its own key again
        p.begin(1, keys[2], True)


def test_two_workers_starting_at_once_take_one_epoch(monkeypatch):
    """The workers of one iteration start at the same moment: worker 2 looks for the iteration's
    record just before worker 1 writes it, and then takes the epoch after worker 1's. Both must
    read one epoch (they read different epochs otherwise: one shard twice, another never), and
    the next iteration the epoch after it. The interleaving is forced (a real one is a
    microsecond race: 2 in 300 epochs of test_bit_flips_through_dataloader_workers_local)."""
    from featstore.read.state._worker_share import SharedProgress, _pack, iteration_key

    p = SharedProgress()
    keys = [iteration_key(99, i) for i in range(2)]
    real = p._find
    calls = []

    def find(key, gen):
        calls.append(key)
        if len(calls) == 1:  # worker 2's lookup misses; worker 1 records just after it
            p._record(_pack(key, True, gen, 0))
            return None
        return real(key, gen)

    monkeypatch.setattr(p, "_find", find)
    assert p.begin(2, keys[0], True).epoch == 0  # took 1 after worker 1's record, then adopted 0
    assert p.begin(1, keys[0], True).epoch == 0
    assert [p.begin(1, keys[1], False).epoch, p.begin(2, keys[1], False).epoch] == [1, 1]


@pytest.mark.parametrize("persistent", [False, True])
def test_eight_workers_of_two_loaders_starting_at_once_each_read_an_epoch_of_their_own(version, persistent,
                                                                                      monkeypatch):
    """Two DataLoaders over one dataset, 4 workers each, started together over and over without
    set_epoch: the 8 workers begin their iterations at the same moment, and each loader's first
    worker records its iteration in the shared ring. Every iteration must read one whole epoch,
    and no two the same. Each write of the ring is slowed down (a test build's fault: the counter's
    read-modify-write is a microsecond race on a real machine), so a counter that is not updated
    atomically loses one loader's record and its workers read the other loader's epoch."""
    import time

    from featstore.read.state import _worker_share as share

    real = share.SharedProgress._set

    def slow(self, i: int, value: int) -> None:
        if share.HEADER <= i < share.HEADER + share.RING:  # between the counter's read and its write
            time.sleep(0.2)
        real(self, i, value)

    monkeypatch.setattr(share.SharedProgress, "_set", slow)
    ds = version.dataset(batch_size=BS, seed=6)
    loaders = [DataLoader(ds, batch_size=None, num_workers=4, persistent_workers=persistent,
                          multiprocessing_context="fork", timeout=120) for _ in range(2)]
    epochs = []
    for _ in range(3):
        for it in [iter(loader) for loader in loaders]:  # both loaders' workers start now
            rows = _indices(it)
            assert figures(sum(rows, [])) == {"rows": N, "duplicates": 0, "missing": 0}
            epochs.append(frozenset(map(tuple, rows)))
    assert len(set(epochs)) == len(epochs)  # six iterations, six epochs


# -- ranks ----------------------------------------------------------------------------------------
def test_unresolvable_rank_is_an_error_not_a_guess(version, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    ds = version.dataset(batch_size=BS)  # built before the process group exists: fine
    with pytest.raises(DistributedSetupError, match="RANK"):
        next(iter(ds))
    monkeypatch.setenv("RANK", "1")
    assert (ds.rank, ds.world_size) == (1, 2)  # found when asked, from the environment
    assert figures(torch.cat([b["index"] for b in ds]).tolist(), N // 2)["missing"] == 0


def test_a_world_change_under_persistent_workers_is_refused(version, monkeypatch):
    ds = version.dataset(batch_size=BS, seed=1)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True, timeout=120)
    assert figures(sum(_indices(loader), [])) == {"rows": N, "duplicates": 0, "missing": 0}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds.set_epoch(1)  # the training process now sees 2 ranks; its workers planned for 1
    with pytest.raises(DistributedSetupError, match="persistent DataLoader workers"):
        next(iter(loader))


# -- Hugging Face datasets ----------------------------------------------------------------------
def test_hugging_face_dataset_as_compute_dataset_and_source(tmp_path, dask_client):
    datasets = pytest.importorskip("datasets")
    data = VectorData(96)
    hf = datasets.Dataset.from_dict({"input": data.x.numpy(), "target": data.y.numpy()}).with_format("torch")
    store = featstore.open_store(tmp_path / "store")
    v = store.compute("hf/train", model=TinyA(), dataset=hf, keep=["target"], outputs={"logits": "float32"},
                      samples_per_shard=32, client=dask_client, options=QUIET16)
    again = store.compute("hf/train", model=TinyA(), dataset=datasets.Dataset.from_dict(
        {"input": data.x.numpy(), "target": data.y.numpy()}).with_format("torch"), keep=["target"],
        outputs={"logits": "float32"}, samples_per_shard=32, client=dask_client, options=QUIET16)
    assert again.id == v.id  # a stable fingerprint: the same table is the same dataset
    assert torch.equal(v.load()["target"], data.y)
    batches = list(v.dataset(batch_size=16, seed=0, source=hf))
    assert figures(torch.cat([b["index"] for b in batches]).tolist(), 96)["missing"] == 0
    for b in batches:  # the joined input is the row of its index
        assert torch.equal(b["input"], data.x[b["index"]])
