"""Distillation helpers on stored soft labels: densify a batch's teacher distribution, and a KD
loss computed straight from the sparse form.

A batch carries an output stored dense (``float32``/``float16``/``bfloat16``/``int8``) as one
tensor ``batch[name]`` of teacher logits, and a sparse one (``topk``, ``topp``, ``sample``) as
``batch[name + ".ids"]`` (int64, ``-1`` in unused slots), ``batch[name + ".values"]`` (float16
teacher log-probabilities at the temperature recorded in the manifest, ``-inf`` in unused slots)
and, for ``sample``, ``batch[name + ".counts"]`` (0 in unused slots).

The teacher side of a sparse output is the distribution as stored, at the temperature chosen at
compute time (``topk:10@4``: log-probabilities at T=4); the student side is at ``temperature``.
Dense stored logits are divided by ``temperature`` like the student's (classic KD).

>>> loss = kd_loss(student(x), batch, "logits", temperature=1.0)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .errors import InvalidInput
from .partcodecs import RULES, reconstruct, sparse_weights


def _form(batch: Mapping[str, torch.Tensor], name: str) -> str:
    if f"{name}.ids" in batch and f"{name}.values" in batch:
        return "sample" if f"{name}.counts" in batch else "sparse"
    if name in batch:
        return "dense"
    raise InvalidInput(f"the batch has no output {name!r} (keys: {sorted(batch)}); read the version "
                       f"with its '{name}' arrays (for a sparse output: '{name}.ids' and '{name}.values').")


def _check_temperature(temperature: float) -> float:
    t = float(temperature)
    if not (math.isfinite(t) and t > 0):
        raise InvalidInput(f"temperature must be a finite number > 0, got {temperature!r}.")
    return t


def _rule(form: str, rule: str | None) -> str:
    rule = rule or ("counts" if form == "sample" else "uniform_tail")
    if rule not in RULES or (rule == "counts") != (form == "sample"):
        raise InvalidInput(f"rule {rule!r} does not apply to a {form} output; use "
                           f"{'counts' if form == 'sample' else 'uniform_tail or renormalize'}.")
    return rule


def _sparse(batch: Mapping[str, torch.Tensor], name: str, classes: int) -> tuple[torch.Tensor, ...]:
    """Rows of a sparse output: ids ``[rows, slots]`` (-1 unused), log-probs (-inf unused), counts."""
    ids = batch[f"{name}.ids"]
    ids = ids.reshape(-1, ids.shape[-1]).long()
    if bool((ids >= classes).any()):
        raise InvalidInput(f"{name}.ids holds class ids up to {int(ids.max())}, but num_classes is {classes}.")
    kept = ids >= 0
    logp = batch[f"{name}.values"].reshape(ids.shape).float().masked_fill(~kept, -math.inf)
    counts = batch.get(f"{name}.counts")
    counts = None if counts is None else counts.reshape(ids.shape).float() * kept
    return ids, logp, counts


def densify(batch: Mapping[str, torch.Tensor], name: str, num_classes: int, *, rule: str | None = None,
            temperature: float = 1.0) -> torch.Tensor:
    """The teacher distribution of output ``name`` as dense float32 probabilities ``[..., C]``.

    Sparse outputs are rebuilt by ``rule`` (default: ``uniform_tail`` for top-k/top-p, the
    remaining mass spread evenly over the classes not kept; ``counts`` for sample, ``counts / S``
    on the drawn ids; ``renormalize``: the kept probabilities scaled to sum to 1). Dense stored
    logits give ``softmax(logits / temperature)``.

    >>> densify(batch, "logits", 1000).sum(-1)  # tensor([1., 1., ...])
    """
    form = _form(batch, name)
    if form == "dense":
        t = _check_temperature(temperature)
        return torch.softmax(batch[name].float() / t, dim=-1)
    rule = _rule(form, rule)
    lead = batch[f"{name}.ids"].shape[:-1]
    dense = reconstruct(*_sparse(batch, name, num_classes), num_classes, rule)
    return dense.reshape(*lead, num_classes)


def kd_loss(student_logits: torch.Tensor, batch: Mapping[str, torch.Tensor], name: str,
            temperature: float = 1.0, *, rule: str | None = None) -> torch.Tensor:
    """``KL(teacher || student at temperature) * temperature**2``, averaged over rows.

    Works on the sparse form directly (top-k/top-p: the kept classes plus the uniform tail, in
    closed form; sample: the unbiased estimate ``sum counts/S * (log p - log q)``), so no dense
    ``[B, C]`` teacher tensor is built; and on dense stored logits (softmax at ``temperature``).
    ``student_logits``: ``[..., C]`` matching the stored output's leading shape.

    >>> loss = kd_loss(student(x), batch, "logits", temperature=2.0)
    >>> loss.backward()
    """
    t = _check_temperature(temperature)
    classes = student_logits.shape[-1]
    logq = torch.log_softmax(student_logits.float().reshape(-1, classes) / t, dim=-1)
    form = _form(batch, name)
    if form == "dense":
        teacher = batch[name].float().reshape(-1, classes)
        logp = torch.log_softmax(teacher / t, dim=-1)
        return (logp.exp() * (logp - logq)).sum(-1).mean() * t * t
    ids, logp, counts = _sparse(batch, name, classes)
    if ids.shape[0] != logq.shape[0]:
        raise InvalidInput(f"student_logits has {logq.shape[0]} rows, {name!r} has {ids.shape[0]}.")
    return _sparse_kl(logq, ids, logp, counts, _rule(form, rule)).mean() * t * t


def _sparse_kl(logq: torch.Tensor, ids: torch.Tensor, logp: torch.Tensor, counts: torch.Tensor | None,
               rule: str) -> torch.Tensor:
    """Per row, KL(teacher rebuilt by ``rule`` || student) from the kept slots and a closed form
    for the tail, never a dense teacher tensor."""
    kept = ids >= 0
    w, tail = sparse_weights(ids, logp, counts, logq.shape[-1], rule)
    q_kept = torch.gather(logq, 1, ids.clamp(min=0)).masked_fill(~kept, 0)
    if rule == "renormalize":
        logp = torch.log(w.clamp(min=1e-30))
    kl = (w * (logp.masked_fill(~kept, 0) - q_kept)).sum(-1)
    if rule == "counts":
        # unbiased: E[sum_i counts_i/S * f(i)] = sum_i p_i f(i) for f = log p - log q
        return kl
    # every class not kept has probability `tail`: sum_rest tail * (log tail - log q)
    rest_logq = logq.sum(-1) - q_kept.sum(-1)
    n_rest = logq.shape[-1] - kept.sum(-1)
    return kl + torch.where(tail > 0, n_rest * tail * torch.log(tail.clamp(min=1e-30)) - tail * rest_logq,
                            torch.zeros_like(tail))
