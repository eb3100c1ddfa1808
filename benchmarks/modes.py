"""Which mode pays: the seed's three approaches and featstore's three modes, end to end.

``python -m benchmarks --only modes`` (``-n`` samples, default 2,048; 3 epochs). Two workloads
on the demo's data (3x32x32 synthetic images) and Model B (the demo's MLP probe on A's features,
Adam, batch 256): the demo's CNN teacher at width 16, and an expensive one (width 64: ~16x the FLOPs).
Rows, each timed end to end (A, storing, reading, B's training) over E epochs, one process,
``num_workers=0``, torch on one thread, each the fastest of two interleaved repeats:

- seed: A as a frozen submodule run every step (DataLoader over the images, shuffled);
- seed: A once into an in-memory tensor, then E epochs indexing it;
- seed: A once into per-batch ``torch.save`` files, then E epochs loading them;
- featstore online (``teacher=Teacher(...)``), compute-then-read (``store.compute`` on the
  embedded cluster + ``store.dataset``), fill (``Teacher(fill=True)``), and a second student
  reading the filled version.

Then the advisor (``featstore.advise``, 1,024 samples measured) predicts online,
compute-then-read and fill for the same workload; its rows are set beside the measured ones.
Results go to the marked section of ``docs/benchmarks.md`` and ``docs/benchmarks-modes.json``.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import featstore
from featstore.demo import ModelA, SyntheticImages, model_b

from .sections import write_marked

MARK_START, MARK_END = "<!-- modes-benchmark:start -->", "<!-- modes-benchmark:end -->"
BATCH = 256
OUTPUTS = {"features": "float16", "logits": "float32"}


@dataclass(frozen=True)
class Work:
    """One workload: its name, A's width and the epochs."""

    name: str
    width: int
    n: int
    epochs: int = 3


class Student:
    """Model B and its optimiser: one training step per batch of (features, target)."""

    def __init__(self, features: int) -> None:
        torch.manual_seed(1)
        self.net = model_b(features=features)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=1e-3)
        self.loss = nn.CrossEntropyLoss()

    def step(self, f: torch.Tensor, y: torch.Tensor) -> None:
        loss = self.loss(self.net(f.float()), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def batch(self, b: dict[str, torch.Tensor]) -> None:
        self.step(b["features"], b["target"])


def _epochs(epochs: int, one: Callable[[int], Iterable[tuple[torch.Tensor, torch.Tensor]]],
            student: Student) -> list[float]:
    out = []
    for e in range(epochs):
        t0 = time.perf_counter()
        for f, y in one(e):
            student.step(f, y)
        out.append(time.perf_counter() - t0)
    return out


def frozen(a: nn.Module, data: Any, w: Work) -> dict[str, Any]:
    """The user's own loop: A run on every batch under inference_mode, then B's step."""
    net = a.eval().requires_grad_(False)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))

    def one(_: int):
        for b in loader:
            with torch.inference_mode():
                f = net(b["input"])["features"]
            yield f.clone(), b["target"]

    epochs = _epochs(w.epochs, one, Student(net.head.in_features))
    return {"total_s": sum(epochs), "epochs_s": epochs, "setup_s": 0.0}


def _precompute(a: nn.Module, data: Any) -> tuple[torch.Tensor, torch.Tensor, float]:
    t0 = time.perf_counter()
    fs, ys = [], []
    with torch.inference_mode():
        for b in torch.utils.data.DataLoader(data, batch_size=BATCH):
            fs.append(a(b["input"])["features"].half())
            ys.append(b["target"])
    return torch.cat(fs), torch.cat(ys), time.perf_counter() - t0


def in_memory(a: nn.Module, data: Any, w: Work) -> dict[str, Any]:
    """A once into a tensor, then E epochs of shuffled batches indexed from it."""
    f, y, setup = _precompute(a.eval(), data)

    def one(e: int):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(e))
        for i in range(0, len(y), BATCH):
            idx = order[i:i + BATCH]
            yield f[idx], y[idx]

    epochs = _epochs(w.epochs, one, Student(f.shape[1]))
    return {"total_s": setup + sum(epochs), "epochs_s": epochs, "setup_s": setup}


def pt_files(a: nn.Module, data: Any, w: Work, folder: str) -> dict[str, Any]:
    """A once into one ``torch.save`` file per batch, then E epochs loading them in a shuffled order."""
    f, y, setup = _precompute(a.eval(), data)
    t0 = time.perf_counter()
    os.makedirs(folder, exist_ok=True)
    paths = []
    for k, i in enumerate(range(0, len(y), BATCH)):
        paths.append(os.path.join(folder, f"{k}.pt"))
        torch.save({"features": f[i:i + BATCH].clone(), "target": y[i:i + BATCH].clone()}, paths[-1])
    setup += time.perf_counter() - t0

    def one(e: int):
        for k in torch.randperm(len(paths), generator=torch.Generator().manual_seed(e)).tolist():
            b = torch.load(paths[k], weights_only=True)
            yield b["features"], b["target"]

    epochs = _epochs(w.epochs, one, Student(f.shape[1]))
    return {"total_s": setup + sum(epochs), "epochs_s": epochs, "setup_s": setup}


def teacher(a: nn.Module, data: Any, fill: bool = False) -> featstore.Teacher:
    return featstore.Teacher(model=a, dataset=data, keep=["target"], outputs=OUTPUTS, batch_size=BATCH, fill=fill,
                             options=featstore.ComputeOptions(progress=False))


def reading(ds: featstore.FeatureDataset, w: Work, student: Student, setup: float) -> dict[str, Any]:
    """E epochs of ``ds`` into ``student``, timed per epoch."""
    def one(e: int):
        ds.set_epoch(e)
        for b in ds:
            yield b["features"], b["target"]

    epochs = _epochs(w.epochs, one, student)
    return {"total_s": setup + sum(epochs), "epochs_s": epochs, "setup_s": setup}


def modes(store: featstore.FeatureStore, a: nn.Module, data: Any, w: Work) -> dict[str, Any]:
    """featstore's three modes and a second student on the filled version."""
    feats = a.head.in_features
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    ds = store.dataset(f"{w.name}/online", batch_size=BATCH, seed=0, teacher=teacher(a, data))
    out["online"] = reading(ds, w, Student(feats), time.perf_counter() - t0)
    t0 = time.perf_counter()
    version = store.compute(f"{w.name}/computed", model=a, dataset=data, keep=["target"], outputs=OUTPUTS,
                            batch_size=BATCH, options=featstore.ComputeOptions(progress=False))
    setup = time.perf_counter() - t0
    out["compute-then-read"] = reading(version.dataset(batch_size=BATCH, seed=0), w, Student(feats), setup)
    t0 = time.perf_counter()
    ds = store.dataset(f"{w.name}/filled", batch_size=BATCH, seed=0, teacher=teacher(a, data, fill=True))
    out["fill"] = reading(ds, w, Student(feats), time.perf_counter() - t0)
    filled = ds.committed()
    out["second student"] = reading(filled.dataset(batch_size=BATCH, seed=0), w, Student(feats), 0.0)
    got, want = filled.load(), version.load()
    out["fill_equals_compute"] = {"ids": filled.id == version.id,
                                  "values": all(torch.equal(got[k], want[k]) for k in want),
                                  "id": filled.id}
    return out


def advised(store: featstore.FeatureStore, a: nn.Module, data: Any, w: Work) -> dict[str, Any]:
    student = Student(a.head.in_features)
    t0 = time.perf_counter()
    advice = featstore.advise(store, teacher(a, data), featstore.Workload(w.n, epochs=w.epochs), samples=1024,
                              batch_size=BATCH, student=student.batch)
    return {**advice.to_json(), "table": advice.table(), "measure_s": time.perf_counter() - t0}


def run_workload(w: Work, work: str, say: Callable[[str], None]) -> dict[str, Any]:
    data = SyntheticImages(w.n)
    a = ModelA(width=w.width, features=128, classes=100)
    store = featstore.open_store(os.path.join(work, w.name))
    res: dict[str, Any] = {"workload": w.__dict__}
    res["advisor"] = advised(store, a, data, w)
    say(f"{w.name}: advisor recommends {res['advisor']['recommended']}")
    res["frozen submodule"] = frozen(ModelA(width=w.width, features=128, classes=100), data, w)
    res["in-memory tensor"] = in_memory(a, data, w)
    res["torch.save files"] = pt_files(a, data, w, os.path.join(work, f"{w.name}-pt"))
    say(f"{w.name}: seed rows done")
    res.update(modes(store, a, data, w))
    say(f"{w.name}: featstore rows done")
    return res


def best_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each row's fastest repeat (the machine is shared: the slower ones met other load); the
    advisor's measurement from the last repeat."""
    out = dict(runs[-1])
    for name in SEED_ROWS + FS_ROWS:
        out[name] = min((r[name] for r in runs), key=lambda row: row["total_s"])
    out["repeats"] = len(runs)
    out["paired"] = [checks(r) for r in runs]  # the ratios within each repeat (rows side by side)
    return out


def run_modes(n: int, work: str, say: Callable[[str], None], repeats: int = 3) -> dict[str, Any]:
    # one torch thread everywhere, so the machine's other load disturbs every row alike
    torch.set_num_threads(1)
    works = [Work("demo", 16, n), Work("expensive", 64, n)]
    runs: list[list[dict[str, Any]]] = [[] for _ in works]
    for k in range(repeats):  # repeats interleaved: a burst of other load hits one repeat, not one row
        for i, w in enumerate(works):
            runs[i].append(run_workload(w, os.path.join(work, f"r{k}"), say))
    return {"workloads": [best_of(r) for r in runs]}


SEED_ROWS = ("frozen submodule", "in-memory tensor", "torch.save files")
FS_ROWS = ("online", "compute-then-read", "fill", "second student")


def checks(r: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets for one workload, as measured."""
    read_epoch = sum(r["compute-then-read"]["epochs_s"][1:]) / max(1, len(r["compute-then-read"]["epochs_s"]) - 1)
    online0 = r["online"]["setup_s"] + r["online"]["epochs_s"][0]
    e = len(r["online"]["epochs_s"])
    pred = r["advisor"]["predicted_s"]
    measured = {m: r[m]["total_s"] for m in ("online", "compute-then-read", "fill")}
    return {
        "online_vs_frozen": r["online"]["total_s"] / r["frozen submodule"]["total_s"],
        "fill_vs_online0_plus_reads": r["fill"]["total_s"] / (online0 + (e - 1) * read_epoch),
        "advisor_error": {m: pred[m] / measured[m] - 1 for m in measured},
        "advisor_pick_is_fastest": r["advisor"]["recommended"] == min(measured, key=measured.get),
        "fastest_measured": min(measured, key=measured.get),
    }


def section(res: dict[str, Any], command: str) -> str:
    """The marked Markdown section of docs/benchmarks.md."""
    lines = [MARK_START, "## Which mode pays: online, compute-then-read, fill (issue 25)", "",
             f"`{command}` ({res.get('load', '')}); {res['elapsed_s']:.0f} s. One process, `num_workers=0`, "
             f"torch on 1 thread; each row the fastest of {res['workloads'][0]['repeats']} interleaved repeats "
             "(the advisor: its last measurement); the same Model B (the demo's MLP probe, Adam, batch "
             f"{BATCH}) in every row; seconds end to end (A, storing, reading, training).", ""]
    for r in res["workloads"]:
        w, c = r["workload"], checks(r)
        lines += [f"### {w['name']}: ModelA(width={w['width']}), N={w['n']}, {w['epochs']} epochs", "",
                  "| approach | total s | set-up s | epochs s | advisor s | advisor error |",
                  "|---|---:|---:|---|---:|---:|"]
        for name in SEED_ROWS + FS_ROWS:
            row = r[name]
            pred = r["advisor"]["predicted_s"].get(name)
            err = c["advisor_error"].get(name)
            lines.append(f"| {name} | {row['total_s']:.2f} | {row['setup_s']:.2f} | "
                         f"{', '.join(f'{x:.2f}' for x in row['epochs_s'])} | "
                         f"{'' if pred is None else f'{pred:.2f}'} | {'' if err is None else f'{err:+.0%}'} |")
        eq = r["fill_equals_compute"]
        paired = r.get("paired", [c])
        lines += ["", f"- online / frozen submodule: **{c['online_vs_frozen']:.3f}** from the fastest rows; "
                  f"within each repeat {_each(paired, 'online_vs_frozen')} (target ≤ 1.05)",
                  f"- fill / (online's first epoch + the other epochs read): **{c['fill_vs_online0_plus_reads']:.3f}**"
                  f" from the fastest rows; within each repeat {_each(paired, 'fill_vs_online0_plus_reads')}"
                  " (target ≤ 1.10)",
                  f"- fill's version is compute's: ids {'equal' if eq['ids'] else 'DIFFER'} ({eq['id']}), values "
                  f"{'equal' if eq['values'] else 'DIFFER'}",
                  f"- advisor: recommends **{r['advisor']['recommended']}**, fastest measured "
                  f"**{c['fastest_measured']}** ({'match' if c['advisor_pick_is_fastest'] else 'MISMATCH'}); "
                  f"measured in {r['advisor']['measure_s']:.1f} s", "",
                  "The advisor's own table for this workload:", "", r["advisor"]["table"], "",
                  f"> {r['advisor']['reason']}", ""]
    lines.append(MARK_END)
    return "\n".join(lines)


def _each(paired: list[dict[str, Any]], key: str) -> str:
    return ", ".join(f"{p[key]:.3f}" for p in paired)


def write_section(path: str, text: str) -> None:
    write_marked(path, MARK_START, MARK_END, text)


def main(n: int = 2048, out: str = "docs", command: str = "python -m benchmarks --only modes",
         say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run both workloads and write the section and the JSON."""
    import json

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="featstore-modes-") as work:
        res = run_modes(n, work, say)
    res["elapsed_s"] = time.perf_counter() - t0
    res["load"] = f"load average {os.getloadavg()[0]:.1f} at the end on {os.cpu_count()} cores"
    res["command"] = command
    for r in res["workloads"]:
        r["checks"] = checks(r)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "benchmarks-modes.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    write_section(os.path.join(out, "benchmarks.md"), section(res, command))
    return res
