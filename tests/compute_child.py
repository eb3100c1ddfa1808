"""Run by test_resume in a subprocess that the test SIGKILLs mid-compute."""

import sys

import featstore
from featstore import ComputeOptions
from tests.models import SlowData, TinyA

if __name__ == "__main__":
    root, n, spp, delay = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    store = featstore.open_store(root)
    store.compute("kill/me", model=TinyA(), dataset=SlowData(n, delay), keep=["target"],
                  outputs={"features": "float16", "logits": "float32"}, batch_size=16,
                  samples_per_shard=spp, options=ComputeOptions(progress=False))
    print("finished")
