"""featstore.hf on a tiny randomly initialised Llama (issue 31): what the version records, the
samples and batches the adapter gives, the refusals, and the distillation loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import zarr

from featstore import InvalidInput, SourceMismatch, Tokens, hf, kd
from featstore.ragged import attention_mask, pad_sequences
from featstore.versions import stored

from tests.hf.conftest import K, MAX_TOKENS, N, compute_teacher
from tests.hf.lm import llama, sentences, tokenizer


def test_version_records_the_tokenizer_and_temperature_and_plain_zarr_reads_standard_dtypes(world):
    store, v, data, tok = world
    recorded = v.manifest.fingerprint_parts["tokens"]["vocabulary"]
    assert recorded == hf.vocabulary(tok).to_json()
    assert recorded["special"] == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert v.manifest.arrays["logits.values"].params["temperature"] == 1.0
    assert v.manifest.arrays["logits.values"].params["levels"] == 128
    error = v.manifest.stats["logits.ids"]["codec_error"]
    assert error["rows"] == data.tokens and 0 < error["quant_kl_mean"] < 1e-3
    group = zarr.open_group(v.zarr_store(), mode="r")
    assert (group["logits.ids"].dtype, group["logits.values"].dtype, group["logits.tail"].dtype) == (
        np.uint16, np.uint8, np.uint8)
    # plain zarr: sample i's rows are token_start[i]:token_start[i] + token_length[i]
    start, length = int(group["token_start"][5]), int(group["token_length"][5])
    assert length == len(data[5]["input_ids"])
    assert np.array_equal(np.sort(group["logits.ids"][start:start + length], axis=1),
                          group["logits.ids"][start:start + length])


def test_samples_are_the_teachers_top_k_of_their_own_tokens(world):
    _, v, data, tok = world
    train = hf.SoftLabels(v, data, tokenizer=tok, temperature=1.0)
    assert len(train) == N and train.spec.k == K and train.spec.classes == len(tok)
    teacher = hf.CausalLMLogits(llama(len(tok), seed=1))
    for i in (0, 17, N - 1):
        s = train[i]
        assert isinstance(s, hf.Sample) and not isinstance(s, dict) and s["index"] == i
        assert torch.equal(s["input_ids"], data[i]["input_ids"]) and torch.equal(s["labels"], s["input_ids"])
        with torch.no_grad():
            logp = torch.log_softmax(teacher(pad_sequences([data[i]["input_ids"]]))[0], -1)
        top, ids = torch.topk(logp, K)
        assert torch.equal(s["target_token_ids"], ids.sort(-1).values)
        want = torch.gather(logp, 1, s["target_token_ids"])
        # 128 square-root levels: sqrt(p) within half a level, plus the normalisation's shift
        assert float(((s["target_logprobs"] / 2).exp() - (want / 2).exp()).abs().max()) < 1 / 128
    batch = train.__getitems__([9, 2, 9])
    assert [s["index"] for s in batch] == [9, 2, 9]
    assert torch.equal(batch[0]["target_logprobs"], train[9]["target_logprobs"])


@pytest.mark.parametrize("student,temperature,differs", [
    (lambda: tokenizer(extra=("zebra",)), 1.0, "vocabulary (40 tokens"),
    (lambda: tokenizer(eos="<pad>"), 1.0, "special tokens (eos_token '</s>' vs '<pad>')"),
    (tokenizer, 2.0, "temperature (1 vs 2)"),
])
def test_another_tokenizer_or_temperature_is_refused_naming_what_differs(world, student, temperature, differs):
    _, v, data, _ = world
    with pytest.raises(SourceMismatch, match=r"these differ: .*" + _escape(differs)):
        hf.SoftLabels(v, data, tokenizer=student(), temperature=temperature)


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_a_version_without_the_tokenizers_identity_is_refused(world):
    store, _, _, tok = world
    v, data = compute_teacher(store, tok=tok, tokens=Tokens(mask=attention_mask, max_tokens=MAX_TOKENS),
                              name="tiny/no-vocabulary")
    with pytest.raises(SourceMismatch, match="without the tokenizer's identity"):
        hf.SoftLabels(v, data, tokenizer=tok, temperature=1.0)


def test_another_dataset_or_output_is_refused(world):
    _, v, data, tok = world
    other = hf.TokenizedTexts(sentences(N, seed=5), tok, max_tokens=MAX_TOKENS)
    with pytest.raises(SourceMismatch, match="item 0 of the dataset is not the item"):
        hf.SoftLabels(v, other, tokenizer=tok, temperature=1.0)
    with pytest.raises(InvalidInput, match="no per-token soft labels named 'probs'"):
        hf.SoftLabels(v, data, tokenizer=tok, temperature=1.0, output="probs")


def test_the_collator_pads_like_axolotls():
    k = 3
    samples = [hf.Sample(torch.arange(n) + 4, torch.arange(n) + 4, torch.arange(n * k).reshape(n, k),
                         torch.full((n, k), -0.5), i, temperature=2.0) for i, n in enumerate((2, 5))]
    b = hf.DistillCollator(pad_token_id=3, pad_to_multiple_of=4, index=True)(samples)
    assert {n: tuple(t.shape) for n, t in b.items()} == {
        "input_ids": (2, 8), "attention_mask": (2, 8), "labels": (2, 8), "target_token_ids": (2, 8, k),
        "target_logprobs": (2, 8, k), "target_mask": (2, 8, k), "target_temperature": (2,), "index": (2,)}
    assert b["target_temperature"].tolist() == [2.0, 2.0]  # the stored soft labels' temperature, for the loss
    assert b["input_ids"][0].tolist() == [4, 5, 3, 3, 3, 3, 3, 3] and b["labels"][0, 2:].eq(-100).all()
    assert b["target_logprobs"][0, 2:].eq(hf.LOGPROB_PAD).all() and b["target_token_ids"][0, 2:].eq(0).all()
    assert b["target_mask"].sum().item() == (2 + 5) * k and b["target_mask"].dtype == torch.int32
    assert b["attention_mask"].sum(1).tolist() == [2, 5]


def test_the_collator_says_what_to_set_when_the_teachers_columns_were_dropped():
    with pytest.raises(InvalidInput, match="remove_unused_columns=False"):
        hf.DistillCollator(pad_token_id=0)([{"input_ids": torch.arange(3)}])


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("rule", ["uniform_tail", "renormalize"])
def test_distill_loss_is_the_dense_kl_on_the_real_positions_mixed_with_the_lm_loss(world, direction, rule):
    _, v, data, tok = world
    train = hf.SoftLabels(v, data, tokenizer=tok, temperature=1.0)
    batch = hf.DistillCollator(pad_token_id=tok.pad_token_id, index=True)(train.__getitems__([3, 4, 5]))
    del batch[hf.TEMPERATURE]  # a batch that does not say its temperature (another collator's): t is used
    student = llama(len(tok), seed=2)
    t = 2.0
    how = hf.Distillation(alpha=0.25, temperature=t, direction=direction, rule=rule)
    loss, out = hf.distill_loss(student, batch, how, return_outputs=True)
    lm_only = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    # by hand: the dense teacher each real position stands for, the dense student, the KL
    real = batch["attention_mask"].bool()
    rows = {"t.ids": batch["target_token_ids"][real], "t.values": batch["target_logprobs"][real]}
    p = kd.densify(rows, "t", len(tok), rule=rule)
    logq = torch.log_softmax(out.logits[real] / t, -1)
    if direction == "forward":
        kl = (p * (p.clamp(min=1e-30).log() - logq)).sum(-1)
    elif rule == "uniform_tail":
        kl = (logq.exp() * (logq - p.log())).sum(-1)
    else:  # no tail: the student renormalised over the kept classes
        lq = torch.gather(logq, 1, rows["t.ids"])
        lq = lq - torch.logsumexp(lq, -1, keepdim=True)
        kl = (lq.exp() * (lq - torch.gather(p, 1, rows["t.ids"]).log())).sum(-1)
    want = 0.25 * kl.mean() * t * t + 0.75 * lm_only.loss  # transformers' own LM loss
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-4)
    assert math.isfinite(float(loss.detach()))


def test_distillation_options_are_checked():
    for bad in ({"alpha": 1.5}, {"temperature": 0}, {"direction": "sideways"}, {"rule": "counts"}):
        with pytest.raises(InvalidInput):
            hf.Distillation(**bad)
    with pytest.raises(InvalidInput, match="DistillCollator"):
        hf.distill_loss(llama(40), {"input_ids": torch.zeros(1, 2, dtype=torch.long)})


def test_the_iterable_reads_every_sample_once_per_epoch_and_its_shards_are_disjoint(world):
    _, v, data, tok = world
    it = hf.SoftLabels(v, data, tokenizer=tok, temperature=1.0).iterable(seed=3, buffer_size=8,
                                                                         samples_per_group=5)
    first = [s["index"] for s in it]
    it.set_epoch(1)
    second = [s["index"] for s in it]
    assert sorted(first) == sorted(second) == list(range(N)) and first != second
    halves = [[s["index"] for s in it.shard(num_shards=2, index=r)] for r in (0, 1)]
    assert not set(halves[0]) & set(halves[1]) and sorted(halves[0] + halves[1]) == list(range(N))


def test_lm_loss_is_transformers_own_with_gradient_accumulation(world):
    _, v, data, tok = world
    train = hf.SoftLabels(v, data, tokenizer=tok, temperature=1.0)
    batch = hf.DistillCollator(pad_token_id=tok.pad_token_id)(train.__getitems__([0, 1]))
    student = llama(len(tok), seed=2)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    logq = torch.log_softmax(student(**inputs).logits.float(), -1)
    for n in (None, 57):
        own = student(**inputs, num_items_in_batch=n).loss
        assert float(hf.lm_loss(logq, batch["labels"], n).detach()) == pytest.approx(float(own.detach()), rel=1e-5)


def test_a_student_from_the_teacher_has_its_configuration_and_fewer_layers():
    teacher = llama(40, layers=3, hidden=32, seed=1)
    student = hf.student_from(teacher, num_hidden_layers=1)
    assert student.config.num_hidden_layers == 1 and student.config.vocab_size == 40
    assert student.config.hidden_size == teacher.config.hidden_size and student.training
    again = hf.student_from(teacher, num_hidden_layers=1)
    assert all(torch.equal(a, b) for a, b in zip(student.parameters(), again.parameters(), strict=True))


@pytest.mark.parametrize("rule", ["uniform_tail", "renormalize"])
@pytest.mark.parametrize("alpha,t,n", [(0.5, 1.0, None), (0.3, 2.0, 23), (1.0, 1.0, None), (0.0, 1.5, None)])
def test_the_fused_forward_loss_has_the_plain_computations_value_and_gradient(world, rule, alpha, t, n):
    _, v, data, tok = world
    train = hf.SoftLabels(v, data, tokenizer=tok, temperature=1.0)
    batch = hf.DistillCollator(pad_token_id=tok.pad_token_id, pad_to_multiple_of=8)(train.__getitems__([6, 7, 8]))
    del batch[hf.TEMPERATURE]  # a batch that does not say its temperature (another collator's): t is used
    how = hf.Distillation(alpha=alpha, temperature=t, rule=rule)
    logits = torch.randn(*batch["input_ids"].shape, len(tok), generator=torch.Generator().manual_seed(1)) * 3

    class Model(torch.nn.Module):  # returns the given logits, so both computations see the same ones
        def __init__(self, z):
            super().__init__()
            self.z = z

        def forward(self, **kw):
            return type("Out", (), {"logits": self.z})()

    fused_z = logits.clone().requires_grad_()
    fused = hf.distill_loss(Model(fused_z), batch, how, num_items_in_batch=n)
    plain_z = logits.clone().requires_grad_()
    plain = alpha * hf.topk_kd_loss(plain_z, batch, how) + (1 - alpha) * hf.lm_loss(
        torch.log_softmax(plain_z, -1), batch["labels"], n)
    assert float(fused.detach()) == pytest.approx(float(plain.detach()), rel=1e-5, abs=1e-6)
    fused.backward()
    plain.backward()
    torch.testing.assert_close(fused_z.grad, plain_z.grad, rtol=1e-4, atol=1e-7)


def test_rows_are_the_versions_whatever_the_cache_holds(world):
    _, v, data, tok = world
    big = hf.SoftLabels(v, data, tokenizer=tok, temperature=1.0)
    small = hf.SoftLabels(v, data, tokenizer=tok, temperature=1.0, cache_bytes=1)  # one chunk at a time
    for idx in ([0, 47, 16, 31], [5, 5, 40], list(range(48))):
        want = v[np.array(idx)]  # the version's own random access
        flat = torch.cat([s["target_logprobs"] for s in big.__getitems__(idx)])
        assert torch.equal(flat, want["logits.values"].float())
        assert torch.equal(torch.cat([s["target_token_ids"] for s in small.__getitems__(idx)]), want["logits.ids"])
    kept = big.teacher.reads.chunks
    assert kept is not None and small.teacher.reads.chunks is not None
    chunk = big.teacher.reads.shard_format("logits.ids").chunk_rows
    chunks = len({int(r) // chunk for r in stored(v).read_rows("token_start", 0, 48)})
    # the small cache keeps one chunk; the big one every chunk of every part read, and the tokens' starts/lengths
    assert len(small.teacher.reads.chunks) == 1 and len(kept) >= chunks > 1
