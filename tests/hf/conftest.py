"""The tiny teacher's soft labels, computed once per test module (in this process: no Dask
worker processes to start)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import featstore  # noqa: E402
from featstore import ComputeOptions, hf  # noqa: E402
from featstore.ragged import pad_sequences  # noqa: E402

from tests.hf.lm import llama, sentences, tokenizer  # noqa: E402

N, K, MAX_TOKENS = 48, 8, 40


def compute_teacher(store, texts=None, tok=None, codec=f"topkq:{K}", tokens=None, name="tiny/teacher"):
    """The tiny teacher's per-token top-k over ``texts`` (default: :func:`sentences`)."""
    tok = tok or tokenizer()
    data = hf.TokenizedTexts(texts or sentences(N), tok, max_tokens=MAX_TOKENS)
    return store.compute(name, model=hf.CausalLMLogits(llama(len(tok), seed=1)), dataset=data,
                         input_key="input_ids", outputs={"logits": codec}, batch_size=8, samples_per_shard=16,
                         options=ComputeOptions(collate=pad_sequences, progress=False, processes=False),
                         tokens=tokens or hf.teacher_tokens(tok, max_tokens=MAX_TOKENS)), data


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """``(store, version, data, tokenizer)`` of the tiny teacher."""
    store = featstore.open_store(tmp_path_factory.mktemp("hf") / "store")
    tok = tokenizer()
    v, data = compute_teacher(store, tok=tok)
    return store, v, data, tok
