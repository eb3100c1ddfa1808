"""Compact soft labels at any size (issue 42, point 5): the documented language-model call
(docs/distilling-lms.md: ``topkq:50``, the default layout) stores at most 100 B a token for
versions of 1,000, 10,000 and 100,000 tokens.

Bytes a token are what docs/benchmarks.md's soft-label rows measure: every file under the
soft-label arrays' folders (``logits.ids``, ``logits.values``, ``logits.tail``: their shard
objects and ``zarr.json``), over the version's real tokens. The teacher is :class:`ZipfLM`, a
tiny deterministic model whose top-50 compress like SmolLM2's (no better), so the test is fast.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

import featstore
from featstore import ComputeOptions, hf
from featstore.ragged import pad_sequences
from featstore.versions import stored

from tests.hf.lm import BIG_VOCAB, ZipfLM, big_tokenizer, sentences, tokenizer, zipf_texts

DATA = Path(__file__).resolve().parents[1] / "data"

MAX_BYTES_PER_TOKEN = 100
PARTS = ("logits.ids", "logits.values", "logits.tail")


def soft_label_bytes(v) -> int:
    """Bytes of every file under the version's soft-label array folders."""
    folder = stored(v).storage.path(stored(v).key)
    return sum(os.path.getsize(os.path.join(root, f)) for part in PARTS
               for root, _, files in os.walk(os.path.join(folder, part)) for f in files)


@pytest.fixture(scope="module")
def tok():
    return big_tokenizer()


# 1,000 tokens take ~2 s, 10,000 ~10 s and 100,000 ~2-6 min on 2 shared cores (each token's 49,152
# logits pass through the codec): the two larger in the slow lane
@pytest.mark.parametrize("tokens", [1_000, pytest.param(10_000, marks=pytest.mark.slow),
                                    pytest.param(100_000, marks=[pytest.mark.slow, pytest.mark.timeout(1800)])])
def test_the_documented_call_stores_top_50_in_at_most_100_bytes_a_token(tmp_path, tok, tokens):
    data = hf.TokenizedTexts(zipf_texts(tokens), tok, max_tokens=64)
    assert tokens <= data.tokens < tokens + 64
    store = featstore.open_store(tmp_path / "store")
    v = store.compute("zipf/texts", model=hf.CausalLMLogits(ZipfLM()), dataset=data, input_key="input_ids",
                      outputs={"logits": "topkq:50"}, batch_size=8,
                      options=ComputeOptions(collate=pad_sequences, progress=False, processes=False),
                      tokens=hf.teacher_tokens(tok, max_tokens=64))
    per_token = soft_label_bytes(v) / data.tokens
    assert per_token <= MAX_BYTES_PER_TOKEN, f"{per_token:.1f} B/token at {data.tokens:,} tokens"
    arrays = v.manifest.arrays
    assert {arrays[p].compression for p in PARTS} == {"zstd"}  # the one-byte tail too, on a local store
    assert len({arrays[p].tokens[0] for p in PARTS}) == 1  # the parts own the same token rows
    # the manifest's figures stay true: every real token counted once, the ids within the vocabulary
    assert v.manifest.stats["logits.ids"]["codec_error"]["rows"] == data.tokens
    assert 0 <= v.manifest.stats["logits.ids"]["min"] and v.manifest.stats["logits.ids"]["max"] < BIG_VOCAB
    # and the rows read back as the teacher's: sample 0's most likely next tokens through SoftLabels
    first = hf.SoftLabels(v, data, tokenizer=tok, temperature=1.0)[0]
    assert first["target_token_ids"].shape == (len(data[0]["input_ids"]), 50)


@pytest.mark.parametrize("name", ["pow2/teacher", "pow2/raw"])
def test_a_version_written_before_the_byte_sized_layout_reads_as_it_did(tmp_path, name):
    """tests/data/store-lm-pow2, written by cbb9962 (tests/data/make_store_lm_pow2.py): token
    chunks of 16 rows in ranges of 240, indented zarr.json, and a copy stored raw. Its layout is
    the one its manifest and zarr.json record, and its rows read as that featstore read them,
    through SoftLabels and through plain Zarr."""
    shutil.copytree(DATA / "store-lm-pow2", tmp_path / "store")
    ids = json.loads((DATA / "store-lm-pow2-ids.json").read_text())
    v = featstore.open_store(tmp_path / "store").open(f"{name}@{ids[name]}")
    assert {v.manifest.arrays[f"logits.{p}"].tokens for p in ("ids", "values", "tail")} == {(240, 16)}
    tok = tokenizer()
    data = hf.TokenizedTexts(sentences(48), tok, max_tokens=40)
    rows = hf.SoftLabels(v, data, tokenizer=tok, temperature=1.0).__getitems__(list(range(len(data))))
    want = np.load(DATA / "store-lm-pow2-expected.npz")
    assert [len(r["input_ids"]) for r in rows] == want["lengths"].tolist()
    np.testing.assert_array_equal(np.concatenate([r["target_token_ids"].numpy() for r in rows]), want["ids"])
    np.testing.assert_allclose(np.concatenate([r["target_logprobs"].numpy() for r in rows]), want["logprobs"],
                               rtol=1e-6, atol=1e-6)
    group = zarr.open_group(stored(v).storage.path(stored(v).key), mode="r")
    start, length = int(group["token_start"][7]), int(group["token_length"][7])
    np.testing.assert_array_equal(group["logits.ids"][start:start + length].astype(np.int64),
                                  rows[7]["target_token_ids"].numpy())
