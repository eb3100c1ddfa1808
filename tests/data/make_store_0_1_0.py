"""Wrote tests/data/store-0.1.0 with featstore 0.1.0 as it was before the restructure (commit 73b9ac2):
    git worktree add /tmp/legacy 73b9ac2
    PYTHONPATH=/tmp/legacy python tests/data/make_store_0_1_0.py tests/data/store-0.1.0
(run from the repository root). Kept to show how the fixture was made; the tests only read it."""
import shutil
import sys
import json
import numpy as np
import torch
sys.path.append(".")  # tests.models, from the repository root
import featstore
from featstore import ComputeOptions
from tests.models import TinyA, VectorData

out = sys.argv[1]
shutil.rmtree(out, ignore_errors=True)
store = featstore.open_store(out)
v = store.compute("legacy/tiny", model=TinyA(), dataset=VectorData(40), keep=["target"],
                  outputs={"features": "float16", "logits": "float32"}, samples_per_shard=16,
                  options=ComputeOptions(progress=False))
store.tag(v, "best")
torch.manual_seed(1)
v2 = store.compute("legacy/bf", model=torch.nn.Linear(12, 5), dataset=VectorData(20, seed=1),
                   outputs={"logits": "bfloat16"}, samples_per_shard=8,
                   options=ComputeOptions(progress=False, compression="zstd"))
data = {f"{v.id}/{k}": t.float().numpy() if t.is_floating_point() else t.numpy() for k, t in v.load().items()}
data.update({f"{v2.id}/{k}": t.float().numpy() if t.is_floating_point() else t.numpy() for k, t in v2.load().items()})
np.savez(out + "-expected.npz", **data)
json.dump({"legacy/tiny": v.id, "legacy/bf": v2.id}, open(out + "-ids.json", "w"))
print(v, v2)
