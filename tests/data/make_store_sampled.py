"""Wrote tests/data/store-sampled with featstore as it was before per-sample input digests (commit
cbb9962, the main of 2026-12-07): versions whose dataset identity is the length plus a digest of 16
sampled items. Run from the repository root on that commit:
    git worktree add /tmp/sampled cbb9962
    PYTHONPATH=/tmp/sampled python tests/data/make_store_sampled.py tests/data/store-sampled
Kept to show how the fixture was made; the tests only read it (tests/versions/test_content.py)."""
import json
import shutil
import sys

sys.path.append(".")  # tests.models, from the repository root
import featstore
from featstore import ComputeOptions
from tests.models import TinyA, VectorData

out = sys.argv[1]
shutil.rmtree(out, ignore_errors=True)
store = featstore.open_store(out)
v = store.compute("sampled/tiny", model=TinyA(), dataset=VectorData(100), keep=["target"],
                  outputs={"features": "float16", "logits": "float32"}, samples_per_shard=16,
                  options=ComputeOptions(progress=False), client="in-process")
json.dump({"sampled/tiny": v.id}, open(out + "-ids.json", "w"))
print(v)
