"""hf.SoftLabels over a 0.7/0.3 mixture of two soft-label versions of different texts (issue 43):
each sample the mixture's plan draws, joined with its own version's texts, through an unmodified
transformers.Trainer for a whole epoch; the tokenizer and temperature checked across the
versions; and the per-token versions mixed by the streaming reader, resumed on another split."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import featstore
from featstore import InvalidInput, SourceMismatch, hf

from tests.hf.conftest import K, MAX_TOKENS, compute_teacher
from tests.hf.lm import llama, sentences, tokenizer

EPOCH = 40  # 28 samples of the first corpus, 12 of the second


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two soft-label versions of the tiny teacher over different texts (48 and 24 sentences)."""
    store = featstore.open_store(tmp_path_factory.mktemp("hf-mix") / "store")
    tok = tokenizer()
    a, data_a = compute_teacher(store, texts=sentences(48, seed=0), tok=tok, name="mix/prose")
    b, data_b = compute_teacher(store, texts=sentences(24, seed=7, lo=10, hi=35), tok=tok, name="mix/code")
    return store, (a, data_a), (b, data_b), tok


def mixture(corpora, **kw):
    _, (a, _), (b, _), _ = corpora
    return featstore.mix([(a, 0.7), (b, 0.3)], epoch_size=EPOCH, seed=3, **kw)


def test_soft_labels_over_a_mixture_are_each_versions_rows_and_texts(corpora):
    _, (a, data_a), (b, data_b), tok = corpora
    train = hf.SoftLabels(mixture(corpora), [data_a, data_b], tokenizer=tok, temperature=1.0)
    assert len(train) == EPOCH and Counter(train.stream.tolist()) == {0: 28, 1: 12}
    for i in range(EPOCH):
        k, sample = int(train.stream[i]), int(train.index[i])
        version, data = ((a, data_a), (b, data_b))[k]
        s = train[i]
        assert s["index"] == i and torch.equal(s["input_ids"], data[sample]["input_ids"])
        want = version[sample]
        assert torch.equal(s["target_token_ids"], want["logits.ids"])
        assert torch.equal(s["target_logprobs"], want["logits.values"].float())


def test_the_tokenizer_and_temperature_are_checked_across_the_versions(corpora, tmp_path):
    _, (a, data_a), (b, data_b), tok = corpora
    # the same vocabulary size (the codecs agree) but another end token: another tokenizer
    other_tok = tokenizer(eos="<unk>")
    c, data_c = compute_teacher(featstore.open_store(tmp_path / "s"), texts=sentences(16, seed=9), tok=other_tok,
                                name="mix/other")
    assert c.manifest.arrays["logits.ids"].params == a.manifest.arrays["logits.ids"].params
    with pytest.raises(InvalidInput, match="tokenizers differ.*eos_token"):
        featstore.mix([(a, 0.5), (c, 0.5)], epoch_size=20)
    with pytest.raises(SourceMismatch, match="eos_token"):  # the student's tokenizer against every version's
        hf.SoftLabels(mixture(corpora), [data_a, data_b], tokenizer=other_tok, temperature=1.0)
    with pytest.raises(SourceMismatch, match="temperature"):
        hf.SoftLabels(mixture(corpora), [data_a, data_b], tokenizer=tok, temperature=2.0)


def test_an_unmodified_trainer_trains_on_every_sample_of_the_mixtures_epoch(corpora, tmp_path):
    from transformers import Trainer, TrainingArguments

    _, (_, data_a), (_, data_b), tok = corpora
    train = hf.SoftLabels(mixture(corpora), [data_a, data_b], tokenizer=tok, temperature=1.0)
    trained: list[int] = []

    class KD(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            trained.extend(inputs["index"].tolist())
            return hf.distill_loss(model, inputs, hf.Distillation(alpha=0.5), return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch)

    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, num_train_epochs=1,
                             report_to=[], use_cpu=True, save_strategy="no", seed=0, dataloader_num_workers=0,
                             disable_tqdm=True, learning_rate=1e-3)
    result = KD(model=llama(len(tok), seed=2).train(), args=args, train_dataset=train,
                data_collator=hf.DistillCollator(pad_token_id=tok.pad_token_id, index=True)).train()
    assert sorted(trained) == list(range(EPOCH)) and math.isfinite(result.training_loss)
    assert Counter(train.stream[trained].tolist()) == {0: 28, 1: 12}


def test_the_streaming_mixture_of_per_token_versions_resumes_on_another_split_once(corpora):
    _, (a, _), (b, _), _ = corpora

    def rows(batches):
        out = []
        for batch in batches:
            offsets = batch["logits.offsets"]
            for r, (s, i) in enumerate(zip(batch["source"].tolist(), batch["index"].tolist(), strict=True)):
                want = (a, b)[s][i]
                assert torch.equal(batch["logits.ids"][offsets[r]:offsets[r + 1]], want["logits.ids"])
                out.append((s, i))
        return out

    whole = rows(DataLoader(mixture(corpora, batch_size=4), batch_size=None))
    assert len(whole) == EPOCH
    seen, state = [], None
    for rank in range(2):  # 2 ranks x batch 4, 2 steps each; rank 0 saves
        ds = mixture(corpora, batch_size=4, partition="even", rank=rank, world_size=2)
        it = iter(DataLoader(ds, batch_size=None))
        seen += rows([next(it), next(it)])
        if rank == 0:
            state = ds.state_dict(batches_seen=2, num_workers=0)
    again = mixture(corpora, batch_size=8, partition="even", num_workers=2)  # 1 rank x batch 8, 2 workers
    again.load_state_dict(state)
    rest = rows(DataLoader(again, batch_size=None, num_workers=2, timeout=120))
    assert Counter(seen + rest) == Counter(whole)
    padded = next(iter(mixture(corpora, batch_size=4, ragged="padded")))
    assert padded["logits.ids"].shape[:2] == (4, int(padded["logits.lengths"].max())) and K == 8
    assert np.all(padded["logits.lengths"].numpy() <= MAX_TOKENS)
