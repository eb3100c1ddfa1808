"""Wrote tests/data/store-lm-pow2 with featstore as it was before issue 42's compact token layout
(commit cbb9962, the main of 2026-12-07): the tiny teacher's top-8 soft labels (tests/hf) in the
default layout of then (token chunks the largest power of two dividing samples_per_shard *
max_tokens, 8 shards, indented zarr.json), and the same stored raw (``compression="none"``, as
that featstore stored a real teacher's ``logits.tail``: unwritten chunk rows included). Run from the repository root
on that commit (a copy of it: ``git archive cbb9962 | tar -x -C /tmp/old``):
    PYTHONPATH=/tmp/old python tests/data/make_store_lm_pow2.py tests/data/store-lm-pow2
It writes the store, ``<out>-ids.json`` (the versions' ids) and ``<out>-expected.npz`` (every
sample's ids and log-probs as that featstore read them back; both versions hold the same). Kept
to show how the fixture was made; the tests only read it (tests/hf/test_sizes.py)."""
import json
import os
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.append(".")  # tests.hf.lm, from the repository root

import numpy as np  # noqa: E402

import featstore  # noqa: E402
from featstore import ComputeOptions, hf  # noqa: E402
from featstore.ragged import pad_sequences  # noqa: E402
from tests.hf.lm import llama, sentences, tokenizer  # noqa: E402

out = sys.argv[1]
shutil.rmtree(out, ignore_errors=True)
store = featstore.open_store(out)
tok = tokenizer()
data = hf.TokenizedTexts(sentences(48), tok, max_tokens=40)
ids = {}
for name, compression in (("pow2/teacher", "auto"), ("pow2/raw", "none")):
    v = store.compute(name, model=hf.CausalLMLogits(llama(len(tok), seed=1)), dataset=data,
                      input_key="input_ids", outputs={"logits": "topkq:8"}, batch_size=8,
                      options=ComputeOptions(collate=pad_sequences, progress=False, processes=False,
                                             compression=compression),
                      tokens=hf.teacher_tokens(tok, max_tokens=40))
    ids[name] = v.id
    print(v, {n: (a.tokens, a.compression) for n, a in v.manifest.arrays.items() if a.ragged})
rows = hf.SoftLabels(v, data, tokenizer=tok, temperature=1.0).__getitems__(list(range(len(data))))
np.savez(out + "-expected.npz", ids=np.concatenate([r["target_token_ids"].numpy() for r in rows]),
         logprobs=np.concatenate([r["target_logprobs"].numpy() for r in rows]),
         lengths=np.array([len(r["input_ids"]) for r in rows]))
json.dump(ids, open(out + "-ids.json", "w"))
