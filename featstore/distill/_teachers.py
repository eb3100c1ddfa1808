"""One teacher's output in a batch as rows of a distribution (pure torch): its stored form, the
reconstruction rule, which rows are padding, and the KL to a student in closed form.

:mod:`featstore.kd` (one teacher) and :mod:`featstore.distill` (several) are built on this.
A row is one distribution over ``C`` classes: a batch's output ``[B, ..., C]`` (dense) or
``[B, ..., K]`` (sparse parts) is read as ``[R, ...]`` rows, ``R`` the product of its leading
dimensions. :class:`TeacherRows` holds the rows either dense (``probs [R, C]``) or sparse
(``ids [R, K]``, ``-1`` in unused slots; ``probs [R, K]``, 0 in unused slots; ``tail [R]``,
the probability of every class not in ``ids``), and never builds ``[R, C]`` for sparse rows
unless :meth:`TeacherRows.dense` is asked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from featstore.errors import InvalidInput
from featstore.codecs import RULES, sparse_weights

#: How a batch carries an output: dense logits, sparse parts (top-k / top-p), sampled ids with counts.
FORMS = ("dense", "sparse", "sample")


def output_form(batch: Mapping[str, torch.Tensor], name: str) -> str:
    """``"dense"``, ``"sparse"`` or ``"sample"``: how ``batch`` carries output ``name``."""
    if f"{name}.ids" in batch and f"{name}.values" in batch:
        return "sample" if f"{name}.counts" in batch else "sparse"
    if name in batch:
        return "dense"
    raise InvalidInput(f"the batch has no output {name!r} (keys: {sorted(batch)}); read the version "
                       f"with its '{name}' arrays (for a sparse output: '{name}.ids' and '{name}.values').")


def check_temperature(temperature: float) -> float:
    """``temperature`` as a float, or :class:`InvalidInput` unless it is finite and > 0."""
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        t = math.nan
    if not (math.isfinite(t) and t > 0):
        raise InvalidInput(f"temperature must be a finite number > 0, got {temperature!r}.")
    return t


def check_rule(form: str, rule: str | None) -> str:
    """The reconstruction rule of a sparse output: ``rule``, or the form's default."""
    rule = rule or ("counts" if form == "sample" else "uniform_tail")
    if rule not in RULES or (rule == "counts") != (form == "sample"):
        raise InvalidInput(f"rule {rule!r} does not apply to a {form} output; use "
                           f"{'counts' if form == 'sample' else 'uniform_tail or renormalize'}.")
    return rule


def lead_shape(batch: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """The leading shape of output ``name`` (everything but the class / slot axis)."""
    key = name if output_form(batch, name) == "dense" else f"{name}.ids"
    return tuple(batch[key].shape[:-1])


def sparse_parts(batch: Mapping[str, torch.Tensor], name: str,
                 classes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows of a sparse output: ids ``[R, K]`` (-1 unused), stored log-probs (-inf unused), counts."""
    ids = batch[f"{name}.ids"]
    ids = ids.reshape(-1, ids.shape[-1]).long()
    if bool((ids >= classes).any()):
        raise InvalidInput(f"{name}.ids holds class ids up to {int(ids.max())}, but num_classes is {classes}.")
    kept = ids >= 0
    values = batch[f"{name}.values"]
    if tuple(values.shape) != tuple(batch[f"{name}.ids"].shape):
        raise InvalidInput(f"{name}.values has shape {tuple(values.shape)}, {name}.ids "
                           f"{tuple(batch[f'{name}.ids'].shape)}: pass the parts of one batch.")
    logp = values.reshape(ids.shape).float().masked_fill(~kept, -math.inf)
    counts = batch.get(f"{name}.counts")
    counts = None if counts is None else counts.reshape(ids.shape).float() * kept
    return ids, logp, counts


def real_rows(batch: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """Which rows of output ``name`` are real tokens, ``[R]`` bool, for a per-token output read
    with ``ragged="padded"`` (``[B, L, ...]`` plus ``"<name>.lengths"``); None: every row is."""
    lengths = batch.get(f"{name}.lengths")
    if lengths is None:
        return None
    lead = lead_shape(batch, name)
    if len(lead) < 2 or tuple(lengths.shape) != lead[:1]:
        raise InvalidInput(f"{name}.lengths has shape {tuple(lengths.shape)}, but {name} is {list(lead)} "
                           f"rows: a padded per-token output is [B, L, ...] with lengths [B].")
    mask = torch.arange(lead[1]).unsqueeze(0) < lengths.long().unsqueeze(1)
    return mask.reshape(*mask.shape, *([1] * (len(lead) - 2))).expand(lead).reshape(-1)


def row_mean(values: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """The mean of per-row ``values`` over the real rows (all rows when ``real`` is None)."""
    if real is None:
        return values.mean()
    return (values * real).sum() / real.sum().clamp(min=1)


def kl_rows(logq: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, tail: torch.Tensor,
            logw: torch.Tensor | None = None) -> torch.Tensor:
    """Per row, ``sum_c p(c) (log p(c) - log q(c))`` for a sparse teacher ``p``: ``w`` on ``ids``
    (0 in unused slots), ``tail`` on each of the other classes, never a dense ``[R, C]`` teacher.

    ``logw``: the log-probabilities to use for the teacher's own ``log p`` on the kept slots
    (the stored ones); None: ``log w``. The tail term is closed form: the ``C - kept`` other
    classes contribute ``(C - kept) * tail * log(tail) - tail * sum_rest log q``.
    """
    kept = ids >= 0
    q_kept = torch.gather(logq, 1, ids.clamp(min=0)).masked_fill(~kept, 0)
    own = torch.xlogy(w, w) if logw is None else torch.where(w > 0, w * logw, torch.zeros_like(w))
    kl = (own - w * q_kept).sum(-1)
    n_rest = logq.shape[-1] - kept.sum(-1)
    rest_logq = logq.sum(-1) - q_kept.sum(-1)
    has_tail = (tail > 0) & (n_rest > 0)
    tail_kl = n_rest * torch.xlogy(tail, tail) - tail * rest_logq
    return kl + torch.where(has_tail, tail_kl, torch.zeros_like(tail_kl))


def reverse_kl_rows(logq: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """Per row, ``KL(q || p)`` (the student's mass against the teacher's) for a sparse teacher
    ``p``: ``w`` on ``ids`` (0 in unused slots), ``tail`` on each other class. A row without a
    tail (the ``renormalize`` rule, or no mass left) gives the other classes probability 0, where
    ``KL(q || p)`` is infinite: there the student is renormalised over the kept classes (as
    top-k distillation losses do), ``sum_kept q' (log q' - log p)``."""
    kept = ids >= 0
    lq_kept = torch.gather(logq, 1, ids.clamp(min=0)).masked_fill(~kept, -math.inf)
    logw = torch.where(kept & (w > 0), torch.log(w.clamp(min=1e-30)), torch.zeros_like(w))
    q_kept = lq_kept.exp()
    rest = (1.0 - q_kept.sum(-1)).clamp(min=0)
    with_tail = (logq.exp() * logq).sum(-1) - (q_kept * logw).sum(-1) - rest * torch.log(tail.clamp(min=1e-30))
    lq_r = lq_kept - torch.logsumexp(lq_kept, -1, keepdim=True)
    renormalised = (lq_r.exp() * (lq_r.masked_fill(~kept, 0) - logw)).sum(-1)
    return torch.where(tail > 0, with_tail, renormalised)


@dataclass(frozen=True)
class SparseSlots:
    """The sparse side of :class:`TeacherRows`, both parts present: ``ids [R, K]`` (``-1`` in
    unused slots) and ``tail [R]``."""

    ids: torch.Tensor
    tail: torch.Tensor


@dataclass(frozen=True)
class TeacherRows:
    """One teacher's distribution on each of a batch's ``R`` rows: what an ensemble combines and
    what a ``select`` rule of :func:`featstore.kd.ensemble` is given.

    Attributes:
        name: the output it was read from (``"a/logits"``), or a description for an ensemble.
        classes: ``C``, the number of classes.
        probs: dense ``[R, C]`` probabilities, or sparse ``[R, K]``: the probability of each
            slot's class (0 in unused slots).
        ids: sparse only: ``[R, K]`` class ids, ``-1`` in unused slots; None when dense.
        tail: sparse only: ``[R]``, the probability of every class not in ``ids`` (0 for the
            ``renormalize`` and ``counts`` rules); None when dense.

    >>> rows = TeacherRows("t", 4, torch.tensor([[0.75, 0.125, 0.0]]), torch.tensor([[2, 0, -1]]),
    ...                    torch.tensor([0.0625]))
    >>> rows.dense().tolist(), rows.prob(torch.tensor([1])).tolist(), rows.max_prob().tolist()
    ([[0.125, 0.0625, 0.75, 0.0625]], [0.0625], [0.75])
    """

    name: str
    classes: int
    probs: torch.Tensor
    ids: torch.Tensor | None = None
    tail: torch.Tensor | None = None

    @property
    def sparse(self) -> bool:
        """Whether the rows are held sparse (``ids`` + ``probs`` + ``tail``)."""
        return self.ids is not None

    @property
    def rows(self) -> int:
        """``R``, the number of rows."""
        return self.probs.shape[0]

    def _slots(self) -> SparseSlots | None:
        """``ids`` and ``tail`` together when the rows are sparse; None when dense."""
        if self.ids is None:
            return None
        if self.tail is None:
            raise InvalidInput(f"TeacherRows {self.name!r} has ids but no tail: sparse rows take both "
                               "(tail [R]: the probability of each class not in ids, 0 if none).")
        return SparseSlots(self.ids, self.tail)

    def dense(self) -> torch.Tensor:
        """The rows as dense ``[R, C]`` probabilities (builds ``[R, C]``: for sparse rows, only
        when you want it)."""
        s = self._slots()
        if s is None:
            return self.probs
        kept = s.ids >= 0
        dense = s.tail[:, None].repeat(1, self.classes)
        rows = torch.arange(self.rows)[:, None].expand_as(s.ids)
        dense[rows[kept], s.ids[kept]] = self.probs[kept]
        return dense

    def prob(self, classes: torch.Tensor) -> torch.Tensor:
        """``[R]``: each row's probability of ``classes[r]`` (e.g. the true label)."""
        c = classes.reshape(-1).long()
        if c.shape[0] != self.rows or bool(((c < 0) | (c >= self.classes)).any()):
            raise InvalidInput(f"prob() takes one class id in [0, {self.classes}) per row ({self.rows} rows), "
                               f"got shape {tuple(classes.shape)}.")
        s = self._slots()
        if s is None:
            return self.probs.gather(1, c[:, None])[:, 0]
        hit = s.ids == c[:, None]
        return torch.where(hit.any(-1), (self.probs * hit).sum(-1), s.tail)

    def max_prob(self) -> torch.Tensor:
        """``[R]``: each row's largest class probability (its confidence)."""
        s = self._slots()
        if s is None:
            return self.probs.amax(-1)
        kept = self.probs.amax(-1) if self.probs.shape[-1] else torch.zeros(self.rows)
        rest = self.classes - (s.ids >= 0).sum(-1)  # classes not in a slot: they hold the tail
        return torch.maximum(kept, torch.where(rest > 0, s.tail, torch.zeros_like(s.tail)))

    def argmax(self) -> torch.Tensor:
        """``[R]``: each row's most probable class (sparse: the most probable kept class, -1 for
        a row with none kept)."""
        if self.ids is None:
            return self.probs.argmax(-1)
        if not self.probs.shape[-1]:
            return torch.full((self.rows,), -1)
        return self.ids.gather(1, self.probs.argmax(-1, keepdim=True))[:, 0]

    def kl(self, logq: torch.Tensor) -> torch.Tensor:
        """Per row, ``KL(these rows || q)`` for student log-probabilities ``logq [R, C]``."""
        s = self._slots()
        if s is None:
            return (torch.xlogy(self.probs, self.probs) - self.probs * logq).sum(-1)
        return kl_rows(logq, s.ids, self.probs, s.tail)


def sparse_slots(teachers: Sequence[TeacherRows]) -> list[SparseSlots]:
    """Each of ``teachers``' sparse side, in order: :class:`InvalidInput` if one is dense (the
    sparse ensemble takes sparse teachers only)."""
    out = []
    for t in teachers:
        s = t._slots()
        if s is None:
            raise InvalidInput(f"teacher {t.name!r} is dense; a sparse ensemble takes sparse teachers only "
                               "(read their sparse parts, or combine dense teachers with combined()).")
        out.append(s)
    return out


def read_rows(batch: Mapping[str, torch.Tensor], name: str, classes: int, *, rule: str | None = None,
              temperature: float = 1.0, label: str | None = None) -> TeacherRows:
    """Output ``name`` of ``batch`` as :class:`TeacherRows`: dense logits as
    ``softmax(logits / temperature)``, sparse parts by their reconstruction ``rule``."""
    form = output_form(batch, name)
    label = label or name
    if form == "dense":
        logits = batch[name]
        if logits.shape[-1] != classes:
            raise InvalidInput(f"{label} has {logits.shape[-1]} classes, but num_classes is {classes}.")
        t = check_temperature(temperature)
        return TeacherRows(label, classes, torch.softmax(logits.float().reshape(-1, classes) / t, dim=-1))
    ids, logp, counts = sparse_parts(batch, name, classes)
    w, tail = sparse_weights(ids, logp, counts, classes, check_rule(form, rule))
    return TeacherRows(label, classes, w, ids, tail)
