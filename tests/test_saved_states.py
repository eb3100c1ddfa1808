"""States saved by an older featstore load and resume exactly (tests/data/states-cbb9962, made by
tests/data/make_resume_states.py with featstore as it was at commit cbb9962): one version's
state, a mixture's, a multi-teacher state, torchdata's (featstore's ``StatefulLoader`` and a plain
``StatefulDataLoader``, 2 workers each) and a Lightning checkpoint of ``FeatureDataModule``. Each
resumed epoch reads every row the saved run had not yet yielded, once (``seen`` + the rest = the
uninterrupted epoch the old featstore read, as a multiset), and an uninterrupted epoch still
reads the old featstore's rows in its order.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import featstore

from .test_lightning import _run

DATA = Path(__file__).parent / "data" / "states-cbb9962"
CASES = json.loads((DATA / "states.json").read_text())


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> featstore.FeatureStore:
    """A copy of the fixture's store (reading writes nothing, but a copy keeps the fixture as committed)."""
    root = tmp_path_factory.mktemp("saved-states") / "store"
    shutil.copytree(DATA / "store", root)
    return featstore.open_store(root)


def rows(batches, mixture: bool = False) -> list:
    if mixture:
        return [(int(s), int(i)) for b in batches for s, i in zip(b["source"], b["index"], strict=True)]
    return [i for b in batches for i in b["index"].tolist()]


def assert_rest_once(case: dict, rest: list, mixture: bool = False) -> None:
    seen = [tuple(r) for r in case["seen"]] if mixture else case["seen"]
    epoch = [tuple(r) for r in case["epoch"]] if mixture else case["epoch"]
    assert Counter(seen + rest) == Counter(epoch), "the resumed epoch is not the rest of the saved one"
    assert not mixture or len(rest) == len(epoch) - len(seen)


def read(ds, workers: int) -> list:
    return list(DataLoader(ds, batch_size=None, num_workers=workers))


def test_an_uninterrupted_epoch_reads_the_old_featstores_order(store):
    single = CASES["single"]
    assert rows(read(store.dataset(single["ref"], **single["build"]), 2)) == single["epoch"]
    mixture = CASES["mixture"]
    versions = {k: store.open(ref) for k, ref in CASES["versions"].items()}
    mixed = featstore.mix([(versions[k], w) for k, w in mixture["streams"]], epoch_size=mixture["epoch_size"],
                          **mixture["build"])
    assert rows(read(mixed, 0), True) == [tuple(r) for r in mixture["epoch"]]


@pytest.mark.parametrize("workers", [2, 1, 0])
def test_one_versions_state_resumes_exactly(store, workers):
    """Saved with 2 DataLoader workers; resumed with 2 (the same split), 1 or 0 (others)."""
    case = CASES["single"]
    ds = store.dataset(case["ref"], **case["build"])
    ds.load_state_dict(case["state"])
    batches = read(ds, workers)
    assert_rest_once(case, rows(batches))
    assert sorted(rows(read(ds, workers))) == list(range(240))  # then a whole next epoch


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mixtures_state_resumes_exactly(store, workers):
    case = CASES["mixture"]
    versions = {k: store.open(ref) for k, ref in CASES["versions"].items()}
    ds = featstore.mix([(versions[k], w) for k, w in case["streams"]], epoch_size=case["epoch_size"],
                       **case["build"])
    ds.load_state_dict(case["state"])
    assert_rest_once(case, rows(read(ds, workers), True), mixture=True)


def test_a_multi_teacher_state_resumes_exactly(store):
    case = CASES["multi"]
    ds = store.dataset(case["teachers"], **case["build"])
    ds.load_state_dict(case["state"])
    batches = read(ds, 0)
    assert_rest_once(case, rows(batches))
    assert all("a/features" in b and "t/logits.ids" in b for b in batches)


@pytest.mark.parametrize("name,workers", [("featstore", 2), ("featstore", 1), ("plain", 2)])
def test_torchdata_states_resume_exactly(store, name, workers):
    """featstore's StatefulLoader state resumes under 2 workers and under 1; a plain
    StatefulDataLoader's per-worker states under the same 2 workers (torchdata asserts the count)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    case = CASES[f"torchdata-{name}"]
    loader_class = featstore.StatefulLoader if name == "featstore" else StatefulDataLoader
    loader = loader_class(store.dataset(case["ref"], **case["build"]), batch_size=None, num_workers=workers)
    loader.load_state_dict(torch.load(DATA / f"torchdata-{name}.pt", weights_only=True))
    assert_rest_once(case, rows(loader))


@pytest.mark.timeout(600)
def test_a_lightning_checkpoint_resumes_exactly(store, tmp_path):
    case = CASES["lightning"]
    ckpt = tmp_path / "mid.ckpt"
    shutil.copy(DATA / "lightning" / "mid.ckpt", ckpt)
    _run(["-m", "tests.lightning_child", "resume-fixture", store.url, case["ref"], str(tmp_path), str(ckpt)])
    got = json.loads((tmp_path / "resumed" / "rank0.json").read_text())
    assert Counter(case["seen"] + got["0/train"]) == Counter(range(240))
    assert sorted(got["1/train"]) == list(range(240))
