"""Ensembles of teachers for distillation (pure torch): several teachers' outputs for the same
rows, combined as an average of probabilities, a weighted average, or a per-row selection.

Each teacher's distribution is first rebuilt by its own rule, exactly as
:func:`featstore.kd.densify` rebuilds it alone: dense logits as ``softmax(logits / T)``; top-k /
top-p parts by ``uniform_tail`` (the kept probabilities as stored plus the missing mass spread
evenly over the other classes) or ``renormalize``; sample parts by ``counts`` (``counts / S``).
Then the rebuilt distributions are mixed. A sparse teacher ``i`` is, per row, probabilities
``v_i(c)`` on its kept set ``S_i`` and one tail value ``t_i`` on every other class (``t_i = 0``
for ``renormalize`` and ``counts``). With mixing weights ``a_i`` (``1/n`` for the mean; given and
normalised to sum 1 for the weighted mean) the ensemble is

    P(c) = sum_i a_i * (v_i(c) if c in S_i else t_i)

and every class outside the union ``U = S_1 | ... | S_n`` gets the same value
``T = sum_i a_i t_i``. So the mixture is **exactly** a sparse distribution again: the values
``P(c)`` on ``U`` (at most ``sum_i K_i`` slots) plus the uniform tail ``T`` on the
``C - |U|`` other classes, whose mass is ``sum_i a_i (1 - sum_{S_i} v_i - (|U| - |S_i|) t_i)``:
what is left of each teacher's own tail after the union's classes took their share. No
approximation is involved and no ``[R, C]`` tensor is built (:meth:`Ensemble.sparse`). A
selection takes, per row, one teacher's rebuilt distribution as it is (its own support and tail).

``kd_loss`` against an ensemble is ``KL(P || softmax(student / T)) * T**2`` averaged over the
real rows, in closed form over the union's slots plus the tail term, like :func:`featstore.kd.kd_loss`
on one sparse output. One teacher's ensemble is that teacher alone: the same distribution, the
same loss and gradients, except for a ``sample`` output, whose loss alone is the unbiased
estimate ``sum counts/S * (log p - log q)`` with the stored log-probabilities ``log p``, while
an ensemble's teacher is ``P`` itself (``counts / S`` mixed: another teacher's probability of a
class this one drew is not stored); the two differ by a constant that does not depend on the
student, so the gradients are the same.

Temperatures: dense teachers are softmaxed at ``kd_loss``'s (or ``densify``'s) ``temperature``,
sparse ones are mixed as stored, at the temperature chosen at compute time (``topk:20@4``). A
batch does not record that temperature, so mixing a ``@4`` teacher with a ``@1`` one is allowed:
store teachers you mean to mix at one temperature.

>>> ens = ensemble(batch, ["a/logits", "b/logits"])               # mean of probabilities
>>> ens = ensemble(batch, ["a/logits", "b/logits"], how="weighted", weights=[3, 1])
>>> ens = ensemble(batch, ["a/logits", "b/logits"], how="select")  # most confident per row
>>> loss = kd_loss(student(x), ens, temperature=2.0)              # featstore.kd.kd_loss
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from featstore.errors import InvalidInput
from featstore.distill._teachers import (TeacherRows, check_rule, check_temperature, lead_shape, output_form, read_rows,
                                         real_rows, row_mean, sparse_slots)

HOWS = ("mean", "weighted", "select")
#: A per-row selection rule: the teachers' rows (in the ensemble's order) -> ``[R]`` teacher positions.
SelectRule = Callable[[Sequence[TeacherRows]], torch.Tensor]


def most_confident(teachers: Sequence[TeacherRows]) -> torch.Tensor:
    """``[R]``: per row, the position of the teacher whose largest class probability is the
    highest (the first such teacher on ties): ``how="select"``'s default rule.

    >>> ensemble(batch, ["a/logits", "b/logits"], how="select", select=most_confident)
    """
    return torch.stack([t.max_prob() for t in teachers]).argmax(0)


@dataclass(frozen=True)
class Member:
    """One member (teacher) of an ensemble: its label, the batch-like mapping holding its output, the
    output's name in it, and its reconstruction rule (None: the form's default)."""

    label: str
    batch: Mapping[str, torch.Tensor]
    name: str
    rule: str | None = None


@dataclass(frozen=True)
class Ensemble:
    """Several teachers' outputs for the same rows, and how to combine them (make one with
    :func:`ensemble`). :func:`featstore.kd.kd_loss` and :func:`featstore.kd.densify` take it in
    place of a batch; the methods below are the same operations.

    Attributes:
        teachers: the teachers, in order.
        how: ``"mean"``, ``"weighted"`` or ``"select"``.
        weights: the mixing weights, normalised to sum 1 (``1/n`` each for ``"mean"``; unused by
            ``"select"``).
        select: the per-row rule of ``"select"``.
    """

    teachers: tuple[Member, ...]
    how: str
    weights: tuple[float, ...]
    select: SelectRule | None = None

    @property
    def labels(self) -> tuple[str, ...]:
        """The teachers' labels, in order."""
        return tuple(t.label for t in self.teachers)

    @property
    def lead(self) -> tuple[int, ...]:
        """The leading shape of every teacher's output (``[B]``, or ``[B, L]`` per token)."""
        return lead_shape(self.teachers[0].batch, self.teachers[0].name)

    def rows(self, num_classes: int, temperature: float = 1.0) -> list[TeacherRows]:
        """Each teacher's rebuilt distribution, in order (dense teachers at ``temperature``)."""
        return [read_rows(t.batch, t.name, num_classes, rule=t.rule, temperature=temperature, label=t.label)
                for t in self.teachers]

    def choice(self, num_classes: int, temperature: float = 1.0) -> torch.Tensor:
        """``how="select"``: ``[R]`` int64, the position of the teacher chosen on each row."""
        if self.how != "select":
            raise InvalidInput(f"choice() is for how='select'; this ensemble is how={self.how!r}.")
        return self._choose(self.rows(num_classes, temperature))

    def combined(self, num_classes: int, temperature: float = 1.0) -> TeacherRows:
        """The ensemble's distribution per row: sparse when every teacher is sparse (the union
        of their supports plus a uniform tail, exact), dense ``[R, C]`` otherwise."""
        teachers = self.rows(num_classes, temperature)
        name = f"{self.how}({', '.join(self.labels)})"
        dense = not all(t.sparse for t in teachers)
        if self.how == "select":
            return _pick(name, teachers, self._choose(teachers), dense)
        if dense:
            mix = functools.reduce(torch.add, (a * t.dense() for a, t in zip(self.weights, teachers, strict=True)))
            return TeacherRows(name, num_classes, mix)
        return _union(name, teachers, self.weights)

    def sparse(self, num_classes: int, temperature: float = 1.0) -> TeacherRows:
        """The ensemble as sparse rows (``ids``, ``probs``, ``tail``), without any ``[R, C]``
        tensor; every teacher must be sparse.

        >>> rows = ensemble(batch, ["a/logits", "b/logits"]).sparse(32_000)
        >>> rows.ids.shape, rows.tail.shape   # [R, K_a + K_b] (-1 beyond the union), [R]
        """
        dense = [t.label for t in self.teachers if output_form(t.batch, t.name) == "dense"]
        if dense:
            raise InvalidInput(f"teacher(s) {dense} are dense logits, so the ensemble is dense: use densify().")
        return self.combined(num_classes, temperature)

    def densify(self, num_classes: int, temperature: float = 1.0) -> torch.Tensor:
        """The ensemble's distribution as dense float32 probabilities ``[*lead, C]``.

        >>> kd.densify(ens, num_classes=10).sum(-1)   # tensor([1., 1., ...])
        """
        return self.combined(num_classes, temperature).dense().reshape(*self.lead, num_classes)

    def kd_loss(self, student_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """``KL(ensemble || student at temperature) * temperature**2``, averaged over the real
        rows (padding rows of a per-token output read with ``ragged="padded"`` left out)."""
        t = check_temperature(temperature)
        classes = student_logits.shape[-1]
        logq = torch.log_softmax(student_logits.float().reshape(-1, classes) / t, dim=-1)
        rows = math.prod(self.lead)
        if logq.shape[0] != rows:
            raise InvalidInput(f"student_logits has {logq.shape[0]} rows ({list(student_logits.shape)}), the "
                               f"teachers have {rows} ({list(self.lead)}): pass the student's logits of the same rows.")
        return row_mean(self.combined(classes, t).kl(logq), self.real()) * t * t

    def real(self) -> torch.Tensor | None:
        """``[R]`` bool: the rows that are real tokens (None: all), from the teachers' lengths."""
        return _real_rows(self.teachers)

    def _choose(self, teachers: list[TeacherRows]) -> torch.Tensor:
        rule = self.select or most_confident
        with torch.no_grad():
            got = rule(teachers)
        rows, n = teachers[0].rows, len(teachers)
        ok = isinstance(got, torch.Tensor) and not got.is_floating_point() and got.dtype != torch.bool
        if not ok or got.numel() != rows or bool(((got < 0) | (got >= n)).any()):
            shown = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise InvalidInput(f"the select rule must return an integer tensor of {rows} teacher positions in "
                               f"[0, {n}) (one per row, in the order {list(self.labels)}), got {shown}.")
        return got.reshape(-1).long()


def _pick(name: str, teachers: list[TeacherRows], choice: torch.Tensor, dense: bool) -> TeacherRows:
    """Per row, the chosen teacher's distribution as it is."""
    classes, rows = teachers[0].classes, torch.arange(teachers[0].rows)
    if dense:  # one [R, C] result, filled teacher by teacher (not a stack of n of them)
        out = torch.empty(len(rows), classes)
        for i, t in enumerate(teachers):
            out[choice == i] = t.dense()[choice == i]
        return TeacherRows(name, classes, out)
    slots = sparse_slots(teachers)
    width = max(s.ids.shape[1] for s in slots)
    ids = torch.stack([F.pad(s.ids, (0, width - s.ids.shape[1]), value=-1) for s in slots])
    probs = torch.stack([F.pad(t.probs, (0, width - t.probs.shape[1])) for t in teachers])
    tail = torch.stack([s.tail for s in slots])
    return TeacherRows(name, classes, probs[choice, rows], ids[choice, rows], tail[choice, rows])


def _union(name: str, teachers: list[TeacherRows], weights: Sequence[float]) -> TeacherRows:
    """The weighted mixture of sparse teachers, exactly: ``P(c)`` on the union of their kept ids
    (``[R, sum K_i]`` slots, -1 beyond the union) plus the tail ``T = sum a_i t_i`` elsewhere."""
    n, classes = len(teachers), teachers[0].classes
    a = torch.tensor(weights, dtype=torch.float32)
    slots = sparse_slots(teachers)
    ids = torch.cat([s.ids for s in slots], 1)
    tags = torch.cat([torch.full_like(s.ids, i) for i, s in enumerate(slots)], 1)
    kept = ids >= 0
    # per slot: a_i v_i(c), and the a_i t_i that teacher i would have given c from its tail
    present = torch.cat([t.probs for t in teachers], 1) * a[tags] * kept
    own_tail = torch.cat([s.tail[:, None].expand_as(s.ids) for s in slots], 1) * a[tags] * kept
    tail = (a[:, None] * torch.stack([s.tail for s in slots])).sum(0)
    # sort by (class, teacher): one class's slots become adjacent, unused slots go last
    none = classes * n
    key, order = torch.where(kept, ids * n + tags, none).sort(1)
    valid = key < none
    prev = F.pad(key[:, :-1], (1, 0), value=-1)
    if bool((valid & (key == prev)).any()):
        raise InvalidInput("a teacher's row names one class id twice; pass the parts as the reader returns "
                           "them (unique ids per row, -1 in unused slots).")
    cls = torch.div(key, n, rounding_mode="floor")
    start = valid & (cls != torch.div(prev, n, rounding_mode="floor"))
    width = ids.shape[1]
    seg = torch.where(valid, start.cumsum(1) - 1, width)  # invalid slots land in a dropped column
    sums = torch.zeros(ids.shape[0], width + 1)
    mass = sums.scatter_add(1, seg, present.gather(1, order))[:, :width]
    covered = sums.scatter_add(1, seg, own_tail.gather(1, order))[:, :width]
    out_ids = torch.full((ids.shape[0], width + 1), -1, dtype=torch.long)
    out_ids = out_ids.scatter(1, seg, torch.where(valid, cls, -1))[:, :width]
    used = out_ids >= 0
    # P(c) = sum_{i: c in S_i} a_i v_i(c) + sum_{i: c not in S_i} a_i t_i  (>= 0: clamp the rounding)
    probs = torch.where(used, mass + (tail[:, None] - covered).clamp(min=0), torch.zeros_like(mass))
    return TeacherRows(name, classes, probs, out_ids, tail)


# -- building one --------------------------------------------------------------------------------
def _teachers(source: Any, names: Any) -> list[tuple[str, Mapping[str, torch.Tensor], str]]:
    """(label, batch, name) of each teacher from :func:`ensemble`'s three input layouts."""
    if isinstance(source, Mapping) and source and all(isinstance(v, Mapping) for v in source.values()):
        if not isinstance(names, str):
            raise InvalidInput("with a mapping teacher -> batch, name the output they share: "
                               "ensemble({'a': batch_a, 'b': batch_b}, 'logits').")
        return [(str(label), b, names) for label, b in source.items()]
    if isinstance(source, Mapping):
        if isinstance(names, str) or not isinstance(names, Sequence) or not names:
            raise InvalidInput("name the teachers' outputs in the batch as a list: "
                               "ensemble(batch, ['a/logits', 'b/logits']).")
        return [(str(n), source, str(n)) for n in names]
    if names is not None or not isinstance(source, Sequence) or not all(
            isinstance(p, Sequence) and len(p) == 2 and isinstance(p[0], Mapping) for p in source):
        raise InvalidInput("ensemble() takes a batch and a list of output names, a mapping teacher -> batch "
                           "and one output name, or a list of (batch, name) pairs.")
    labels = [str(n) for _, n in source]
    if len(set(labels)) < len(labels):
        labels = [f"{i}:{n}" for i, n in enumerate(labels)]
    return [(label, b, str(n)) for label, (b, n) in zip(labels, source, strict=True)]


def _per_teacher(value: Any, labels: Sequence[str], what: str) -> list[Any]:
    """``value`` (a mapping label -> x, or a sequence in teacher order) as a list in teacher order."""
    if isinstance(value, Mapping):
        unknown = sorted(set(map(str, value)) - set(labels))
        if unknown:
            raise InvalidInput(f"{what} names {unknown}, which are not teachers of this ensemble ({list(labels)}).")
        return [value.get(label) for label in labels]
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != len(labels):
        raise InvalidInput(f"{what} must be a mapping teacher -> value or a sequence of {len(labels)} "
                           f"(one per teacher: {list(labels)}), got {value!r}.")
    return list(value)


def _weights(how: str, weights: Any, labels: Sequence[str]) -> tuple[float, ...]:
    if how != "weighted":
        if weights is not None:
            raise InvalidInput(f"weights are for how='weighted' (this ensemble is how={how!r}): pass how='weighted'.")
        return tuple(1.0 / len(labels) for _ in labels)
    if weights is None:
        raise InvalidInput(f"how='weighted' needs weights=, one per teacher ({list(labels)}).")
    got = _per_teacher(weights, labels, "weights")
    try:
        w = [float(0.0 if x is None else x) for x in got]
    except (TypeError, ValueError):
        raise InvalidInput(f"weights must be numbers, got {got!r}.") from None
    if not all(math.isfinite(x) and x >= 0 for x in w) or sum(w) <= 0:
        raise InvalidInput(f"weights must be finite, >= 0 and sum to more than 0, got {w}; "
                           f"they are normalised to sum to 1.")
    return tuple(x / sum(w) for x in w)


def ensemble(source: Any, names: str | Sequence[str] | None = None, *, how: str = "mean",
             weights: Sequence[float] | Mapping[str, float] | None = None, select: SelectRule | None = None,
             rules: Sequence[str | None] | Mapping[str, str] | None = None) -> Ensemble:
    """Several teachers' outputs for the same rows, combined for :func:`featstore.kd.kd_loss`
    and :func:`featstore.kd.densify` (the maths: this module's docstring).

    Args:
        source: one batch holding every teacher's output under its own prefix (what a reader of
            several teachers yields: ``batch["a/logits"]``, ``batch["b/logits.ids"]``, ...) with
            ``names`` the outputs; or a mapping teacher -> batch with ``names`` the one output
            name they share; or a list of ``(batch, name)`` pairs (``names`` None).
        how: ``"mean"`` (average of probabilities), ``"weighted"`` (``weights``, normalised to
            sum 1) or ``"select"`` (per row one teacher: ``select(teachers) -> [R]`` positions,
            default :func:`most_confident`; each ``teachers[i]`` is a
            :class:`~featstore.distill.TeacherRows` with ``prob(labels)``, ``max_prob()``, ...;
            ``R`` rows are the outputs' leading dimensions flattened: ``B``, or ``B * L`` per token).
        weights: one per teacher, as a sequence in order or a mapping label -> weight.
        rules: per teacher, the reconstruction rule of a sparse output (``uniform_tail`` or
            ``renormalize`` for top-k/top-p, ``counts`` for sample); None: each form's default.

    Every teacher must have the same rows (leading shape, and lengths/offsets of per-token
    outputs); that is checked when the ensemble is used with a class count.

    >>> ens = ensemble(batch, ["a/logits", "b/logits"])
    >>> ens = ensemble({"a": batch_a, "b": batch_b}, "logits", how="weighted", weights={"a": 2, "b": 1})
    >>> right = lambda ts: torch.stack([t.prob(batch["target"]) for t in ts]).argmax(0)
    >>> ens = ensemble([(batch_a, "logits"), (batch_b, "logits")], how="select", select=right)
    >>> loss = kd.kd_loss(student(x), ens, temperature=2.0); loss.backward()
    """
    if how not in HOWS:
        raise InvalidInput(f"how must be one of {HOWS}, got {how!r}.")
    if select is not None and (how != "select" or not callable(select)):
        raise InvalidInput("select= is a callable teachers -> [R] positions, for how='select'.")
    found = _teachers(source, names)
    labels = [label for label, _, _ in found]
    if len(set(labels)) < len(labels):
        raise InvalidInput(f"teachers {labels} repeat a name: give each teacher once.")
    rule_of = [None] * len(found) if rules is None else _per_teacher(rules, labels, "rules")
    teachers = tuple(Member(label, b, n, r) for (label, b, n), r in zip(found, rule_of, strict=True))
    _check_rows(teachers)
    return Ensemble(teachers, how, _weights(how, weights, labels), select)


def _check_rows(teachers: Sequence[Member]) -> None:
    """Every teacher's output exists and covers the same rows (shape, per-token offsets)."""
    shapes = {t.label: lead_shape(t.batch, t.name) for t in teachers}
    if len(set(shapes.values())) > 1:
        raise InvalidInput(f"the teachers have different rows: {shapes} (leading shapes); an ensemble needs "
                           f"every teacher's output for the same samples (and tokens).")
    offsets = [(t.label, o) for t in teachers if (o := t.batch.get(f"{t.name}.offsets")) is not None]
    for label, o in offsets[1:]:
        if not torch.equal(o, offsets[0][1]):
            raise InvalidInput(f"{label} and {offsets[0][0]} have different offsets: their token rows are not "
                               f"the same tokens; read the teachers on the same samples.")
    _real_rows(teachers)  # padded per-token outputs: the same lengths
    for t in teachers:
        form = output_form(t.batch, t.name)
        if form == "dense" and t.rule is not None:
            raise InvalidInput(f"{t.label} is dense logits: a reconstruction rule is for sparse outputs; drop it.")
        if form != "dense":
            check_rule(form, t.rule)


def _real_rows(teachers: Sequence[Member]) -> torch.Tensor | None:
    """The real rows shared by every teacher whose batch carries lengths (padded per-token outputs)."""
    masks = [(t.label, m) for t in teachers if (m := real_rows(t.batch, t.name)) is not None]
    for label, m in masks[1:]:
        if not torch.equal(m, masks[0][1]):
            raise InvalidInput(f"{label} and {masks[0][0]} have different lengths: their rows are not the "
                               f"same tokens; read the teachers on the same samples.")
    return masks[0][1] if masks else None
