"""The distillation loss a ``Trainer.compute_loss`` override calls in one line: sparse forward or
reverse KL to the stored top-k (:func:`featstore.kd.kd_loss`) at a temperature, mixed with the
language-model loss.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from featstore import kd
from featstore.codecs._sparse import sparse_weights
from featstore.distill._fused import FusedKD
from featstore.errors import InvalidInput
from featstore.hf._collator import TARGETS

#: Keys a :class:`~featstore.hf.DistillCollator` batch carries that the model's forward never takes.
_NOT_FOR_THE_MODEL = (*TARGETS, "index")


@dataclass(frozen=True)
class Distillation:
    """How the student learns from the teacher's top-k.

    Attributes:
        alpha: weight of the distillation term; ``1 - alpha`` weighs the language-model loss
            (cross-entropy on ``labels``). 1: distillation alone (the LM loss is not computed).
        temperature: the student's logits are divided by it; the teacher's stored log-probs
            are at the temperature they were computed at (:class:`~featstore.hf.SoftLabels`
            checks that it is this one). The KL is scaled by ``temperature**2``.
        direction: ``"forward"`` (``KL(teacher || student)``) or ``"reverse"``.
        rule: how the top-k stands for the whole distribution: ``"uniform_tail"`` (the mass
            not kept, spread over the other classes) or ``"renormalize"`` (the top-k alone).
    """

    alpha: float = 0.5
    temperature: float = 1.0
    direction: str = "forward"
    rule: str = "uniform_tail"

    def __post_init__(self) -> None:
        if not (isinstance(self.alpha, int | float) and 0.0 <= self.alpha <= 1.0):
            raise InvalidInput(f"alpha must be in [0, 1], got {self.alpha!r}.")
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise InvalidInput(f"temperature must be a finite number > 0, got {self.temperature!r}.")
        if self.direction not in kd.DIRECTIONS:
            raise InvalidInput(f"direction must be one of {kd.DIRECTIONS}, got {self.direction!r}.")
        if self.rule not in ("uniform_tail", "renormalize"):
            raise InvalidInput(f"rule must be 'uniform_tail' or 'renormalize', got {self.rule!r}.")


def topk_kd_loss(logits: torch.Tensor, batch: Mapping[str, torch.Tensor], how: Distillation,
                 logq: torch.Tensor | None = None) -> torch.Tensor:
    """The distillation term alone: the student's ``logits [B, L, V]`` against the batch's
    ``target_*`` columns, averaged over the real positions (``target_mask``). ``logq``:
    ``log_softmax(logits / temperature)`` where the caller has it already."""
    mask = batch["target_mask"]
    real = mask[..., 0] > 0
    kept = mask[real] > 0
    ids = torch.where(kept, batch["target_token_ids"][real], -1)
    logp = torch.where(kept, batch["target_logprobs"][real].float(), -math.inf)
    if logq is None:
        logq = torch.log_softmax(logits[:, :real.shape[1]].float() / how.temperature, dim=-1)
    kl = kd.sparse_kl(logq[:, :real.shape[1]][real], ids, logp, rule=how.rule, direction=how.direction)
    return kl.mean() * how.temperature ** 2


def lm_loss(logq: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """The causal LM's cross-entropy from its log-probabilities ``logq [B, L, V]`` (temperature 1):
    position ``t`` predicts ``labels[t + 1]``, ``-100`` ignored; averaged over the predicted tokens,
    or summed over ``num_items_in_batch`` (gradient accumulation), as transformers' own loss is."""
    target = labels[:, 1:]
    keep = target != -100
    nll = -torch.gather(logq[:, :-1], 2, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)[keep]
    if num_items_in_batch is not None:
        return nll.sum() / torch.as_tensor(num_items_in_batch, dtype=nll.dtype, device=nll.device)
    return nll.sum() / keep.sum().clamp(min=1)


def distill_loss(model: torch.nn.Module, inputs: Mapping[str, Any], how: Distillation | None = None, *,
                 return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
    """``alpha * KD + (1 - alpha) * LM`` for a :class:`~featstore.hf.DistillCollator` batch: what
    ``Trainer.compute_loss`` returns, so an override is one line::

        class KDTrainer(transformers.Trainer):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return hf.distill_loss(model, inputs, hf.Distillation(alpha=0.5),
                                       return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    The model runs on ``input_ids`` and ``attention_mask`` (its own loss is not computed). KD is
    averaged over the real positions, the LM cross-entropy (on ``labels``, as transformers
    computes it, ``num_items_in_batch`` included) over the predicted tokens. The forward KL is
    computed with the cross-entropy in one pass over the logits
    (:class:`~featstore.distill._fused.FusedKD`), so distilling costs about what the LM loss does.
    """
    how = how or Distillation()
    missing = [k for k in TARGETS if k not in inputs]
    if missing:
        raise InvalidInput(f"the batch has no {missing} (keys: {sorted(inputs)}): build it with "
                           "featstore.hf.DistillCollator over featstore.hf.SoftLabels samples.")
    batch = {k: v for k, v in inputs.items() if k not in (*_NOT_FOR_THE_MODEL, "labels")}
    outputs = model(**batch)
    logits = outputs.logits.float()
    if how.direction == "forward":
        loss = _fused_loss(logits, inputs, how, num_items_in_batch)
    else:
        logq = torch.log_softmax(logits / how.temperature, dim=-1)
        loss = topk_kd_loss(logits, inputs, how, logq)
        if how.alpha < 1.0:
            lm_logq = logq if how.temperature == 1.0 else torch.log_softmax(logits, dim=-1)
            loss = how.alpha * loss + (1.0 - how.alpha) * lm_loss(lm_logq, inputs["labels"], num_items_in_batch)
    return (loss, outputs) if return_outputs else loss


def _fused_loss(logits: torch.Tensor, inputs: Mapping[str, Any], how: Distillation,
                num_items_in_batch: Any) -> torch.Tensor:
    """The forward-KL loss through :class:`FusedKD`: the batch's columns as its rows and weights."""
    b, length, vocab = logits.shape
    mask = inputs["target_mask"][:, :length]
    real = mask[..., 0] > 0
    kept = (mask > 0) & real.unsqueeze(-1)
    k = mask.shape[-1]
    ids = torch.where(kept, inputs["target_token_ids"][:, :length], -1).reshape(-1, k)
    logp = torch.where(kept, inputs["target_logprobs"][:, :length].float(), -math.inf).reshape(-1, k)
    w, tail = sparse_weights(ids, logp, None, vocab, how.rule)
    kd_coef = real.reshape(-1).float() * (how.alpha * how.temperature ** 2 / real.sum().clamp(min=1))
    target = torch.nn.functional.pad(inputs["labels"][:, 1:length], (0, 1), value=-100).reshape(-1)
    predicted = target != -100
    count = predicted.sum().clamp(min=1) if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
    lm_coef = predicted.float() * ((1.0 - how.alpha) / count.to(torch.float32))
    return FusedKD.apply(logits.reshape(-1, vocab), ids.clamp(min=0), ids >= 0, w, tail, kd_coef,
                         target.clamp(min=0), lm_coef, how.temperature)
