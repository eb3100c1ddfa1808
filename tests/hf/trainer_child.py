"""A KD run of transformers' Trainer (or TRL's SFTTrainer) on the tiny teacher's soft labels, in
this process or as one torchrun rank: records the samples each rank read and trained on.

``python -m tests.hf.trainer_child STORE REF OUT MODE STEPS`` (MODE: map, iterable,
iterable-dispatch); writes ``OUT/rank<r>.json``: ``{"read": [...], "trained": [[...], ...]}``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

import featstore
from featstore import hf

from tests.hf.lm import llama, sentences, tokenizer

N, MAX_TOKENS = 48, 40  # tests/hf/conftest.py's


class RecordingSoftLabels(hf.SoftLabels):
    """SoftLabels that remember every index they read (in this process)."""

    read: list[int] = []

    def __getitems__(self, indices):
        type(self).read += [int(i) for i in indices]
        return super().__getitems__(indices)


def trainer_class(base: type) -> type:
    """``base`` with the one-line distillation ``compute_loss``, recording each step's indices."""

    class KD(base):
        trained: list[list[int]] = []

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            type(self).trained.append(inputs["index"].tolist())
            return hf.distill_loss(model, inputs, hf.Distillation(alpha=0.5), return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch)

    KD.trained = []
    return KD


def train_dataset(store_url: str, ref: str, mode: str) -> tuple[Any, Any]:
    """The dataset of ``mode`` over the version, and the tokenizer."""
    tok = tokenizer()
    data = hf.TokenizedTexts(sentences(N), tok, max_tokens=MAX_TOKENS)
    RecordingSoftLabels.read = []
    ds = RecordingSoftLabels(featstore.open_store(store_url).open(ref), data, tokenizer=tok, temperature=1.0)
    return (ds if mode == "map" else ds.iterable(seed=1, buffer_size=8, samples_per_group=4)), tok


def arguments(out: str, steps: int, mode: str, sft: bool = False, **extra: Any) -> Any:
    from transformers import TrainingArguments

    kw = {"output_dir": out, "per_device_train_batch_size": 4, "max_steps": steps, "report_to": [], "use_cpu": True,
          "save_strategy": "no", "logging_steps": 1, "seed": 0, "dataloader_num_workers": 0, "disable_tqdm": True,
          "learning_rate": 1e-3, **({"ddp_backend": "gloo"} if "WORLD_SIZE" in os.environ else {}), **extra}
    if mode == "iterable":
        kw["accelerator_config"] = {"dispatch_batches": False}
    if sft:
        from trl import SFTConfig

        # SFTConfig's bf16 and gradient checkpointing only cost time on a CPU (docs/distilling-lms.md)
        return SFTConfig(**kw, bf16=False, gradient_checkpointing=False, dataset_kwargs={"skip_prepare_dataset": True})
    return TrainingArguments(**kw)


def run(store_url: str, ref: str, out: str, mode: str, steps: int, sft: bool = False,
        resume: str | None = None, **extra: Any) -> dict[str, Any]:
    """Train ``steps`` steps; returns what this process read and trained on, and the weights."""
    from transformers import Trainer

    torch.manual_seed(0)
    ds, tok = train_dataset(store_url, ref, mode)
    student = llama(len(tok), seed=2).train()
    if sft:
        from trl import SFTTrainer

        cls = trainer_class(SFTTrainer)
        trainer = cls(model=student, args=arguments(out, steps, mode, sft=True, **extra), train_dataset=ds,
                      data_collator=hf.DistillCollator(pad_token_id=tok.pad_token_id, index=True),
                      processing_class=tok)
    else:
        cls = trainer_class(Trainer)
        trainer = cls(model=student, args=arguments(out, steps, mode, **extra), train_dataset=ds,
                      data_collator=hf.DistillCollator(pad_token_id=tok.pad_token_id, index=True))
    result = trainer.train(resume_from_checkpoint=resume)
    return {"read": list(RecordingSoftLabels.read), "trained": list(cls.trained), "loss": result.training_loss,
            "weights": {k: v.detach().clone() for k, v in student.state_dict().items()}}


def main(store_url: str, ref: str, out: str, mode: str, steps: str) -> None:
    got = run(store_url, ref, os.path.join(out, "trainer"), mode, int(steps))
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({k: got[k] for k in ("read", "trained", "loss")}, f)


if __name__ == "__main__":
    main(*sys.argv[1:6])
