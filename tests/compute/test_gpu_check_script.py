"""The prepared GPU check (benchmarks/gpu_check.py) stays runnable: it skips cleanly without
CUDA, and its steps run end to end on the CPU with a tiny network (the figures mean nothing here;
the script is meant for a machine with a GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.gpu_check import MARK_END, MARK_START, main, markdown, replace_section, write


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: the no-CUDA path does not apply")
def test_skips_cleanly_without_cuda(tmp_path, capsys):
    assert main(["--out", str(tmp_path)]) == 0
    assert "skipped: CUDA is not available" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_runs_every_step_on_the_cpu_and_writes_one_section(tmp_path):
    (tmp_path / "benchmarks.md").write_text("# featstore benchmarks\n\nrows\n")
    args = ["--allow-cpu", "--tiny", "--n", "64", "--batch", "32", "--size", "32", "--ref-rows", "8",
            "--seconds", "0.2", "--modes", "float32,bfloat16", "--lm-sequences", "12", "--out", str(tmp_path)]
    assert main(args) == 0
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["env"]["device"] == "cpu" and res["n"] == 64
    for mode in ("float32", "bfloat16"):
        assert res["reference"][mode]["ok"], res["reference"][mode]
        assert res["compute"][mode]["samples_per_s"] > 0 and res["pure"][mode]["samples_per_s"] > 0
        assert res["ratios"][mode] > 0
    # float32 on the same CPU: only the float16 storage of the features differs from the reference
    assert res["reference"]["float32"]["features"]["rel_l2"] < 2e-3
    assert res["reference"]["float32"]["logits"]["rel_l2"] < 1e-5
    assert [w["device"] for w in res["workers"].values()] == ["cpu"] and res["gpus_used"] == 1
    assert res["lm"]["ok"] and res["lm"]["tokens"] > 0 and res["lm"]["compute_tokens_per_s"] > 0
    md = (tmp_path / "benchmarks.md").read_text()
    assert md.startswith("# featstore benchmarks\n\nrows\n") and md.count(MARK_START) == 1
    assert "## GPU check" in md and "| bfloat16 |" in md
    write(res, str(tmp_path))  # a second run replaces the section instead of adding one
    assert (tmp_path / "benchmarks.md").read_text() == md


def test_replace_section_keeps_what_is_around_it():
    old = f"# b\n\nbefore\n\n{MARK_START}\nold\n{MARK_END}\nafter\n"
    new = f"{MARK_START}\nnew\n{MARK_END}\n"
    assert replace_section(old, new) == f"# b\n\nbefore\n\n{new}after\n"
    assert replace_section("# b\n", new) == f"# b\n\n{new}"


def test_markdown_flags_a_failed_reference_check():
    res = {"env": {"date": "d", "gpu": None, "cpu": "x", "cpu_count": 2, "python": "3", "torch": "t",
                   "featstore": "f"},
           "n": 8, "batch": 4, "size": 8, "model": "m", "modes": ["float16"], "workers": {},
           "compute": {"float16": {"samples_per_s": 90.0, "utilisation": {"source": None, "samples": 0}}},
           "pure": {"float16": {"samples_per_s": 100.0}}, "pure_from_host": {"float16": {"samples_per_s": 95.0}},
           "ratios": {"float16": 0.9}, "gpus_used": 1, "input_pipeline": {"samples_per_s": 50.0},
           "reference": {"float16": {"x": {"rel_l2": 0.5, "max_rel": 0.5, "ok": False}, "ok": False,
                                     "tolerance": 0.01}}}
    md = markdown(res)
    assert "**FAILED**" in md and "met (0.90)" in md and "it bounds the compute" in md
