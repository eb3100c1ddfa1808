"""Run by test_commit_races: one real process that commits a feature set at a signal."""

import json
import os
import sys
import time

import featstore
from featstore import ComputeOptions, FeatstoreError
from tests.models import TinyA, VectorData

if __name__ == "__main__":
    url, endpoint, seed, spp, sync_dir, me, scheduler = sys.argv[1:8]
    opts = {"endpoint_url": endpoint} if endpoint else None
    open(os.path.join(sync_dir, f"ready-{me}"), "w").close()
    while not os.path.exists(os.path.join(sync_dir, "go")):
        time.sleep(0.01)
    try:
        store = featstore.open_store(url, storage_options=opts)
        v = store.compute("race/set", model=TinyA(seed=int(seed)), dataset=VectorData(192), keep=["target"],
                          outputs={"features": "float16", "logits": "float32"}, batch_size=32,
                          samples_per_shard=int(spp), client=scheduler, options=ComputeOptions(progress=False))
        store.tag(v, "race")  # a shared, moving tag: last writer wins, never dangling
        store.tag(v, f"by-{me}")
        out = {"status": "ok", "id": v.id, "fingerprint": v.fingerprint, "spp": v.manifest.layout.samples_per_shard,
               "computed": v.manifest.timings["shards_computed"], "created_at": v.manifest.created_at}
    except FeatstoreError as exc:
        out = {"status": type(exc).__name__, "error": str(exc)}
    print("RESULT " + json.dumps(out), flush=True)
