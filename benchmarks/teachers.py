"""Several teachers on the same views: students from each teacher alone and from their ensemble,
and a control whose second teacher drew its views independently.

``python -m benchmarks.teachers`` (or ``python -m benchmarks --only teachers``; a few minutes on
2 cores). The data, augment, student and distillation loop are the views benchmark's
(:mod:`benchmarks.views`): scikit-learn's digits upsampled to 16x16, random crops, shifts and
flips drawn from featstore's generator, a small CNN student distilled with KL at T=4. Two
teachers of different widths and seeds are trained here; then

- teacher A is computed with K views (``views=K``);
- teacher B with ``views_of=A``: exactly A's views (same seeds, same augment, same shards);
- the control B' with K views of its own (``augment_seed`` another): the same augment and the
  same dataset, but each (sample, view) is another random picture.

Students (one loop, the same epochs and batch order; the student's input is A's view, joined by
the reader with ``source=``/``augment=``): from A alone, from B alone, from the ensemble of A and
B read together (``store.dataset({"a": A, "b": B})``, the mean of the two teachers'
probabilities at T, built by ``featstore.kd.ensemble``), and from the ensemble of A and B' (two
readers zipped by hand: the same rows, but B' saw other pixels than the student's input). The
multi-teacher reader refuses A with B' (:class:`~featstore.VersionsMisaligned`), which the run
checks too. Reported per row: held-out accuracy, top-1 agreement with the row's teacher (the
ensemble's mean on the held-out images for the ensemble rows), featstore's compute seconds and
training seconds, stored bytes per sample (every version the row reads, all K views). Results go
to the marked section of ``docs/benchmarks.md`` and to ``docs/benchmarks-teachers.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: Dask's executor threads inherit it

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import asdict, dataclass, replace  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import featstore  # noqa: E402
from featstore import kd  # noqa: E402

from . import views as vb  # noqa: E402
from .sections import write_marked  # noqa: E402

MARK_START, MARK_END = "<!-- teachers-benchmark:start -->", "<!-- teachers-benchmark:end -->"
CLASSES = 10


@dataclass(frozen=True)
class Setup:
    """The knobs: the views benchmark's, K views, and the two teachers (width, seed)."""

    base: vb.Setup = vb.Setup()
    views: int = 4
    teachers: tuple[tuple[int, int], ...] = ((24, 0), (16, 1))
    control_seed: int = 1234  # the control B' draws its views from this augment_seed


class Mean(nn.Module):
    """The ensemble's answer on clean images: the mean of the teachers' probabilities at T."""

    def __init__(self, teachers: list[nn.Module]) -> None:
        super().__init__()
        self.teachers = nn.ModuleList(teachers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.stack([torch.softmax(t(x) / vb.TAU, 1) for t in self.teachers]).mean(0)
        return vb.TAU * probs.log()


def as_logits(probs: torch.Tensor) -> torch.Tensor:
    """Logits whose softmax at T is ``probs``, for the views benchmark's KL at T."""
    return vb.TAU * probs.clamp_min(1e-30).log()


def ensemble_batches(batches: Iterator[dict[str, torch.Tensor]], names: list[str]) -> Iterator[tuple[torch.Tensor,
                                                                                                     torch.Tensor]]:
    """(student input, logits of the ensemble's mean at T) of each batch: ``kd.ensemble`` on the
    teachers' outputs in the batch, densified at T."""
    for batch in batches:
        ens = kd.ensemble(batch, names)
        yield batch["image"], as_logits(kd.densify(ens, num_classes=CLASSES, temperature=vb.TAU))


def zipped(ds_a: featstore.FeatureDataset, ds_b: featstore.FeatureDataset) -> Iterator[dict[str, torch.Tensor]]:
    """The control: two readers with the same options walk the same plan (same rows, same view
    number), zipped by hand without the alignment check; B's rows are of its own views."""
    for a, b in zip(ds_a, ds_b, strict=True):
        assert torch.equal(a["index"], b["index"])
        yield {"image": a["image"], "a/logits": a["logits"], "b/logits": b["logits"]}


@dataclass(frozen=True)
class Row:
    approach: str
    compute_s: float
    train_s: float
    accuracy: float
    agreement: float
    bytes_per_sample: float
    right: list[int]


def compute(store: featstore.FeatureStore, name: str, teacher: nn.Module, train: vb.Digits,
            views: int | None = None, seed: int = 0, views_of: str | None = None) -> tuple[featstore.Version, float]:
    t0 = time.perf_counter()
    kw = ({"augment": vb.augment, "views_of": views_of} if views_of is not None
          else {"views": featstore.Views(k=views, augment=vb.augment, seed=seed)})
    v = store.compute(name, model=teacher, dataset=train, input_key="image", outputs={"logits": "float32"},
                      batch_size=256, options=featstore.ComputeOptions(progress=False), **kw)
    return v, time.perf_counter() - t0


def student_row(label: str, batches, judge: nn.Module, versions: list[featstore.Version], compute_s: float,
                train: vb.Digits, test: vb.Digits, setup: Setup) -> Row:
    student, train_s = vb.distill(batches, len(train), setup.base)
    acc, agree, right = vb.evaluate(student, judge, test)
    size = sum(vb.stored_bytes(v) for v in versions) / len(train)
    print(f"{label}: acc {acc:.3f} agreement {agree:.3f} ({compute_s:.1f} + {train_s:.1f} s)", flush=True)
    return Row(label, compute_s, train_s, acc, agree, size, right)


def train_teachers(train: vb.Digits, test: vb.Digits, setup: Setup) -> tuple[list[nn.Module], list[dict]]:
    nets, info = [], []
    for width, seed in setup.teachers:
        net, secs = vb.train_teacher(train, replace(setup.base, teacher_width=width, seed=seed))
        acc = float((net(test.images).argmax(1) == test.targets).float().mean())
        nets.append(net)
        info.append({"width": width, "seed": seed, "train_s": secs, "accuracy": acc})
        print(f"teacher width {width} seed {seed}: {secs:.1f} s, held-out accuracy {acc:.4f}", flush=True)
    return nets, info


def run(setup: Setup) -> dict:
    import distributed  # noqa: F401 - a one-time import per process, not part of any compute

    started, t0 = time.strftime("%Y-%m-%d %H:%M:%S"), time.perf_counter()
    torch.set_num_threads(1)
    train, test = vb.load_digits(setup.base)
    (ta, tb), info = train_teachers(train, test, setup)
    seed = setup.base.seed
    opts = {"batch_size": setup.base.batch, "seed": seed}
    join = {"source": train, "augment": vb.augment, "source_fields": ["image"]}
    with tempfile.TemporaryDirectory(prefix="featstore-teachers-") as root:
        store = featstore.open_store(os.path.join(root, "store"))
        a, a_s = compute(store, "digits/teacher-a", ta, train, views=setup.views, seed=seed)
        b, b_s = compute(store, "digits/teacher-b", tb, train, views_of=a.ref)
        c, c_s = compute(store, "digits/teacher-b-own-views", tb, train, views=setup.views,
                         seed=setup.control_seed)
        try:
            store.dataset({"a": a, "b": c})
            refused = ""
        except featstore.VersionsMisaligned as exc:
            refused = f"VersionsMisaligned(differs={list(exc.differs)})"

        def single(v: featstore.Version):
            ds = store.dataset(v, **opts, **join)
            return lambda epoch: ((bt["image"], bt["logits"]) for bt in _epoch(ds, epoch))

        multi = store.dataset({"a": a, "b": b}, **opts, **join)
        ds_a, ds_c = store.dataset(a, **opts, **join), store.dataset(c, **opts)
        ens = Mean([ta, tb])
        rows = [
            student_row("A alone (K views)", single(a), ta, [a], a_s, train, test, setup),
            student_row("B alone (views_of=A)", single(b), tb, [b], b_s, train, test, setup),
            student_row("ensemble A+B, aligned (views_of, one reader)",
                        lambda e: ensemble_batches(_epoch(multi, e), ["a/logits", "b/logits"]), ens, [a, b],
                        a_s + b_s, train, test, setup),
            student_row("control: ensemble A+B', B' on its own views (misaligned)",
                        lambda e: ensemble_batches(_zipped_epoch(ds_a, ds_c, e), ["a/logits", "b/logits"]), ens,
                        [a, c], a_s + c_s, train, test, setup),
        ]
    return {"setup": asdict(setup), "teachers": info, "refused": refused, "n_train": len(train), "n_test": len(test),
            "ensemble_accuracy": float((ens(test.images).argmax(1) == test.targets).float().mean()),
            "rows": [asdict(r) | {"total_s": r.compute_s + r.train_s} for r in rows], "started": started,
            "minutes": (time.perf_counter() - t0) / 60, "load_average": os.getloadavg()}


def _epoch(ds, epoch: int):
    ds.set_epoch(epoch)
    return iter(ds)


def _zipped_epoch(ds_a, ds_b, epoch: int):
    ds_a.set_epoch(epoch)
    ds_b.set_epoch(epoch)
    return zipped(ds_a, ds_b)


# -- report -------------------------------------------------------------------------------------
def markdown(result: dict, command: str) -> str:
    s, t = result["setup"], result["teachers"]
    teachers = "; ".join(f"{'AB'[i]}: width {x['width']}, seed {x['seed']}, {x['train_s']:.0f} s, held-out "
                         f"accuracy {x['accuracy']:.3f}" for i, x in enumerate(t))
    head = [
        MARK_START,
        "## Several teachers on the same views (issue 26)",
        "",
        f"Generated by `{command}` (started {result['started']}, {result['minutes']:.1f} min, load average "
        f"{result['load_average'][0]:.1f} at the end, on 2 cores shared with other jobs; torch on one thread). "
        f"The views benchmark's digits ({result['n_train']} train / {result['n_test']} held-out), augment, "
        f"student and loop ({s['base']['epochs']} epochs, KL at T={vb.TAU:g}, batch {s['base']['batch']}). "
        f"Two teacher CNNs trained here ({teachers}; the mean of their probabilities: held-out accuracy "
        f"{result['ensemble_accuracy']:.3f}). K={s['views']} views. B is computed with `views_of=A`; the "
        f"control B' is the same teacher on K views of its own (`augment_seed={s['control_seed']}`), which "
        f"`store.dataset({{\"a\": A, \"b\": B'}})` refuses: {result['refused'] or 'NOT refused'}. Every "
        "student's input is A's view of the row, joined by the reader; the ensemble rows distil from "
        "`kd.ensemble(batch, [\"a/logits\", \"b/logits\"])` (the mean of probabilities at T).",
        "",
        "| student distilled from | compute s | training s | held-out acc | acc vs A alone, points | "
        "agreement with its teacher | stored bytes/sample |",
        "|---|---|---|---|---|---|---|",
    ]
    a = result["rows"][0]
    body = [f"| {r['approach']} | {r['compute_s']:.1f} | {r['train_s']:.1f} | {r['accuracy']:.3f} | "
            + ("" if r is a else "{:+.1f} ± {:.1f}".format(*vb.paired_delta(r, a)))
            + f" | {r['agreement']:.3f} | {r['bytes_per_sample']:.0f} |" for r in result["rows"]]
    aligned, control = result["rows"][2], result["rows"][3]
    delta, err = vb.paired_delta(aligned, control)
    notes = ["", f"- Aligned vs misaligned ensemble: {delta:+.1f} ± {err:.1f} points of held-out accuracy, "
             f"{100 * (aligned['agreement'] - control['agreement']):+.1f} points of agreement with the ensemble.",
             "", "One seed per row: ± is 1.96 standard errors of the accuracy difference, paired over the same "
             "held-out images. Compute is featstore's (embedded Dask start-up included), once per version; "
             "B's compute runs A's K views again through B, the control's its own K. Bytes per sample count "
             "every version a row reads (all K views; an epoch reads one view of each). Every row's training "
             "runs the same loop over the same batches; its seconds follow the machine's load while that row "
             "ran (other jobs share the 2 cores), so compare accuracies across rows, not seconds.", MARK_END]
    return "\n".join(head + body + notes) + "\n"


def main(argv: list[str] | None = None, command: str | None = None) -> int:
    """Run with ``argv``'s knobs; ``command`` is what the section names as its command."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=vb.Setup.epochs)
    p.add_argument("--teacher-epochs", type=int, default=vb.Setup.teacher_epochs)
    p.add_argument("--views", type=int, default=Setup.views)
    p.add_argument("--out", default="docs", help="folder of benchmarks.md (the section is replaced)")
    args = p.parse_args(argv)
    base = replace(vb.Setup(), epochs=args.epochs, teacher_epochs=args.teacher_epochs)
    result = run(Setup(base=base, views=args.views))
    command = command or "python -m benchmarks.teachers " + " ".join(argv if argv is not None else sys.argv[1:])
    section = markdown(result, command.strip())
    print(section)
    os.makedirs(args.out, exist_ok=True)
    write_marked(os.path.join(args.out, "benchmarks.md"), MARK_START, MARK_END, section)
    with open(os.path.join(args.out, "benchmarks-teachers.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
