"""Run by test_resume in a subprocess that the test SIGKILLs mid-compute.

    python -m tests.compute_child URL N SAMPLES_PER_SHARD DELAY [ENDPOINT] [SEED]
"""

import sys

import featstore
from featstore import ComputeOptions
from tests.models import SlowData, TinyA

if __name__ == "__main__":
    url, n, spp, delay = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    endpoint = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] != "-" else None
    seed = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    store = featstore.open_store(url, {"endpoint_url": endpoint} if endpoint else None)
    store.compute("kill/me", model=TinyA(seed=seed), dataset=SlowData(n, delay), keep=["target"],
                  outputs={"features": "float16", "logits": "float32"}, batch_size=16,
                  samples_per_shard=spp, options=ComputeOptions(progress=False))
    print("finished")
