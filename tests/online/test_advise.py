"""The advisor: its arithmetic as pure functions over grids of costs and workloads, then one real
measurement (a scratch version filled, read back and deleted) through the function and the CLI."""

from __future__ import annotations

import itertools
import json

import pytest

import featstore
from featstore import Costs, InvalidInput, Teacher, Workload
from featstore.online import MODES, bound, predict, recommend, terms
from featstore.cli import main

from ..models import TinyA, VectorData

COSTS = [Costs(t, w, r, b) for t, w, r, b in itertools.product((1e-4, 3e-3), (5e-5, 2e-3), (1e-5, 1e-3), (0.0, 5e-4))]
WORKLOADS = [Workload(n, e, k, s) for n, e, k, s in itertools.product((1000,), (1, 3, 10), (1, 4), (1, 3))]


def close(a, b):
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


@pytest.mark.parametrize("w", WORKLOADS)
def test_online_and_compute_then_read_follow_their_formulas(w):
    n, e, k, s = w.samples, w.epochs, w.views, w.students
    for c in COSTS:
        p = predict(c, w)
        assert close(p["online"], s * e * n * (c.teacher_s + c.student_s))
        assert close(p["compute-then-read"], k * n * (c.teacher_s + c.write_s) + s * e * n * (c.read_s + c.student_s))


@pytest.mark.parametrize("w", WORKLOADS)
def test_fill_pays_a_once_per_view_and_reads_the_other_epochs(w):
    n, e, k, s = w.samples, w.epochs, w.views, w.students
    filled = min(k, e * s)  # views the students' epochs can fill
    for c in COSTS:
        t, p = terms(c, w), predict(c, w)
        assert close(t["fill"]["teacher"], filled * n * c.teacher_s)
        assert close(t["fill"]["write"], filled * n * c.write_s)
        assert close(t["fill"]["read"], (s * e - filled) * n * c.read_s)
        if e * s >= k:  # the version gets complete: fill saves exactly the K epochs compute-then-read reads
            assert close(p["compute-then-read"] - p["fill"], k * n * c.read_s)
        # against online: the writes of the filled views, and reading instead of running A afterwards
        assert close(p["fill"] - p["online"], filled * n * c.write_s + (s * e - filled) * n * (c.read_s - c.teacher_s))


@pytest.mark.parametrize("w", WORKLOADS)
def test_recommendation_is_the_fastest_and_names_its_bound(w):
    for c in COSTS:
        mode, reason = recommend(c, w)
        p = predict(c, w)
        assert p[mode] == min(p.values())
        assert reason.startswith(f"{mode} is {bound(terms(c, w)[mode])}-bound")


@pytest.mark.parametrize("c", COSTS[:4])
def test_slower_writes_never_make_a_storing_mode_faster(c):
    w = Workload(1000, 5, 2, 2)
    slower = Costs(c.teacher_s, c.write_s * 10, c.read_s, c.student_s)
    a, b = predict(c, w), predict(slower, w)
    assert b["online"] == a["online"]
    assert b["compute-then-read"] > a["compute-then-read"] and b["fill"] > a["fill"]


def test_known_cases():
    # an expensive teacher, 10 epochs: store it; a cheap teacher, slow writes, 1 epoch: online
    assert recommend(Costs(2e-3, 1e-4, 1e-5), Workload(10_000, epochs=10))[0] == "fill"
    assert recommend(Costs(1e-5, 2e-3, 1e-3), Workload(10_000, epochs=1))[0] == "online"
    assert "write" in recommend(Costs(1e-5, 5e-3, 1e-6), Workload(10_000, epochs=1, views=1))[1]
    assert bound({"teacher": 1.0, "write": 0.5, "read": 0.2, "student": 0.0}) == "compute"


@pytest.mark.parametrize("bad", [dict(samples=0), dict(samples=10, epochs=-1), dict(samples=10, views=True)])
def test_bad_workload_is_invalid_input(bad):
    with pytest.raises(InvalidInput, match="positive int"):
        Workload(**bad)


def test_fixed_setup_is_paid_once_per_run():
    c = Costs(1e-3, 1e-4, 1e-5, plan_s=0.5, compute_fixed_s=2.0)
    w = Workload(1000, epochs=3, students=2)
    t = terms(c, w)
    assert (t["online"]["setup"], t["compute-then-read"]["setup"], t["fill"]["setup"]) == (1.0, 2.5, 1.0)
    assert recommend(Costs(1e-3, 1e-4, 1e-5, compute_fixed_s=100.0), Workload(1000, epochs=3))[0] == "fill"


def test_bad_costs_are_invalid_input():
    with pytest.raises(InvalidInput, match="non-negative"):
        Costs(-1.0, 0.0, 0.0)


def test_advise_measures_on_a_real_store_and_leaves_nothing(tmp_path):
    store = featstore.open_store(tmp_path / "store")
    teacher = Teacher(model=TinyA(), dataset=VectorData(600), keep=["target"], outputs={"features": "float16"})
    steps = []
    advice = featstore.advise(store, teacher, Workload(600, epochs=4), samples=512, batch_size=64,
                              student=lambda batch: steps.append(len(batch["index"])))
    c = advice.costs
    assert c.teacher_s > 0 and c.write_s > 0 and c.read_s > 0 and c.student_s > 0 and c.plan_s > 0
    assert c.compute_fixed_s >= 0
    # fp16 features, the int64 target and the 16-byte input digest, compressed or not
    assert 0 < c.bytes_per_sample <= 8 * 2 + 8 + 16
    assert sum(steps) == 2 * 512  # B's step timed on two read epochs of the scratch version
    assert advice.mode in MODES and advice.predicted == predict(c, advice.workload)
    assert "| fill" in advice.table() and advice.reason
    assert store.names() == [] and store.storage.find("") == []  # the scratch versions are gone
    # and so are their folders (docs/modes.md: deleted after; nothing left for gc to find)
    assert [p.relative_to(tmp_path) for p in (tmp_path / "store").rglob("*")] == []
    assert store.gc(older_than=0, dry_run=True) == []


def test_advise_command_prints_the_table_and_json(tmp_path, capsys):
    code = main(["advise", str(tmp_path / "store"), "--model", "tests.cli_factories:small_model", "--dataset",
                 "tests.cli_factories:small_dataset", "--outputs", "features=float16", "--samples", "256",
                 "--epochs", "3", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["predicted_s"]) == set(MODES) and out["recommended"] in MODES
    assert out["workload"] == {"samples": 1200, "epochs": 3, "views": 1, "students": 1}
    assert not (tmp_path / "store").exists()  # the store it made for the scratch versions: gone again
    assert main(["advise", str(tmp_path / "store"), "--model", "tests.cli_factories:small_model", "--dataset",
                 "tests.cli_factories:small_dataset", "--epochs", "0"]) == 2  # a usage error
