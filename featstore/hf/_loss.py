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
from featstore.codecs import sparse_weights
from featstore.distill import FusedKD
from featstore.errors import InvalidInput, SourceMismatch
from featstore.hf._collator import TARGETS, TEMPERATURE

#: Keys a :class:`~featstore.hf.DistillCollator` batch carries that the model's forward never takes.
_NOT_FOR_THE_MODEL = (*TARGETS, TEMPERATURE, "index")


@dataclass(frozen=True)
class Distillation:
    """How the student learns from the teacher's top-k.

    Attributes:
        alpha: weight of the distillation term; ``1 - alpha`` weighs the language-model loss
            (cross-entropy on ``labels``). 1: distillation alone (the LM loss is not computed).
        temperature: the temperature to distil at: the student's logits are divided by it and
            the KL is scaled by ``temperature**2``. The teacher's log-probs are the stored ones,
            at the temperature they were computed at, which a batch of
            :class:`~featstore.hf.SoftLabels` samples collated by
            :class:`~featstore.hf.DistillCollator` carries (``target_temperature``). None (the
            default): that one (1 for a batch that does not say, e.g. another collator's). A
            number that differs from it is refused (:class:`~featstore.SourceMismatch` naming
            both), so a student never distils at another temperature than its soft labels'.
        direction: ``"forward"`` (``KL(teacher || student)``) or ``"reverse"``.
        rule: how the top-k stands for the whole distribution: ``"uniform_tail"`` (the mass
            not kept, spread over the other classes) or ``"renormalize"`` (the top-k alone).
    """

    alpha: float = 0.5
    temperature: float | None = None
    direction: str = "forward"
    rule: str = "uniform_tail"

    def __post_init__(self) -> None:
        if not (isinstance(self.alpha, int | float) and 0.0 <= self.alpha <= 1.0):
            raise InvalidInput(f"alpha must be in [0, 1], got {self.alpha!r}.")
        if self.temperature is not None and not (isinstance(self.temperature, int | float)
                                                 and math.isfinite(self.temperature) and self.temperature > 0):
            raise InvalidInput(f"temperature must be a finite number > 0 (or None: the stored soft labels' own), "
                               f"got {self.temperature!r}.")
        if self.direction not in kd.DIRECTIONS:
            raise InvalidInput(f"direction must be one of {kd.DIRECTIONS}, got {self.direction!r}.")
        if self.rule not in ("uniform_tail", "renormalize"):
            raise InvalidInput(f"rule must be 'uniform_tail' or 'renormalize', got {self.rule!r}.")


def temperature_of(how: Distillation, batch: Mapping[str, Any]) -> float:
    """The temperature to distil ``batch`` at: the one its soft labels were stored at
    (``target_temperature``), which ``how.temperature``, if given, must be
    (:class:`~featstore.SourceMismatch` otherwise, naming both); ``how.temperature`` or 1 for a
    batch that does not say (another collator's)."""
    stored = batch.get(TEMPERATURE)
    found = [] if stored is None else sorted({float(t) for t in torch.as_tensor(stored).reshape(-1).tolist()})
    if len(found) > 1:
        raise SourceMismatch(f"the batch mixes soft labels stored at temperatures {found}; distil each version's "
                             "samples in batches of their own.")
    if not found:
        return 1.0 if how.temperature is None else float(how.temperature)
    if how.temperature is not None and not math.isclose(how.temperature, found[0], rel_tol=1e-6):
        raise SourceMismatch(f"the batch's soft labels were stored at temperature {found[0]:g}, but "
                             f"Distillation(temperature={how.temperature:g}) asks to distil them at "
                             f"{how.temperature:g}: the teacher's log-probs describe another distribution. "
                             f"Leave Distillation's temperature unset (it takes the stored {found[0]:g}), or "
                             f"recompute the soft labels at {how.temperature:g} (a codec such as "
                             f"'topkq:50@{how.temperature:g}').")
    return found[0]


def topk_kd_loss(logits: torch.Tensor, batch: Mapping[str, torch.Tensor], how: Distillation,
                 logq: torch.Tensor | None = None) -> torch.Tensor:
    """The distillation term alone: the student's ``logits [B, L, V]`` against the batch's
    ``target_*`` columns, averaged over the real positions (``target_mask``), at the
    temperature :func:`temperature_of` resolves. ``logq``: ``log_softmax(logits / temperature)``
    where the caller has it already."""
    t = temperature_of(how, batch)
    mask = batch["target_mask"]
    real = mask[..., 0] > 0
    kept = mask[real] > 0
    ids = torch.where(kept, batch["target_token_ids"][real], -1)
    logp = torch.where(kept, batch["target_logprobs"][real].float(), -math.inf)
    if logq is None:
        logq = torch.log_softmax(logits[:, :real.shape[1]].float() / t, dim=-1)
    kl = kd.sparse_kl(logq[:, :real.shape[1]][real], ids, logp, rule=how.rule, direction=how.direction)
    return kl.mean() * t ** 2


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

    The temperature is the one the soft labels were stored at, which the batch carries
    (``target_temperature``); ``how.temperature``, if given, must be that one
    (:class:`~featstore.SourceMismatch` otherwise, naming both).

    The model runs on ``input_ids`` and ``attention_mask`` (its own loss is not computed). KD is
    averaged over the real positions, the LM cross-entropy (on ``labels``, as transformers
    computes it, ``num_items_in_batch`` included) over the predicted tokens. The forward KL is
    computed with the cross-entropy in one pass over the logits
    (:class:`~featstore.distill._fused.FusedKD`), so distilling costs about what the LM loss does.
    """
    missing = [k for k in TARGETS if k not in inputs]
    if missing:
        raise InvalidInput(f"the batch has no {missing} (keys: {sorted(inputs)}): build it with "
                           "featstore.hf.DistillCollator over featstore.hf.SoftLabels samples.")
    how = how or Distillation()
    t = temperature_of(how, inputs)  # before the forward: a refusal costs nothing
    batch = {k: v for k, v in inputs.items() if k not in (*_NOT_FOR_THE_MODEL, "labels")}
    outputs = model(**batch)
    logits = outputs.logits.float()
    if how.direction == "forward":
        loss = _fused_loss(logits, inputs, how, t, num_items_in_batch)
    else:
        logq = torch.log_softmax(logits / t, dim=-1)
        loss = topk_kd_loss(logits, inputs, how, logq)
        if how.alpha < 1.0:
            lm_logq = logq if t == 1.0 else torch.log_softmax(logits, dim=-1)
            loss = how.alpha * loss + (1.0 - how.alpha) * lm_loss(lm_logq, inputs["labels"], num_items_in_batch)
    return (loss, outputs) if return_outputs else loss


def _fused_loss(logits: torch.Tensor, inputs: Mapping[str, Any], how: Distillation, t: float,
                num_items_in_batch: Any) -> torch.Tensor:
    """The forward-KL loss at temperature ``t`` through :class:`FusedKD`: the batch's columns as
    its rows and weights."""
    b, length, vocab = logits.shape
    mask = inputs["target_mask"][:, :length]
    real = mask[..., 0] > 0
    kept = (mask > 0) & real.unsqueeze(-1)
    k = mask.shape[-1]
    ids = torch.where(kept, inputs["target_token_ids"][:, :length], -1).reshape(-1, k)
    logp = torch.where(kept, inputs["target_logprobs"][:, :length].float(), -math.inf).reshape(-1, k)
    w, tail = sparse_weights(ids, logp, None, vocab, how.rule)
    kd_coef = real.reshape(-1).float() * (how.alpha * t ** 2 / real.sum().clamp(min=1))
    target = torch.nn.functional.pad(inputs["labels"][:, 1:length], (0, 1), value=-100).reshape(-1)
    predicted = target != -100
    count = predicted.sum().clamp(min=1) if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
    lm_coef = predicted.float() * ((1.0 - how.alpha) / count.to(torch.float32))
    loss: torch.Tensor = FusedKD.apply(logits.reshape(-1, vocab), ids.clamp(min=0), ids >= 0, w, tail, kd_coef,
                                       target.clamp(min=0), lm_coef, t)  # torch's Function.apply: untyped
    return loss
