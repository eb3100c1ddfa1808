"""Soft-label codecs (topk, topp, sample), int8, and the KD loss that reads them (issue 10)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import zarr

from featstore import ComputeOptions, InvalidInput, NonFiniteOutput, VersionNotFound
from featstore import kd
from featstore.format._manifests import Manifest
from featstore.codecs._parts import parts_codec
from featstore.codecs._sparse import PAD_ID

from tests.helpers import QUIET
from tests.models import VectorData



def _logits(rows=64, classes=300, seed=0, scale=3.0):
    return torch.randn(rows, classes, generator=torch.Generator().manual_seed(seed)) * scale


def _batch(codec_name, x, first=0, name="logits"):
    """What a reader yields for ``x`` stored with ``codec_name``: the parts, decoded."""
    c = parts_codec(codec_name)
    parts, error = c.encode(x, first, name)
    return {f"{name}.{p}" if p else name: c.decode_part(p, a) for p, a in parts.items()}, parts, error


# -- parsing and compute-time errors ------------------------------------------------------------
@pytest.mark.parametrize("name,canonical", [
    ("topk:10", "topk:10@1"), ("topk:5@2.5", "topk:5@2.5"), ("topp:0.95:5", "topp:0.95:5:100@1"),
    ("topp:0.9:3:20@4", "topp:0.9:3:20@4"), ("sample:16", "sample:16@1"), ("int8", "int8")])
def test_codec_names_parse_to_canonical_names(name, canonical):
    assert parts_codec(name).name == canonical


@pytest.mark.parametrize("bad", ["topk:0", "topk:5@0", "topk:5@-1", "topk:x", "topp:1.5:3", "topp:0.9:5:3",
                                 "sample:0", "sample:70000", "topk:5@inf"])
def test_bad_codec_names_are_invalid_input(bad):
    with pytest.raises(InvalidInput):
        parts_codec(bad)


def test_k_larger_than_the_class_count_is_refused():
    with pytest.raises(InvalidInput, match="only 300 classes"):
        parts_codec("topk:301").parts((300,), "logits")
    with pytest.raises(InvalidInput, match="only 300 classes"):
        parts_codec("topp:0.9:400:500").parts((300,), "logits")


@pytest.mark.parametrize("name", ["topk:4", "topp:0.9:2", "sample:8", "int8"])
def test_nonfinite_values_are_refused_naming_the_samples(name):
    x = _logits(8, 50)
    x[3, 7] = float("nan")
    with pytest.raises(NonFiniteOutput, match=r"first: \[13\]"):
        parts_codec(name).encode(x, 10, "logits")


def test_ids_are_unsigned_ints_wide_enough_for_the_class_count():
    assert [p.dtype for p in parts_codec("topk:3").parts((65535,))][:2] == ["uint16", "float16"]
    assert parts_codec("topk:3").parts((65536,))[0].dtype == "uint32"  # 65535 is uint16's padding
    x = torch.zeros(2, 70000)
    x[0, 69999] = x[1, 65536] = 10.0
    batch, parts, _ = _batch("topk:2", x)
    assert parts["ids"].dtype == np.uint32
    assert batch["logits.ids"][:, 0].tolist() == [69999, 65536]  # never rounded like fp16 ids


# -- what each codec keeps ----------------------------------------------------------------------
def test_topk_keeps_the_k_largest_log_probs_at_the_temperature():
    x = _logits()
    batch, parts, error = _batch("topk:10@2", x)
    want_v, want_i = torch.topk(torch.log_softmax(x / 2, -1), 10)
    assert torch.equal(batch["logits.ids"], want_i)
    assert batch["logits.values"].dtype == torch.float16
    assert torch.allclose(batch["logits.values"].float(), want_v, atol=2e-3)
    mass = want_v.exp().sum(-1)
    assert error["mass_min"] == pytest.approx(float(mass.min()), rel=1e-5)
    assert error["mass_sum"] == pytest.approx(float(mass.sum()), rel=1e-5)
    assert sum(error["mass_hist"]) == 64 and error["kept_sum"] == 640
    # the recorded KL (closed form) is KL(teacher || the uniform-tail reconstruction)
    logp = torch.log_softmax(x / 2, -1)
    dense = kd.densify(batch, "logits", 300)
    want_kl = (logp.exp() * (logp - dense.log())).sum(-1)
    assert error["kl_sum"] == pytest.approx(float(want_kl.sum()), rel=1e-3)
    assert error["kl_max"] == pytest.approx(float(want_kl.max()), rel=1e-3)


def test_kl_is_recorded_over_the_first_kl_rows_of_a_large_batch():
    from featstore.codecs._parts import finalize_error
    from featstore.codecs._sparse import KL_ROWS

    x = _logits(KL_ROWS + 300, 50)
    batch, _, error = _batch("topk:5", x)
    logp = torch.log_softmax(x, -1)[:KL_ROWS]
    dense = kd.densify({k: v[:KL_ROWS] for k, v in batch.items()}, "logits", 50)
    want_kl = (logp.exp() * (logp - dense.log())).sum(-1)
    assert error["kl_rows"] == KL_ROWS and error["rows"] == KL_ROWS + 300
    final = finalize_error(error)
    assert final["kl_mean"] == pytest.approx(float(want_kl.mean()), rel=1e-3)
    assert final["mass_mean"] == pytest.approx(error["mass_sum"] / (KL_ROWS + 300))


def test_topp_keeps_the_smallest_set_reaching_p_between_min_k_and_cap():
    x = _logits(200, 100, scale=torch.linspace(0.5, 8, 200)[:, None])
    batch, _, error = _batch("topp:0.8:3:40", x)
    p_sorted = torch.softmax(x, -1).sort(-1, descending=True).values
    kept = (batch["logits.ids"] >= 0).sum(-1)
    need = 1 + (p_sorted.cumsum(-1) < 0.8).sum(-1)
    assert torch.equal(kept, need.clamp(3, 40))
    pad = batch["logits.ids"] == PAD_ID
    assert bool(torch.isneginf(batch["logits.values"][pad]).all())  # the documented sentinel
    assert bool(pad[:, :3].logical_not().all()) and int(kept.max()) <= 40
    assert error["kept_max"] <= 40 and error["mass_min"] < 0.8  # rows capped before reaching P


def test_sample_is_reproducible_per_sample_and_unbiased():
    c = parts_codec("sample:16")
    x = _logits(1, 40).repeat(4000, 1)
    batch, parts, _ = _batch("sample:16", x)
    assert parts["counts"].dtype == np.uint8 and int(batch["logits.counts"].sum()) == 16 * 4000
    # a sample's draws depend on its index only, not on the batch it was computed in
    again = c.encode(x[100:110], 100, "logits")[0]
    assert np.array_equal(again["ids"], parts["ids"][100:110])
    mean = kd.densify(batch, "logits", 40).mean(0)
    assert torch.allclose(mean, torch.softmax(x[0], -1), atol=4e-3)  # counts/S is unbiased


def test_int8_is_per_sample_absmax_within_half_a_step():
    x = _logits(32, 20) * torch.logspace(-3, 2, 32)[:, None]
    c = parts_codec("int8")
    parts, error = c.encode(x, 0)
    assert parts[""].dtype == np.int8 and parts["scale"].shape == (32,)
    back = torch.from_numpy(parts[""]).float() * torch.from_numpy(parts["scale"])[:, None]
    step = x.abs().amax(1, keepdim=True) / 127
    assert bool(((back - x).abs() <= step / 2 + 1e-6).all())
    assert error["max_abs_error_max"] == pytest.approx(float((back - x).abs().max()), rel=1e-6)


# -- the KD loss on the sparse form ------------------------------------------------------------
def _dense_kl(p, student, t):
    logq = torch.log_softmax(student / t, -1)
    return (p * (torch.log(p.clamp(min=1e-30)) - logq)).sum(-1).mean() * t * t


@pytest.mark.parametrize("name,rule", [("topk:10", None), ("topk:10", "renormalize"), ("topp:0.9:4:60", None),
                                       ("topp:0.9:4:60", "renormalize")])
@pytest.mark.parametrize("t", [1.0, 3.0])
def test_sparse_kd_loss_equals_the_dense_loss_on_the_densified_teacher(name, rule, t):
    batch, _, _ = _batch(name, _logits(48, 500))
    student = _logits(48, 500, seed=1, scale=2.0).requires_grad_()
    dense = kd.densify(batch, "logits", 500, rule=rule)
    assert torch.allclose(dense.sum(-1), torch.ones(48), atol=1e-4)
    got = kd.kd_loss(student, batch, "logits", temperature=t, rule=rule)
    want = _dense_kl(dense, student, t)
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-4, abs=1e-5)
    g1, = torch.autograd.grad(got, student)
    g2, = torch.autograd.grad(want, student)
    assert torch.allclose(g1, g2, atol=1e-6)


def test_sample_kd_loss_is_an_unbiased_estimate_of_the_dense_kl():
    teacher = _logits(1, 30)
    batch, _, _ = _batch("sample:8", teacher.repeat(6000, 1))
    student = _logits(1, 30, seed=1)
    got = kd.kd_loss(student.repeat(6000, 1), batch, "logits")
    want = _dense_kl(torch.softmax(teacher, -1), student, 1.0)
    assert float(got) == pytest.approx(float(want), rel=0.03)


def test_kd_loss_on_dense_stored_logits_is_classic_kd():
    teacher, student = _logits(16, 50), _logits(16, 50, seed=1)
    got = kd.kd_loss(student, {"logits": teacher.half()}, "logits", temperature=2.0)
    want = _dense_kl(torch.softmax(teacher.half().float() / 2, -1), student, 2.0)
    assert float(got) == pytest.approx(float(want), rel=1e-5)


@pytest.mark.parametrize("t", [0, -1.0, float("nan")])
def test_kd_temperature_must_be_positive(t):
    batch, _, _ = _batch("topk:3", _logits(4, 10))
    with pytest.raises(InvalidInput, match="temperature"):
        kd.kd_loss(_logits(4, 10), batch, "logits", temperature=t)


def test_kd_refuses_a_missing_output_and_ids_beyond_num_classes():
    batch, _, _ = _batch("topk:3", _logits(4, 10))
    with pytest.raises(InvalidInput, match="no output 'probs'"):
        kd.densify(batch, "probs", 10)
    with pytest.raises(InvalidInput, match="num_classes"):
        kd.densify(batch, "logits", 5)
    with pytest.raises(InvalidInput, match="counts"):
        kd.kd_loss(_logits(4, 10), batch, "logits", rule="counts")


# -- through the store: compute, manifest, random access, the reader, plain zarr ---------------
class WideA(torch.nn.Module):
    """Model A with a 300-class head and a 16-wide embedding."""

    def __init__(self, bad_row: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Linear(12, 16), torch.nn.Linear(16, 300)
        self.bad_row = bad_row

    def forward(self, x):
        e = torch.tanh(self.emb(x))
        logits = self.head(e) * 4
        if self.bad_row is not None:
            logits = logits.clone()
            logits[x[:, 0] == self.bad_row, 0] = float("nan")
        return {"emb": e, "logits": logits}


def _compute(store, outputs, model=None, n=200, name="wide/train"):
    outputs = {"emb": "float16", **outputs}
    return store.compute(name, model=model or WideA(), dataset=VectorData(n), keep=["target"],
                         outputs=outputs, samples_per_shard=64, batch_size=32, options=QUIET)


@pytest.mark.parametrize("codec", ["topk:8@2", "sample:12"])
def test_compute_stores_parts_and_every_read_path_returns_them(store, codec):
    model, data = WideA(), VectorData(200)
    v = _compute(store, {"logits": codec, "emb": "int8"}, model=model)
    with torch.inference_mode():
        ref = model.eval()(data.x)
    want, _, _ = _batch(codec, ref["logits"])
    got = v.load()
    sparse = [k for k in want if k.startswith("logits.")]
    assert sorted(k for k in got if k.startswith("logits")) == sorted(sparse)
    for k in sparse:  # A ran in the same process here; ids equal, values to fp16 rounding
        assert got[k].dtype == want[k].dtype and torch.allclose(got[k].float(), want[k].float(), atol=2e-3)
    assert got["emb"].dtype == torch.float32 and "emb.scale" not in got
    assert torch.allclose(got["emb"], ref["emb"], atol=float(ref["emb"].abs().max()) / 254 + 1e-6)
    one = v[[5, 150]]
    assert torch.equal(one["logits.ids"], got["logits.ids"][[5, 150]]) and one["emb"].shape == (2, 16)
    batches = list(v.dataset(batch_size=50, shuffle=True, seed=3, fields=("logits", "target")))
    rows = torch.cat([b["index"] for b in batches])
    ids = torch.cat([b["logits.ids"] for b in batches])
    assert torch.equal(ids, got["logits.ids"][rows]) and "emb" not in batches[0]
    loss = kd.kd_loss(torch.zeros(50, 300, requires_grad=True), batches[0], "logits")
    assert math.isfinite(float(loss))


def test_manifest_records_representation_rule_and_measured_error(local_store):
    v = _compute(local_store, {"logits": "topp:0.9:2:30", "emb": "int8"})
    m = v.manifest
    spec = m.arrays["logits.ids"]
    assert (spec.output, spec.part, spec.dtype, spec.shape) == ("logits", "ids", "uint16", (30,))
    assert spec.params["rule"] == "uniform_tail" and spec.params["temperature"] == 1.0
    assert spec.params["num_classes"] == 300 and spec.params["representation"] == "logprob"
    err = m.stats["logits.ids"]["codec_error"]
    assert err["rows"] == 200 and 0 < err["mass_min"] <= err["mass_mean"] <= 1
    assert err["kl_mean"] >= 0 and sum(err["mass_hist"]) == 200 and 2 <= err["kept_mean"] <= 30
    assert m.stats["emb"]["codec_error"]["max_abs_error_max"] > 0
    assert Manifest.from_json(m.to_json()) == m
    plain = m.arrays["target"].__class__("keep-int64", "int64", (), "keep").to_json()
    assert "output" not in plain and "params" not in plain  # plain arrays' JSON is unchanged
    assert v.verify() == []


def test_plain_zarr_opens_the_parts(local_store):
    v = _compute(local_store, {"logits": "topk:5"})
    g = zarr.open_group(v.url, mode="r")
    ids = g["logits.ids"]
    assert ids.dtype == np.uint16 and ids.shape == (200, 5)
    assert ids.attrs["featstore"]["rule"] == "uniform_tail"
    assert np.array_equal(ids[:].astype(np.int64), v.load()["logits.ids"].numpy())
    import xarray as xr  # in the test extra

    ds = xr.open_zarr(v.url)  # consolidated at commit: no listing, no warning
    assert ds["logits.ids"].dims == ds["logits.values"].dims == ("sample", "logits_k")
    assert ds["logits.values"].dtype == np.float16 and ds.sizes["sample"] == 200


def test_compute_time_errors_leave_no_committed_version(local_store):
    with pytest.raises(InvalidInput, match="only 300 classes"):
        _compute(local_store, {"logits": "topk:400"})
    data = VectorData(64)
    data.x[40, 0] = 999.0
    with pytest.raises(NonFiniteOutput, match="40"):
        local_store.compute("wide/nan2", model=WideA(bad_row=999), dataset=data, samples_per_shard=64,
                            outputs={"logits": "sample:4", "emb": "float16"}, batch_size=32, options=QUIET)
    for name in ("wide/train", "wide/nan2"):
        with pytest.raises(VersionNotFound):
            local_store.open(name)



# -- per-token outputs of token sequences, through the user's collate ---------------------------
class Tokens(torch.utils.data.Dataset):
    """Token sequences of lengths 5-11 (vocabulary 64)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.seqs = [torch.randint(1, 64, (int(k),), generator=g) for k in torch.randint(5, 12, (n,), generator=g)]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i):
        return {"input": self.seqs[i]}


class TinyLM(torch.nn.Module):
    """Per-token next-token logits over a 64-token vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)

    def forward(self, batch):
        return self.out(self.emb(batch["input_ids"])) * batch["attention_mask"][..., None]


def pad_to_12(seqs):
    ids = torch.zeros(len(seqs), 12, dtype=torch.long)
    mask = torch.zeros(len(seqs), 12)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    return {"input_ids": ids, "attention_mask": mask}


def test_token_sequences_need_a_collate_and_store_per_token_soft_labels(local_store):
    from featstore import InvalidInput

    data = Tokens(40)
    with pytest.raises(InvalidInput, match="collating the input .* ComputeOptions.collate"):
        local_store.compute("lm/a", model=TinyLM(), dataset=data, outputs={"logits": "topk:5"}, batch_size=8,
                            options=QUIET)
    v = local_store.compute("lm/a", model=TinyLM(), dataset=data, outputs={"logits": "topk:5"}, batch_size=8,
                            options=ComputeOptions(progress=False, collate=pad_to_12))
    assert v.manifest.arrays["logits.ids"].shape == (12, 5) and "collate" in v.manifest.fingerprint_parts
    got = v[3:7]
    with torch.no_grad():
        ref = TinyLM()(pad_to_12(data.seqs[3:7]))
    want, _, _ = _batch("topk:5", ref)
    for row, seq in enumerate(data.seqs[3:7]):  # every real token of every row (padding is all zeros: ties)
        n = len(seq)
        assert torch.equal(got["logits.ids"][row, :n], want["logits.ids"][row, :n]), row
        torch.testing.assert_close(got["logits.values"][row, :n].float(), want["logits.values"][row, :n].float(),
                                   atol=1e-3, rtol=1e-3)
    student = torch.zeros(4, 12, 64, requires_grad=True)
    loss = kd.kd_loss(student, got, "logits")  # per token rows: [4 * 12, 64]
    assert math.isfinite(float(loss.detach()))
