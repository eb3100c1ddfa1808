"""A Hugging Face causal LM as featstore's Model A: its tokenized texts, the model wrapped to
return per-token logits, and the :class:`~featstore.Tokens` that store only real tokens and
record the tokenizer.

>>> data = TokenizedTexts(texts, tok, max_tokens=256)              # item: {"input_ids": LongTensor}
>>> v = store.compute("smollm2/docs", model=CausalLMLogits(lm), dataset=data, input_key="input_ids",
...                   outputs={"logits": "topkq:50"}, batch_size=8,
...                   options=featstore.ComputeOptions(collate=pad_sequences),
...                   tokens=teacher_tokens(tok, max_tokens=256))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # transformers is imported where it is used (featstore.hf imports without it)
    from transformers import PreTrainedModel

from featstore.codecs import Tokens, attention_mask
from featstore.errors import InvalidInput
from featstore.hf._identity import vocabulary


class TokenizedTexts(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Texts tokenized once, truncated to ``max_tokens``: item ``i`` is ``{"input_ids":
    LongTensor [L_i]}``. The dataset a version is computed on and its student reads (the
    student's inputs are joined from it by index, checked against the version's digest).

    ``add_special_tokens``: what the tokenizer adds around each text (BOS, ...).
    """

    def __init__(self, texts: Sequence[str], tokenizer: Any, max_tokens: int,
                 add_special_tokens: bool = True) -> None:
        if isinstance(texts, str) or not len(texts):
            raise InvalidInput("TokenizedTexts takes a non-empty list of texts.")
        enc = tokenizer(list(texts), truncation=True, max_length=max_tokens, add_special_tokens=add_special_tokens)
        self.items = [torch.tensor(ids, dtype=torch.long) for ids in enc["input_ids"]]
        empty = [i for i, t in enumerate(self.items) if len(t) == 0]
        if empty:
            raise InvalidInput(f"texts {empty[:10]} tokenize to no tokens; leave them out.")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.items[i]}

    @property
    def tokens(self) -> int:
        """Tokens over all texts."""
        return sum(len(t) for t in self.items)


class CausalLMLogits(torch.nn.Module):
    """A Hugging Face causal LM as Model A: ``forward(x)`` takes the batch
    :func:`featstore.ragged.pad_sequences` builds (``ids``, ``attention_mask``) and returns the
    float32 logits ``[B, L, vocab]``; logit ``t`` is the model's distribution of the token after
    position ``t``, which is what a student's logit ``t`` is trained against."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=x["ids"], attention_mask=x["attention_mask"].long()).logits
        return logits.float()  # a transformers model's output: untyped to mypy


def teacher_tokens(tokenizer: Any, max_tokens: int, name: str | None = None) -> Tokens:
    """``Tokens`` for a causal LM's logits: every real token of each sample is stored (the
    attention mask of :func:`featstore.ragged.pad_sequences`), and the tokenizer's identity
    (:func:`vocabulary`) goes into the version's fingerprint and manifest."""
    return Tokens(mask=attention_mask, max_tokens=max_tokens, vocabulary=vocabulary(tokenizer, name))


def student_from(teacher: PreTrainedModel, num_hidden_layers: int = 2, seed: int = 0,
                 **changes: Any) -> PreTrainedModel:
    """A randomly initialised model of the teacher's architecture and configuration (its
    vocabulary, hence its tokenizer) with ``num_hidden_layers`` layers and any other ``changes``
    to the configuration: a student whose logits line up with the teacher's soft labels. Seeded;
    float32. (A GGUF teacher's quantisation entry is left out.)

    >>> student = featstore.hf.student_from(teacher, num_hidden_layers=2)
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = teacher.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.update(num_hidden_layers=num_hidden_layers, dtype="float32", **changes)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    student: PreTrainedModel = AutoModelForCausalLM.from_config(config).train()  # transformers' Auto class: Any
    return student
