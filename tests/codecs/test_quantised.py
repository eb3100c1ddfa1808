"""The compact top-k codec ``topkq`` (issue 31): what it stores, how it reads back, its error."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from featstore import IncompatibleFormat, InvalidInput, kd
from featstore.codecs._parts import assemble, check_part, finalize_error, parts_codec
from featstore.codecs._quantised import level_table, normalised, quantisation_kl
from featstore.codecs._ragged import padded, pad_value


class _Part:
    """The two attributes :func:`assemble` reads of a manifest's array spec."""

    def __init__(self, output: str, part: str) -> None:
        self.output, self.part = output, part


def _lm_logits(rows=200, classes=2000, seed=0):
    """Peaked rows like a language model's: a Zipf prior over a random ranking, plus noise."""
    g = torch.Generator().manual_seed(seed)
    rank = torch.randperm(classes, generator=g).float() + 1
    return -1.2 * torch.log(rank) + torch.randn(rows, classes, generator=g) * 2.5


def _read(codec_name, x, name="logits"):
    """What a reader yields for ``x`` stored with ``codec_name``: decoded parts, assembled."""
    c = parts_codec(codec_name)
    parts, error = c.encode(x, 0, name)
    batch = {f"{name}.{p}": c.decode_part(p, a) for p, a in parts.items()}
    return assemble({f"{name}.{p}": _Part(name, p) for p in parts}, batch), parts, error


@pytest.mark.parametrize("name,canonical", [("topkq:50", "topkq:50:128@1"), ("topkq:8:255@2", "topkq:8:255@2"),
                                            ("topkq:5:16", "topkq:5:16@1")])
def test_names_parse_to_canonical_names(name, canonical):
    assert parts_codec(name).name == canonical


@pytest.mark.parametrize("bad", ["topkq:0", "topkq:5:0", "topkq:5:256", "topkq:5@0", "topkq:x"])
def test_bad_names_are_invalid_input(bad):
    with pytest.raises(InvalidInput):
        parts_codec(bad)


def test_parts_are_standard_dtypes_and_65536_classes_fit_16_bits():
    c = parts_codec("topkq:50")
    assert [(p.part, p.dtype, p.shape) for p in c.parts((49152,))] == [
        ("ids", "uint16", (50,)), ("values", "uint8", (50,)), ("tail", "uint8", ())]
    assert c.parts((65536,))[0].dtype == "uint16"  # no padding sentinel: every uint16 is an id
    assert c.parts((65537,))[0].dtype == "uint32"
    x = torch.zeros(2, 65536)
    x[0, 65535] = x[1, 0] = 30.0
    batch, parts, _ = _read("topkq:3", x)
    assert parts["ids"].dtype == np.uint16 and batch["logits.ids"][0, -1] == 65535 and batch["logits.ids"][1, 0] == 0


def test_ids_are_the_top_k_sorted_and_values_the_normalised_levels():
    x = _lm_logits()
    batch, parts, _ = _read("topkq:20@2", x)
    logp = torch.log_softmax(x / 2, -1)
    top, ids = torch.topk(logp, 20)
    assert torch.equal(batch["logits.ids"], ids.sort(-1).values)
    assert bool((np.diff(parts["ids"].astype(np.int64), axis=1) > 0).all())
    # the documented reconstruction, by hand from the stored bytes
    q = np.where(parts["values"] > 0, (parts["values"] / 128.0) ** 2, 1 / (12 * 128**2))
    q_tail = np.where(parts["tail"] > 0, (parts["tail"] / 128.0) ** 2, 1 / (12 * 128**2))
    want = np.log(q) - np.log(q.sum(1) + q_tail)[:, None]
    assert batch["logits.values"].dtype == torch.float32
    np.testing.assert_allclose(batch["logits.values"].numpy(), want, rtol=1e-5, atol=1e-5)
    # the tail is what the kept values leave: the uniform-tail rule of every top-k codec
    rebuilt_tail = 1 - batch["logits.values"].exp().sum(-1)
    np.testing.assert_allclose(rebuilt_tail.numpy(), q_tail / (q.sum(1) + q_tail), rtol=1e-4, atol=1e-6)
    assert "logits.tail" not in batch


@pytest.mark.parametrize("levels", [64, 128, 255])
def test_quantisation_kl_is_recorded_and_near_its_estimate(levels):
    x = _lm_logits(400)
    batch, _, error = _read(f"topkq:50:{levels}", x)
    logp = torch.log_softmax(x, -1)
    top, ids = torch.topk(logp, 50)
    exact = {"t.ids": ids, "t.values": top}
    # by hand: KL between the two uniform-tail reconstructions, dense
    p, q = kd.densify(exact, "t", 2000), kd.densify(batch, "logits", 2000)
    kl = (p * (p.log() - q.log())).sum(-1)
    final = finalize_error(error)
    assert final["quant_kl_mean"] == pytest.approx(float(kl.mean()), rel=1e-3)
    assert final["quant_kl_max"] == pytest.approx(float(kl.max()), rel=1e-3)
    estimate = 51 / (6 * levels**2)
    assert 0.3 * estimate < final["quant_kl_mean"] < 2 * estimate


def test_a_small_tail_stays_right():
    # kept mass 0.994: the top level's rounding alone (0.99 -> 0.984) is as large as the tail, so
    # a tail inferred as 1 - sum(stored) would be ~2x off (KL ~4e-3); the stored tail keeps it right
    p = torch.tensor([0.99, 0.002, 0.002] + [0.006 / 97] * 97)
    _, _, error = _read("topkq:3", p.log().repeat(4, 1))
    assert finalize_error(error)["quant_kl_max"] < 1e-4


def test_kd_reads_it_like_topk():
    x, student = _lm_logits(64), _lm_logits(64, seed=1).requires_grad_()
    q, _, _ = _read("topkq:50:255", x)
    f16, _, _ = _read("topk:50", x)
    a, b = kd.kd_loss(student, q, "logits"), kd.kd_loss(student, f16, "logits")
    assert float(a) == pytest.approx(float(b), rel=2e-3)


def test_padded_rows_stay_minus_inf_not_nan():
    x = _lm_logits(5)
    c = parts_codec("topkq:4")
    parts, _ = c.encode(x, 0, "logits")
    lengths = torch.tensor([3, 0, 2])
    batch = {f"logits.{p}": padded(c.decode_part(p, a), lengths, pad_value(f"logits.{p}", torch.float32))
             for p, a in parts.items()}
    out = assemble({f"logits.{p}": _Part("logits", p) for p in parts}, batch)
    v = out["logits.values"]
    assert v.shape == (3, 3, 4) and not bool(torch.isnan(v).any())
    assert bool(torch.isneginf(v[1]).all()) and bool(torch.isneginf(v[2, 2]).all())


def test_level_table_is_finite_for_every_byte():
    t = level_table(128)
    assert t.shape == (256,) and bool(torch.isfinite(t).all()) and float(t[128]) == 0.0
    assert math.isclose(float(t[0]), math.log(1 / (12 * 128**2)), rel_tol=1e-6)


def test_normalised_and_quantisation_kl_of_an_exact_row_are_exact():
    logp = torch.log(torch.tensor([[0.5, 0.25]], dtype=torch.float64))
    assert torch.allclose(normalised(logp, torch.log(torch.tensor([0.25], dtype=torch.float64))), logp)
    assert float(quantisation_kl(logp, torch.tensor([0.25], dtype=torch.float64), logp)) == 0.0


def test_a_manifest_part_of_another_dtype_is_refused():
    assert check_part("topkq:50:128@1", "values", "uint8", "a").kind == "topkq"
    for part, dtype in (("values", "float16"), ("ids", "int64"), ("tail", "float32"), ("counts", "uint8")):
        with pytest.raises(IncompatibleFormat, match="damaged"):
            check_part("topkq:50:128@1", part, dtype, "a")
    with pytest.raises(IncompatibleFormat):
        check_part("topk:5@1", "values", "uint8", "a")  # only topkq stores levels
