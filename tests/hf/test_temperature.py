"""Distillation at the stored soft labels' temperature (issue 42, point 4): a version stored at T=2,
read through ``SoftLabels`` and ``DistillCollator`` by an unmodified ``transformers.Trainer``,
trains at T=2 when ``Distillation`` names no temperature, and is refused when it names another."""

from __future__ import annotations

import copy

import pytest
import torch

import featstore
from featstore import SourceMismatch, hf

from tests.hf.conftest import compute_teacher
from tests.hf.lm import llama, tokenizer

T = 2.0


@pytest.fixture(scope="module")
def hot(tmp_path_factory):
    """``(SoftLabels, tokenizer)`` of the tiny teacher's top-8 stored at T=2."""
    store = featstore.open_store(tmp_path_factory.mktemp("hot") / "store")
    tok = tokenizer()
    v, data = compute_teacher(store, tok=tok, codec=f"topkq:8@{T:g}", name="tiny/t2")
    return hf.SoftLabels(v, data, tokenizer=tok, temperature=T), tok


def _one_step(train, tok, how, out, iterable=False):
    """One step of an unmodified Trainer (a one-line ``compute_loss``): the student's weights and
    the batch before the step, and the loss it trained on."""
    from transformers import Trainer, TrainingArguments

    seen: dict = {}

    class KD(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen.setdefault("weights", copy.deepcopy(model.state_dict()))
            seen.setdefault("batch", dict(inputs))
            loss = hf.distill_loss(model, inputs, how, return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch)
            seen.setdefault("loss", float((loss[0] if return_outputs else loss).detach()))
            return loss

    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                             seed=0, **({"accelerator_config": {"dispatch_batches": False}} if iterable else {}))
    torch.manual_seed(0)
    KD(model=llama(len(tok), seed=2).train(), args=args, train_dataset=train.iterable(seed=1) if iterable else train,
       data_collator=hf.DistillCollator(pad_token_id=tok.pad_token_id)).train()
    return seen


def _by_hand(tok, seen, t: float) -> float:
    """The recorded step's loss computed unfused at temperature ``t`` (``alpha=0.5``:
    ``0.5 * KL * t**2 + 0.5 * LM``)."""
    student = llama(len(tok), seed=2)
    student.load_state_dict(seen["weights"])
    batch = {k: v for k, v in seen["batch"].items() if k != hf.TEMPERATURE}  # t given explicitly below
    with torch.no_grad():
        logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        kd = hf.topk_kd_loss(logits, batch, hf.Distillation(temperature=t))
        return float(0.5 * kd + 0.5 * hf.lm_loss(torch.log_softmax(logits, -1), batch["labels"]))


@pytest.mark.parametrize("iterable", [False, True], ids=["map", "iterable"])
def test_with_no_temperature_given_it_trains_at_the_stored_one(hot, tmp_path, iterable):
    train, tok = hot
    assert train.spec.temperature == T
    seen = _one_step(train, tok, hf.Distillation(alpha=0.5), tmp_path, iterable)
    assert seen["batch"][hf.TEMPERATURE].tolist() == [T] * 4  # carried by the collator
    at_t, at_1 = _by_hand(tok, seen, T), _by_hand(tok, seen, 1.0)
    assert seen["loss"] == pytest.approx(at_t, rel=1e-5)
    assert abs(at_t - at_1) > 20 * 1e-5 * abs(at_t)  # at T=1 the step's loss would be another


def test_an_explicit_other_temperature_is_refused_naming_both(hot, tmp_path):
    train, tok = hot
    with pytest.raises(SourceMismatch, match=r"stored at temperature 2, but Distillation\(temperature=1\)"):
        _one_step(train, tok, hf.Distillation(alpha=0.5, temperature=1.0), tmp_path)
    # the stored one, named, trains
    seen = _one_step(train, tok, hf.Distillation(alpha=0.5, temperature=T), tmp_path / "again")
    assert seen["loss"] == pytest.approx(_by_hand(tok, seen, T), rel=1e-5)


def test_a_batch_mixing_temperatures_is_refused_and_one_without_keeps_the_given_one(hot):
    train, tok = hot
    batch = hf.DistillCollator(pad_token_id=tok.pad_token_id)(train.__getitems__([0, 1]))
    student = llama(len(tok), seed=2)
    mixed = {**batch, hf.TEMPERATURE: torch.tensor([2.0, 1.0])}
    with pytest.raises(SourceMismatch, match="mixes soft labels stored at temperatures"):
        hf.distill_loss(student, mixed, hf.Distillation())
    unsaid = {k: v for k, v in batch.items() if k != hf.TEMPERATURE}
    with torch.no_grad():
        got = [float(hf.distill_loss(student, b, hf.Distillation(alpha=1.0, temperature=t)))
               for b, t in ((batch, T), (unsaid, T), (unsaid, 1.0))]
    assert got[0] == pytest.approx(got[1], rel=1e-6) and got[2] != pytest.approx(got[0], rel=1e-3)
