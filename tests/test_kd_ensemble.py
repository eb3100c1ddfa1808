"""Ensembles of teachers in featstore.kd (issue 26, item 3): the sparse path (union of supports
plus one uniform tail) is exact against a dense reference built with ``kd.densify`` and mixed
densely, for every stored form and every mix, and never builds a dense ``[B, C]`` teacher."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from featstore import ComputeOptions, InvalidInput, Tokens, kd
from featstore.codecs._parts import parts_codec
from featstore.ragged import attention_mask, pad_sequences

from .models import TinyLM, TokenSeqs

CODECS = {"topk": "topk:6", "topp": "topp:0.7:2:12", "sample": "sample:9", "renormalize": "topk:4"}


def _enc(form, x, name):
    """What a reader yields for logits ``x`` stored as ``form`` under ``name`` (decoded parts)."""
    if form == "dense":
        return {name: x.half()}
    c = parts_codec(CODECS[form])
    parts, _ = c.encode(x, 0, name)
    return {f"{name}.{p}" if p else name: c.decode_part(p, a) for p, a in parts.items()}


def _logits(rows, classes, seed, scale=3.0):
    return torch.randn(rows, classes, generator=torch.Generator().manual_seed(seed)) * scale


def _rule(form):
    return "renormalize" if form == "renormalize" else None


def _kl(p, student, t, real=None):
    """The dense reference: KL(p || softmax(student / t)) * t^2 over the (real) rows."""
    logq = torch.log_softmax(student.reshape(-1, student.shape[-1]) / t, -1)
    kl = (torch.xlogy(p, p) - p * logq).sum(-1)
    return (kl.mean() if real is None else kl[real].mean()) * t * t


def _reference(dens, how, weights=None, choose=None):
    """Mix the teachers' dense reconstructions ``dens`` ([n, R, C]) the way ``how`` says."""
    dens = torch.stack(dens)
    if how == "select":
        pick = dens.amax(-1).argmax(0) if choose is None else choose(dens)
        return dens[pick, torch.arange(dens.shape[1])]
    w = torch.full((len(dens),), 1.0 / len(dens)) if weights is None else torch.tensor(weights) / sum(weights)
    return (w[:, None, None] * dens).sum(0)


def _assert_exact(ens, dens, student, t, how, weights=None, choose=None):
    """Loss, gradients and densify of ``ens`` equal the dense reference within float32 rounding."""
    classes = student.shape[-1]
    want_p = _reference(dens, how, weights, choose)
    _close(kd.densify(ens, num_classes=classes, temperature=t).reshape(want_p.shape), want_p,
                               atol=2e-6, rtol=1e-5)
    s = student.clone().requires_grad_()
    got, want = kd.kd_loss(s, ens, temperature=t), _kl(want_p, s, t)
    _close(got, want, atol=2e-5, rtol=2e-5)
    g1, = torch.autograd.grad(got, s)
    g2, = torch.autograd.grad(want, s)
    _close(g1, g2, atol=1e-6, rtol=1e-5)


def _close(got, want, atol, rtol):
    """``got`` equals ``want`` within the stated float tolerance (torch.testing.assert_close would
    import torch.distributed.tensor, seconds of the suite)."""
    got, want = torch.as_tensor(got).detach().float(), torch.as_tensor(want).detach().float()
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.allclose(got, want, atol=atol, rtol=rtol), f"max |diff| {float((got - want).abs().max()):.3g}"


def _by_label(target):
    """A user's rule: per row, the teacher giving the true label the most probability."""
    return lambda teachers: torch.stack([r.prob(target) for r in teachers]).argmax(0)


# -- every stored form and every mix, against the dense reference --------------------------------
MIXES = [("mean", None, False), ("weighted", [3.0, 1.0, 0.5], False), ("select", None, False),
         ("select", None, True)]


@pytest.mark.parametrize("how,weights,by_label", MIXES, ids=["mean", "weighted", "most-confident", "user-rule"])
@pytest.mark.parametrize("forms", [("topk", "topp", "sample"), ("topk", "renormalize", "topp"),
                                   ("sample", "sample", "sample"), ("dense", "topk", "sample")])
def test_ensemble_of_stored_forms_equals_the_dense_mix(forms, how, weights, by_label):
    rows, classes, t = 24, 40, 2.0
    names = [f"{chr(97 + i)}/logits" for i in range(len(forms))]
    batch = {}
    for i, (form, name) in enumerate(zip(forms, names, strict=True)):
        batch.update(_enc(form, _logits(rows, classes, seed=i), name))
    rules = [_rule(f) for f in forms]
    target = torch.arange(rows) % classes
    dens = [kd.densify(batch, n, classes, rule=r, temperature=t) for n, r in zip(names, rules, strict=True)]
    select = _by_label(target) if by_label else None
    ens = kd.ensemble(batch, names, how=how, weights=weights, select=select, rules=rules)
    choose = (lambda d: d[:, torch.arange(rows), target].argmax(0)) if by_label else None
    _assert_exact(ens, dens, _logits(rows, classes, seed=9, scale=2.0), t, how, weights, choose)
    if "dense" not in forms:  # sparse all the way: the ensemble is held as union slots + a tail
        sparse = ens.sparse(classes)
        assert sparse.sparse and sparse.ids.shape[0] == rows and sparse.tail.shape == (rows,)


@st.composite
def _teacher(draw, rows, classes):
    """A sparse teacher with random supports: per row a random set of class ids, padded with -1
    in random slots, its stored log-probs (mass <= 1) and, for sample, counts >= 1."""
    form = draw(st.sampled_from(["topk", "renormalize", "sample", "dense"]))
    seed = draw(st.integers(0, 2**16))
    if form == "dense":
        return form, {"": _logits(rows, classes, seed)}
    width = draw(st.integers(1, classes))
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(rows, classes, generator=g) * 2, -1)
    ids = torch.full((rows, width), -1, dtype=torch.long)
    for r in range(rows):
        kept = sorted(draw(st.sets(st.integers(0, classes - 1), max_size=width)))
        slots = torch.randperm(width, generator=g)[:len(kept)]
        ids[r, slots] = torch.tensor(kept, dtype=torch.long)
    logp = torch.where(ids >= 0, torch.log(p.gather(1, ids.clamp(min=0))), -math.inf).half()
    parts = {".ids": ids, ".values": logp}
    if form == "sample":
        parts[".counts"] = torch.randint(1, 5, ids.shape, generator=g) * (ids >= 0)
    return form, parts


@settings(max_examples=80, deadline=None)
@given(data=st.data(), n=st.integers(1, 4), rows=st.integers(1, 5), classes=st.integers(2, 24),
       how=st.sampled_from(["mean", "weighted", "select", "rule"]), t=st.sampled_from([1.0, 2.5]))
def test_property_any_supports_and_mix_equal_the_dense_mix(data, n, rows, classes, how, t):
    teachers = [data.draw(_teacher(rows, classes)) for _ in range(n)]
    batch, names, rules = {}, [], []
    for i, (form, parts) in enumerate(teachers):
        names.append(f"t{i}/out")
        rules.append(_rule(form))
        batch.update({f"t{i}/out{k}": v for k, v in parts.items()})
    weights = data.draw(st.lists(st.floats(0, 4), min_size=n, max_size=n).filter(lambda w: sum(w) > 0.01)) \
        if how == "weighted" else None
    target = torch.tensor(data.draw(st.lists(st.integers(0, classes - 1), min_size=rows, max_size=rows)))
    dens = [kd.densify(batch, nm, classes, rule=r, temperature=t) for nm, r in zip(names, rules, strict=True)]
    ens = kd.ensemble(batch, names, how="select" if how == "rule" else how, weights=weights, rules=rules,
                      select=_by_label(target) if how == "rule" else None)
    choose = (lambda d: d[:, torch.arange(rows), target].argmax(0)) if how == "rule" else None
    student = _logits(rows, classes, seed=rows * classes, scale=2.0)
    _assert_exact(ens, dens, student, t, "select" if how == "rule" else how, weights, choose)


# -- edge cases ----------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["dense", "topk", "topp", "renormalize", "sample"])
@pytest.mark.parametrize("how", ["mean", "select"])
def test_an_ensemble_of_one_teacher_is_that_teacher_alone(form, how):
    batch, student, t = _enc(form, _logits(16, 30, seed=3), "logits"), _logits(16, 30, seed=4), 1.5
    ens = kd.ensemble({"only": batch}, "logits", how=how, rules=[_rule(form)])
    alone = kd.densify(batch, "logits", 30, rule=_rule(form), temperature=t)
    _close(kd.densify(ens, num_classes=30, temperature=t), alone, atol=1e-7, rtol=0)
    s1, s2 = student.clone().requires_grad_(), student.clone().requires_grad_()
    got, want = kd.kd_loss(s1, ens, temperature=t), kd.kd_loss(s2, batch, "logits", t, rule=_rule(form))
    got.backward()
    want.backward()
    _close(s1.grad, s2.grad, atol=1e-7, rtol=1e-5)
    if form != "sample":
        _close(got, want, atol=1e-5, rtol=1e-6)
    else:  # alone: the unbiased estimate with the stored log p; the ensemble: KL(counts/S || q)
        ids, kept = batch["logits.ids"].clamp(min=0), batch["logits.ids"] >= 0
        w = alone
        logp = torch.zeros(16, 30).scatter_add(1, ids, batch["logits.values"].float().masked_fill(~kept, 0))
        constant = (w * logp - torch.xlogy(w, w)).sum(-1).mean() * t * t
        _close(want - got, constant, atol=1e-5, rtol=1e-5)


def _parts(prefix, ids, probs):
    """A sparse output's parts from ids and probabilities, and the probabilities as stored (fp16 logs)."""
    ids = torch.tensor(ids)
    values = torch.where(ids >= 0, torch.tensor(probs).log(), -math.inf).half()
    return {f"{prefix}.ids": ids, f"{prefix}.values": values}, values.float().exp().tolist()[0]


def _slots(rows):
    return {int(i): float(p) for i, p in zip(rows.ids[0], rows.probs[0], strict=True) if i >= 0}


def test_disjoint_supports_take_every_id_and_the_mean_tail():
    a, (pa0, pa1, _) = _parts("a", [[0, 1, -1]], [[0.5, 0.25, 0.0]])
    b, (_, pb7, pb8) = _parts("b", [[-1, 7, 8]], [[0.0, 0.5, 0.375]])
    rows = kd.ensemble({**a, **b}, ["a", "b"]).sparse(10)
    tail_a, tail_b = (1 - pa0 - pa1) / 8, (1 - pb7 - pb8) / 8
    assert rows.tail.tolist() == [pytest.approx((tail_a + tail_b) / 2, rel=1e-6)]
    want = {0: (pa0 + tail_b) / 2, 1: (pa1 + tail_b) / 2, 7: (tail_a + pb7) / 2, 8: (tail_a + pb8) / 2}
    assert _slots(rows) == pytest.approx(want, rel=1e-6)
    assert rows.ids.shape == (1, 6) and int((rows.ids >= 0).sum()) == 4  # union slots, -1 beyond
    total = sum(_slots(rows).values()) + (10 - 4) * float(rows.tail[0])
    assert total == pytest.approx(1.0, rel=1e-6)  # the mixture keeps all the mass: exactly representable


def test_identical_supports_average_the_values_and_the_tails():
    a, (pa3, pa5) = _parts("a", [[3, 5]], [[0.5, 0.25]])
    b, (pb5, pb3) = _parts("b", [[5, 3]], [[0.5, 0.125]])
    rows = kd.ensemble({**a, **b}, ["a", "b"], how="weighted", weights={"a": 1, "b": 3}).sparse(6)
    assert int((rows.ids >= 0).sum()) == 2
    assert _slots(rows) == pytest.approx({3: 0.25 * pa3 + 0.75 * pb3, 5: 0.25 * pa5 + 0.75 * pb5}, rel=1e-6)
    want_tail = 0.25 * (1 - pa3 - pa5) / 4 + 0.75 * (1 - pb3 - pb5) / 4
    assert float(rows.tail[0]) == pytest.approx(want_tail, rel=1e-6)


def test_three_input_layouts_give_the_same_ensemble():
    xa, xb = _logits(8, 20, seed=1), _logits(8, 20, seed=2)
    ba, bb = _enc("topk", xa, "logits"), _enc("sample", xb, "logits")
    prefixed = {**_enc("topk", xa, "a/logits"), **_enc("sample", xb, "b/logits")}
    student = _logits(8, 20, seed=3)
    losses = [kd.kd_loss(student, e, temperature=2.0) for e in (
        kd.ensemble(prefixed, ["a/logits", "b/logits"], how="weighted", weights=[2, 1]),
        kd.ensemble({"a": ba, "b": bb}, "logits", how="weighted", weights={"a": 2, "b": 1}),
        kd.ensemble([(ba, "logits"), (bb, "logits")], how="weighted", weights=[2, 1]))]
    assert losses[0] == losses[1] == losses[2]
    assert kd.ensemble([(ba, "logits"), (bb, "logits")]).labels == ("0:logits", "1:logits")


def test_teacher_rows_answer_what_a_select_rule_asks():
    rows = kd.TeacherRows("t", 4, torch.tensor([[0.7, 0.2, 0.0]]), torch.tensor([[2, 0, -1]]), torch.tensor([0.05]))
    assert rows.dense().tolist() == [pytest.approx([0.2, 0.05, 0.7, 0.05])]
    assert rows.prob(torch.tensor([1])).tolist() == [pytest.approx(0.05)]
    assert rows.prob(torch.tensor([2])).tolist() == [pytest.approx(0.7)]
    assert rows.max_prob().tolist() == [pytest.approx(0.7)] and rows.argmax().tolist() == [2]
    with pytest.raises(InvalidInput, match=r"one class id in \[0, 4\) per row"):
        rows.prob(torch.tensor([4]))


# -- per-token outputs: padded rows are left out, through a real store and reader ----------------
def test_padded_per_token_teachers_equal_their_flat_rows_and_the_dense_mix(local_store):
    opts = ComputeOptions(progress=False, collate=pad_sequences)
    tokens = Tokens(mask=attention_mask, max_tokens=12)
    data = TokenSeqs(32)
    refs = {label: local_store.compute(f"lm/{label}", model=TinyLM(seed=seed), dataset=data, outputs={"logits": c},
                                       batch_size=8, samples_per_shard=16, options=opts, tokens=tokens).ref
            for label, seed, c in [("a", 0, "topk:8"), ("b", 1, "sample:16"), ("c", 2, "float16")]}

    def read(ragged):
        out = {}
        for label, ref in refs.items():
            batch = next(iter(local_store.dataset(ref, batch_size=10, seed=3, ragged=ragged)))
            out.update({f"{label}/{k}": v for k, v in batch.items()})
        return out

    padded, flat = read("padded"), read("flat")
    assert torch.equal(padded["a/index"], padded["b/index"]) and torch.equal(padded["a/index"], flat["c/index"])
    lengths = padded["a/logits.lengths"]
    real = (torch.arange(padded["a/logits.ids"].shape[1])[None] < lengths[:, None]).reshape(-1)
    student = torch.randn(len(lengths), padded["a/logits.ids"].shape[1], 97,
                          generator=torch.Generator().manual_seed(0))
    for names in (["a/logits", "b/logits"], ["a/logits", "b/logits", "c/logits"]):
        for how in ("mean", "select"):
            loss_p = kd.kd_loss(student, kd.ensemble(padded, names, how=how), temperature=2.0)
            loss_f = kd.kd_loss(student.reshape(-1, 97)[real], kd.ensemble(flat, names, how=how), temperature=2.0)
            _close(loss_p, loss_f, atol=1e-5, rtol=1e-5)
            dens = [kd.densify(flat, n, 97, temperature=2.0) for n in names]
            want = _kl(_reference(dens, how), student.reshape(-1, 97)[real], 2.0)
            _close(loss_f, want, atol=2e-5, rtol=2e-5)
    # one teacher alone is also averaged over the real tokens only
    alone_p = kd.kd_loss(student, padded, "a/logits", temperature=2.0)
    alone_f = kd.kd_loss(student.reshape(-1, 97)[real], flat, "a/logits", temperature=2.0)
    _close(alone_p, alone_f, atol=1e-5, rtol=1e-5)
    shorter = {**padded, "b/logits.lengths": lengths - 1}
    with pytest.raises(InvalidInput, match="different lengths.*same samples"):
        kd.ensemble(shorter, ["a/logits", "b/logits"])
    moved = {**flat, "b/logits.offsets": flat["b/logits.offsets"].flip(0)}
    with pytest.raises(InvalidInput, match="different offsets.*same samples"):
        kd.ensemble(moved, ["a/logits", "b/logits"])


# -- memory: sparse teachers never become [B, C] --------------------------------------------------
class _BigTensors(TorchFunctionMode):
    """Records every torch call that returns a new tensor of at least ``nbytes`` (views and
    in-place results share an input's storage and are not counted). The forward is enough: the
    teachers' tensors need no gradient, so a dense teacher could only be built there."""

    def __init__(self, nbytes):
        super().__init__()
        self.nbytes, self.seen = nbytes, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= self.nbytes \
                    and t.untyped_storage().data_ptr() not in inputs:
                self.seen.append(getattr(func, "__name__", str(func)))
        return out


def _big_allocations(fn, nbytes):
    with _BigTensors(nbytes) as mode:
        fn()
    return mode.seen


def test_sparse_ensembles_never_build_a_dense_teacher_even_with_ten_million_classes():
    b, k, classes = 1, 32, 10**7
    g = torch.Generator().manual_seed(0)
    batch = {}
    for i, label in enumerate("abc"):
        ids = (torch.randperm(4096, generator=g)[:k] * 2400 + i).repeat(b, 1)  # distinct per row, overlapping
        ids[:, i * 3:i * 3 + 8] = torch.arange(8)  # some ids shared by every teacher
        logp = torch.log_softmax(torch.randn(b, k, generator=g), -1) - 0.1  # 90% of the mass kept
        batch.update({f"{label}/logits.ids": ids, f"{label}/logits.values": logp.half()})
    batch["c/logits.counts"] = torch.randint(1, 4, (b, k), generator=g)  # c is a sample teacher
    student = torch.randn(b, classes, generator=g)
    half = b * classes * 4 // 2  # half of a float32 [B, C] (40 MB): any dense teacher would be counted
    names = ["a/logits", "b/logits", "c/logits"]
    losses = {}

    def run(key, fn):
        return lambda: losses.__setitem__(key, fn())

    alone = _big_allocations(run("alone", lambda: kd.kd_loss(student, batch, "a/logits", temperature=2.0)), half)
    assert len(alone) == 2  # the student's own: logits / T and log q
    for how in ("mean", "select"):
        ens = kd.ensemble(batch, names, how=how)
        assert _big_allocations(run(how, lambda e=ens: kd.kd_loss(student, e, temperature=2.0)), half) == alone
    dense_mix = run("dense", lambda: _kl(sum(kd.densify(batch, n, classes) for n in names) / 3, student, 2.0))
    assert len(_big_allocations(dense_mix, half)) > len(alone) + 3  # the check can fail: [B, C] per teacher
    _close(losses["mean"], losses["dense"], atol=1e-4, rtol=1e-5)  # and exact at that size


# -- invalid inputs: a typed error that says what to do --------------------------------------------
def _two():
    return {**_enc("topk", _logits(4, 10, seed=1), "a/logits"), **_enc("sample", _logits(4, 10, seed=2), "b/logits")}


BAD = [
    ("unknown name", lambda b: kd.ensemble(b, ["a/logits", "c/logits"]), r"no output 'c/logits'.*c/logits.ids"),
    ("no names", lambda b: kd.ensemble(b, []), r"name the teachers' outputs.*as a list"),
    ("one string", lambda b: kd.ensemble(b, "a/logits"), r"as a list: ensemble\(batch"),
    ("mapping without a name", lambda b: kd.ensemble({"a": b, "b": b}, None), r"name the output they share"),
    ("not a batch", lambda b: kd.ensemble(3, None), r"takes a batch and a list of output names"),
    ("repeated name", lambda b: kd.ensemble(b, ["a/logits", "a/logits"]), r"repeat a name"),
    ("rows differ", lambda b: kd.ensemble({**b, "b/logits.ids": b["b/logits.ids"][:3],
                                            "b/logits.values": b["b/logits.values"][:3],
                                            "b/logits.counts": b["b/logits.counts"][:3]}, ["a/logits", "b/logits"]),
     r"different rows.*same samples"),
    ("unknown how", lambda b: kd.ensemble(b, ["a/logits"], how="max"), r"how must be one of"),
    ("weights without weighted", lambda b: kd.ensemble(b, ["a/logits", "b/logits"], weights=[1, 2]),
     r"pass how='weighted'"),
    ("weighted without weights", lambda b: kd.ensemble(b, ["a/logits", "b/logits"], how="weighted"),
     r"needs weights="),
    ("weights sum to 0", lambda b: kd.ensemble(b, ["a/logits", "b/logits"], how="weighted", weights=[0, 0]),
     r"sum to more than 0"),
    ("negative weight", lambda b: kd.ensemble(b, ["a/logits", "b/logits"], how="weighted", weights=[2, -1]),
     r">= 0"),
    ("nan weight", lambda b: kd.ensemble(b, ["a/logits", "b/logits"], how="weighted", weights=[1, math.nan]),
     r"finite"),
    ("weights count", lambda b: kd.ensemble(b, ["a/logits", "b/logits"], how="weighted", weights=[1]),
     r"sequence of 2"),
    ("weights key", lambda b: kd.ensemble(b, ["a/logits", "b/logits"], how="weighted", weights={"z": 1}),
     r"names \['z'\], which are not teachers"),
    ("select without select", lambda b: kd.ensemble(b, ["a/logits"], select=kd.most_confident),
     r"for how='select'"),
    ("rule for the wrong form", lambda b: kd.ensemble(b, ["a/logits", "b/logits"], rules={"b/logits": "uniform_tail"}),
     r"use counts"),
    ("rule of a dense teacher", lambda b: kd.ensemble({**b, "d": _logits(4, 10, 0)}, ["a/logits", "d"],
                                                       rules=[None, "renormalize"]), r"d is dense logits.*drop it"),
    ("rules key", lambda b: kd.ensemble(b, ["a/logits"], rules={"b": "counts"}), r"rules names \['b'\]"),
    ("select returns floats", lambda b: kd.kd_loss(_logits(4, 10, 0), kd.ensemble(
        b, ["a/logits", "b/logits"], how="select", select=lambda ts: torch.zeros(4)), temperature=1.0),
     r"integer tensor of 4 teacher positions in \[0, 2\)"),
    ("select out of range", lambda b: kd.densify(kd.ensemble(
        b, ["a/logits", "b/logits"], how="select", select=lambda ts: torch.full((4,), 2)), num_classes=10),
     r"integer tensor of 4 teacher positions"),
    ("student rows", lambda b: kd.kd_loss(_logits(5, 10, 0), kd.ensemble(b, ["a/logits", "b/logits"])),
     r"student_logits has 5 rows.*the same rows"),
    ("ids beyond classes", lambda b: kd.kd_loss(_logits(4, 5, 0), kd.ensemble(b, ["a/logits", "b/logits"])),
     r"num_classes is 5"),
    ("dense classes", lambda b: kd.kd_loss(_logits(4, 10, 0), kd.ensemble(
        {**b, "d": _logits(4, 11, 0)}, ["a/logits", "d"])), r"d has 11 classes, but num_classes is 10"),
    ("sparse of a dense teacher", lambda b: kd.ensemble({**b, "d": _logits(4, 10, 0)}, ["a/logits", "d"]).sparse(10),
     r"dense logits.*use densify"),
    ("temperature as the name", lambda b: kd.kd_loss(_logits(4, 10, 0), kd.ensemble(b, ["a/logits"]), 2.0),
     r"temperature=\.\.\. by keyword"),
    ("densify without classes", lambda b: kd.densify(kd.ensemble(b, ["a/logits"])), r"num_classes=C"),
    ("repeated id in a row", lambda b: kd.ensemble({**b, "a/logits.ids": b["a/logits.ids"][:, [0, 0, 1, 2, 3, 4]]},
                                                    ["a/logits", "b/logits"]).sparse(10), r"names one class id twice"),
    ("bad temperature", lambda b: kd.kd_loss(_logits(4, 10, 0), kd.ensemble(b, ["a/logits"]), temperature=0),
     r"temperature must be a finite number > 0"),
]


@pytest.mark.parametrize("make", [m for _, m, _ in BAD], ids=[n for n, _, _ in BAD])
def test_invalid_ensembles_are_refused_saying_what_to_do(make):
    message = {id(m): msg for _, m, msg in BAD}[id(make)]
    with pytest.raises(InvalidInput, match=message):
        make(_two())
