"""The collator: :class:`~featstore.hf.Sample` s -> the padded batch axolotl's KD integration reads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from dataclasses import dataclass

import torch

from featstore.errors import InvalidInput

#: The teacher's columns of a batch (axolotl's names), which the model's forward never takes.
TARGETS = ("target_token_ids", "target_logprobs", "target_mask")
#: The batch's column holding the temperature each sample's soft labels were stored at (``[B]``
#: float32, every row the same): how :func:`~featstore.hf.distill_loss` learns it. A row per
#: sample, not one number, so that any split or concatenation of batches (accelerate's) keeps it.
TEMPERATURE = "target_temperature"
#: What pads ``target_logprobs`` (axolotl's value: finite, so masked arithmetic stays finite).
LOGPROB_PAD = -1e9
LABEL_PAD = -100
#: The key of a sample (:class:`~featstore.hf.Sample`) that holds its soft labels' temperature.
TEMPERATURE_KEY = "temperature"


@dataclass(frozen=True)
class DistillCollator:
    """Pads samples to the longest of the batch (right), giving ``input_ids``,
    ``attention_mask``, ``labels`` ``[B, L]`` (``-100`` on padding) and ``target_token_ids``,
    ``target_logprobs``, ``target_mask`` ``[B, L, K]`` (padding: id 0, log-prob ``-1e9``, mask 0),
    the columns and padding of axolotl's KD collator; ``target_temperature`` ``[B]``, the
    temperature the samples' soft labels were stored at (where the samples say it, as
    :class:`~featstore.hf.Sample` s do), which :func:`~featstore.hf.distill_loss` distils at;
    with ``index``, the samples' indices ``[B]``.

    Args:
        pad_token_id: the id padding ``input_ids`` (masked out by ``attention_mask``).
        pad_to_multiple_of: round ``L`` up to a multiple of this (None: the longest sample).
        index: add the samples' ``index`` (the distillation loss drops it before the model).

    >>> batch = DistillCollator(pad_token_id=tok.pad_token_id)([train[0], train[1]])
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    index: bool = False

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not features:
            raise InvalidInput("DistillCollator got an empty batch.")
        lost = [k for k in ("target_token_ids", "target_logprobs") if k not in features[0]]
        if lost:
            raise InvalidInput(f"the batch's samples have no {lost}: something dropped the teacher's columns before "
                               f"the collator (keys left: {sorted(features[0])}). With transformers' Trainer, set "
                               "TrainingArguments(remove_unused_columns=False), or pass featstore.hf.SoftLabels "
                               "samples unchanged.")
        lengths = [len(f["input_ids"]) for f in features]
        width = max(lengths)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        k = features[0]["target_token_ids"].shape[-1]
        b = len(features)
        out = {"input_ids": torch.full((b, width), self.pad_token_id, dtype=torch.long),
               "attention_mask": torch.zeros(b, width, dtype=torch.long),
               "labels": torch.full((b, width), LABEL_PAD, dtype=torch.long),
               "target_token_ids": torch.zeros(b, width, k, dtype=torch.long),
               "target_logprobs": torch.full((b, width, k), LOGPROB_PAD, dtype=torch.float32),
               "target_mask": torch.zeros(b, width, k, dtype=torch.int32)}
        for i, (f, n) in enumerate(zip(features, lengths, strict=True)):
            out["input_ids"][i, :n] = torch.as_tensor(f["input_ids"])
            out["attention_mask"][i, :n] = 1
            out["labels"][i, :n] = torch.as_tensor(f["labels"])
            out["target_token_ids"][i, :n] = f["target_token_ids"]
            out["target_logprobs"][i, :n] = f["target_logprobs"]
            out["target_mask"][i, :n] = 1
        if all(TEMPERATURE_KEY in f for f in features):
            out[TEMPERATURE] = torch.tensor([float(f[TEMPERATURE_KEY]) for f in features], dtype=torch.float32)
        if self.index:
            out["index"] = torch.tensor([int(f["index"]) for f in features], dtype=torch.long)
        return out
