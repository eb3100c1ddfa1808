"""Distillation helpers on stored soft labels: densify a batch's teacher distribution, a KD loss
computed straight from the sparse form, and ensembles of several teachers.

A batch carries an output stored dense (``float32``/``float16``/``bfloat16``/``int8``) as one
tensor ``batch[name]`` of teacher logits, and a sparse one (``topk``, ``topp``, ``sample``) as
``batch[name + ".ids"]`` (int64, ``-1`` in unused slots), ``batch[name + ".values"]`` (float16
teacher log-probabilities at the temperature recorded in the manifest, ``-inf`` in unused slots)
and, for ``sample``, ``batch[name + ".counts"]`` (0 in unused slots).

The teacher side of a sparse output is the distribution as stored, at the temperature chosen at
compute time (``topk:10@4``: log-probabilities at T=4); the student side is at ``temperature``.
Dense stored logits are divided by ``temperature`` like the student's (classic KD). A per-token
output read with ``ragged="padded"`` (``[B, L, ...]`` plus ``"<name>.lengths"``) has padding
rows: the loss is averaged over the real tokens only.

Several teachers (:func:`ensemble`, from :mod:`featstore.distill`): their outputs for the same
rows, as a mean or weighted mean of probabilities or a per-row selection; ``kd_loss`` and
``densify`` take the ensemble in place of a batch, and sparse teachers stay sparse (the union of
their supports plus one uniform tail, exactly).

>>> loss = kd_loss(student(x), batch, "logits", temperature=1.0)
>>> loss = kd_loss(student(x), ensemble(batch, ["a/logits", "b/logits"]), temperature=2.0)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from featstore.distill import Ensemble, Member, ensemble, most_confident
from featstore.errors import InvalidInput
from featstore.codecs import sparse_weights
from featstore.distill import (TeacherRows, check_rule, check_temperature, kl_rows, output_form, read_rows, real_rows,
                               reverse_kl_rows, row_mean, sparse_parts)

__all__ = ["DIRECTIONS", "Ensemble", "Member", "TeacherRows", "densify", "ensemble", "kd_loss", "most_confident",
           "sparse_kl"]


def __getattr__(name: str) -> object:
    if name == "Teacher":  # one name, one class: featstore.Teacher is the teacher in the loop
        warnings.warn("featstore.kd.Teacher is now featstore.kd.Member (one teacher of an ensemble); "
                      "featstore.Teacher is Model A in the training loop.", DeprecationWarning, stacklevel=2)
        return Member
    raise AttributeError(f"module 'featstore.kd' has no attribute {name!r}")


def _ensemble_args(what: str, name: object, rule: str | None) -> None:
    if name is not None or rule is not None:
        hint = "temperature=..." if isinstance(name, int | float) else "rules= in ensemble()"
        raise InvalidInput(f"{what}(..., ensemble) takes no output name or rule: the ensemble names its "
                           f"teachers; pass {hint} by keyword.")


def densify(batch: Mapping[str, torch.Tensor] | Ensemble, name: str | None = None, num_classes: int | None = None,
            *, rule: str | None = None, temperature: float = 1.0) -> torch.Tensor:
    """The teacher distribution of output ``name`` as dense float32 probabilities ``[..., C]``.

    Sparse outputs are rebuilt by ``rule`` (default: ``uniform_tail`` for top-k/top-p, the
    remaining mass spread evenly over the classes not kept; ``counts`` for sample, ``counts / S``
    on the drawn ids; ``renormalize``: the kept probabilities scaled to sum to 1). Dense stored
    logits give ``softmax(logits / temperature)``. An :class:`Ensemble` in place of ``batch``
    gives the ensemble's distribution (``densify(ens, num_classes=C)``).

    >>> densify(batch, "logits", 1000).sum(-1)  # tensor([1., 1., ...])
    """
    if isinstance(batch, Ensemble):
        _ensemble_args("densify", name, rule)
        if num_classes is None:
            raise InvalidInput("densify(ensemble, num_classes=C): give the number of classes.")
        return batch.densify(num_classes, temperature)
    if name is None or num_classes is None:
        raise InvalidInput("densify(batch, name, num_classes): name the output and give the number of classes.")
    lead = batch[name].shape[:-1] if output_form(batch, name) == "dense" else batch[f"{name}.ids"].shape[:-1]
    rows = read_rows(batch, name, num_classes, rule=rule, temperature=temperature)
    return rows.dense().reshape(*lead, num_classes)


#: ``kd_loss``'s directions: ``KL(teacher || student)`` (mass-covering) or ``KL(student || teacher)``.
DIRECTIONS = ("forward", "reverse")


def kd_loss(student_logits: torch.Tensor, batch: Mapping[str, torch.Tensor] | Ensemble, name: str | None = None,
            temperature: float = 1.0, *, rule: str | None = None, direction: str = "forward") -> torch.Tensor:
    """``KL(teacher || student at temperature) * temperature**2``, averaged over rows
    (``direction="reverse"``: ``KL(student || teacher)``, mode-seeking).

    Works on the sparse form directly (top-k/top-p: the kept classes plus the uniform tail, in
    closed form; sample: the unbiased estimate ``sum counts/S * (log p - log q)``), so no dense
    ``[B, C]`` teacher tensor is built; and on dense stored logits (softmax at ``temperature``).
    ``student_logits``: ``[..., C]`` matching the stored output's leading shape. Padding rows of
    a per-token output read with ``ragged="padded"`` are left out of the average. An
    :class:`Ensemble` in place of ``batch`` distils from the ensemble (sparse teachers: over the
    union of their supports plus one tail term per row, never ``[B, C]``).

    The reverse direction needs the teacher's probability of every class: a top-k/top-p
    teacher's tail gives it (under ``renormalize``, which has none, the student is renormalised
    over the kept classes); a ``sample`` teacher and an ensemble are refused.

    >>> loss = kd_loss(student(x), batch, "logits", temperature=2.0)
    >>> loss = kd_loss(student(x), ensemble(batch, ["a/logits", "b/logits"]), temperature=2.0)
    >>> loss.backward()
    """
    if direction not in DIRECTIONS:
        raise InvalidInput(f"direction must be one of {DIRECTIONS}, got {direction!r}.")
    if isinstance(batch, Ensemble):
        _ensemble_args("kd_loss", name, rule)
        if direction != "forward":
            raise InvalidInput("kd_loss(ensemble) distils forward only (KL(teacher || student)); drop direction=.")
        return batch.kd_loss(student_logits, temperature)
    if name is None:
        raise InvalidInput("kd_loss(student_logits, batch, name): name the teacher's output in the batch.")
    t = check_temperature(temperature)
    classes = student_logits.shape[-1]
    logq = torch.log_softmax(student_logits.float().reshape(-1, classes) / t, dim=-1)
    form = output_form(batch, name)
    if form == "dense":
        teacher = batch[name].float()
        if teacher.shape[-1] != classes or teacher.numel() // classes != logq.shape[0]:
            raise InvalidInput(f"student_logits is {list(student_logits.shape)}, {name!r} is "
                               f"{list(teacher.shape)}: pass the student's logits of the same rows and classes.")
        logp = torch.log_softmax(teacher.reshape(-1, classes) / t, dim=-1)
        kl = (logp.exp() * (logp - logq)).sum(-1) if direction == "forward" else (logq.exp() * (logq - logp)).sum(-1)
    else:
        ids, logp, counts = sparse_parts(batch, name, classes)
        if ids.shape[0] != logq.shape[0]:
            raise InvalidInput(f"student_logits has {logq.shape[0]} rows, {name!r} has {ids.shape[0]}.")
        kl = sparse_kl(logq, ids, logp, counts, rule=check_rule(form, rule), direction=direction)
    return row_mean(kl, real_rows(batch, name)) * t * t


def sparse_kl(logq: torch.Tensor, ids: torch.Tensor, logp: torch.Tensor, counts: torch.Tensor | None = None, *,
              rule: str = "uniform_tail", direction: str = "forward") -> torch.Tensor:
    """Per row, the KL between a sparse teacher (``ids [R, K]``, ``-1`` unused; its stored
    log-probabilities ``logp``, ``-inf`` unused; ``counts`` of a sample) rebuilt by ``rule`` and
    a student's log-probabilities ``logq [R, C]``, in ``direction``, never building a dense
    teacher: what :func:`kd_loss` averages, for a caller that has ``logq`` already (a language
    model's loss shares one ``log_softmax`` with its cross-entropy)."""
    if direction == "forward":
        return _sparse_kl(logq, ids, logp, counts, rule)
    if rule == "counts":
        raise InvalidInput("a sample: output holds drawn ids and counts: the reverse KL needs the teacher's "
                           "probability of every class; distil it forward.")
    return reverse_kl_rows(logq, ids, *sparse_weights(ids, logp, None, logq.shape[-1], rule))


def _sparse_kl(logq: torch.Tensor, ids: torch.Tensor, logp: torch.Tensor, counts: torch.Tensor | None,
               rule: str) -> torch.Tensor:
    """Per row, KL(teacher rebuilt by ``rule`` || student) from the kept slots and a closed form
    for the tail, never a dense teacher tensor. ``counts``: unbiased, since
    ``E[sum_i counts_i/S * f(i)] = sum_i p_i f(i)`` for ``f = log p - log q`` (stored ``log p``)."""
    w, tail = sparse_weights(ids, logp, counts, logq.shape[-1], rule)
    return kl_rows(logq, ids, w, tail, None if rule == "renormalize" else logp)
