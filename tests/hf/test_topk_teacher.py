"""Model A that returns its top-k already ranked (featstore.codecs.TopK, what an inference engine
hands back): stored by topkq/topk in the same arrays as the dense logits of the same teacher,
with its declared identity; what cannot store it is refused before anything is written. The
"engine" here is the tiny Llama ranking its own log_softmax; tests/hf/test_vllm.py runs vLLM."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

import featstore
from featstore import ComputeOptions, InvalidInput, OutputMismatch, hf
from featstore._user_types import EngineIdentity
from featstore.codecs import TopK
from featstore.ragged import pad_sequences
from featstore.versions._fingerprints import weights_digest

from tests.hf.conftest import MAX_TOKENS
from tests.hf.lm import llama, sentences, tokenizer

K = 8
OPTIONS = ComputeOptions(collate=pad_sequences, progress=False)


class TinyEngine(hf.TopKTeacher):
    """The tiny Llama's next-token distribution at ``temperature``, each text alone, ranked here."""

    def __init__(self, k: int = K, temperature: float = 1.0, raw: bool = False) -> None:
        tok = tokenizer()
        super().__init__(k, temperature, len(tok))
        self.lm = llama(len(tok), seed=1)
        self.raw = raw  # hand back raw logits instead of log-probabilities (a broken engine)

    def top_logprobs(self, prompts):
        out = []
        with torch.no_grad():
            for p in prompts:
                logits = self.lm(input_ids=torch.tensor([p])).logits[0].float() / self.temperature
                vals, ids = torch.topk(logits if self.raw else torch.log_softmax(logits, -1), self.k, dim=-1)
                out.append(hf.PromptTopK(ids.numpy(), vals.numpy()))
        return out

    def featstore_identity(self):
        return EngineIdentity(weights_digest(self.lm), {"name": "tiny-engine"})


def compute(store, teacher, codec=f"topkq:{K}", name="tiny/engine", data=None):
    tok = tokenizer()
    data = data or hf.TokenizedTexts(sentences(48), tok, max_tokens=MAX_TOKENS)
    return store.compute(name, model=teacher, dataset=data, input_key="input_ids", outputs={"logits": codec},
                         batch_size=8, samples_per_shard=16, options=OPTIONS, client="in-process",
                         tokens=hf.teacher_tokens(tok, max_tokens=MAX_TOKENS)), data


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return featstore.open_store(tmp_path_factory.mktemp("topk-teacher") / "store")


def dense(store, codec):
    """The same teacher's dense logits (CausalLMLogits), stored with ``codec``."""
    return compute(store, hf.CausalLMLogits(llama(len(tokenizer()), seed=1)), codec, name="tiny/dense")


def parts(version, names=("ids", "values", "tail")):
    group = zarr.open_group(version.zarr_store(), mode="r")
    rows = np.concatenate([np.arange(s, s + n) for s, n in zip(group["token_start"][:], group["token_length"][:],
                                                               strict=True)])
    return [group[f"logits.{p}"].get_orthogonal_selection((rows,)) for p in names]


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_a_topk_model_a_stores_what_the_dense_logits_store(store, temperature):
    codec = f"topkq:{K}" + ("" if temperature == 1.0 else "@2")
    forward, data = dense(store, codec)
    engine, _ = compute(store, TinyEngine(temperature=temperature), codec)
    (di, dv, dt), (ei, ev, et) = parts(forward), parts(engine)
    assert np.array_equal(di, ei)  # the same K ids of every token, sorted
    assert np.abs(dv.astype(int) - ev.astype(int)).max() <= 1 and np.abs(dt.astype(int) - et.astype(int)).max() <= 1
    for name in ("logits.ids", "logits.values", "logits.tail"):
        assert engine.manifest.arrays[name].params == forward.manifest.arrays[name].params
    e_err, d_err = (v.manifest.stats["logits.ids"]["codec_error"] for v in (engine, forward))
    assert e_err["rows"] == d_err["rows"] == data.tokens and "kl_mean" not in e_err  # no full rows: no KL to them
    assert e_err["quant_kl_mean"] == pytest.approx(d_err["quant_kl_mean"], rel=1e-3)
    assert engine.manifest.fingerprint_parts["engine"] == {"name": "tiny-engine"}
    assert engine.manifest.fingerprint_parts["model"] == weights_digest(TinyEngine().lm)
    tok = tokenizer()
    a = hf.SoftLabels(engine, data, tokenizer=tok, temperature=temperature)[3]
    b = hf.SoftLabels(forward, data, tokenizer=tok, temperature=temperature)[3]
    assert torch.equal(a["target_token_ids"], b["target_token_ids"])
    assert (a["target_logprobs"] - b["target_logprobs"]).exp().sub(1).abs().max() < 0.05


def test_topk_codec_stores_the_engines_first_k_by_rank(store):
    forward, _ = dense(store, "topk:4")
    engine, _ = compute(store, TinyEngine(k=K), "topk:4")  # K=4 of the engine's 8
    (di, dv), (ei, ev) = parts(forward, ("ids", "values")), parts(engine, ("ids", "values"))
    assert np.array_equal(di, ei) and np.abs(dv.astype(np.float32) - ev.astype(np.float32)).max() < 1e-3


@pytest.mark.parametrize("codec, error, match", [
    (f"topkq:{K}@2", InvalidInput, "cannot be re-tempered"),
    (f"topkq:{2 * K}", InvalidInput, f"returns only its top {K}"),
    ("float16", InvalidInput, "stores as topk:K or topkq:K"),
    ("topp:0.9:4", InvalidInput, "stores as topk:K or topkq:K"),
    ("sample:16", InvalidInput, "stores as topk:K or topkq:K"),
])
def test_what_cannot_store_an_engines_top_k_is_refused_before_a_version(tmp_path, codec, error, match):
    store = featstore.open_store(tmp_path / "store")
    with pytest.raises(error, match=match):
        compute(store, TinyEngine(), codec)
    assert store.names() == []


def test_raw_logits_or_out_of_range_ids_are_refused(tmp_path):
    store = featstore.open_store(tmp_path / "store")
    with pytest.raises(OutputMismatch, match="normalised log-probabilities"):
        compute(store, TinyEngine(raw=True))
    with pytest.raises(OutputMismatch, match="outside its 40 classes"):
        featstore.codecs.parts_codec("topkq:2").encode_topk(
            TopK(torch.tensor([[[3, 40]]]), torch.tensor([[[-1.0, -2.0]]]), classes=40))
    with pytest.raises(OutputMismatch, match="one shape"):
        TopK(torch.zeros(2, 3, 4, dtype=torch.long), torch.zeros(2, 3, 5), classes=10)
