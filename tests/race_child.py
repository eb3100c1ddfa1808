"""Run by test_commit_races: one real process that commits a feature set at a signal.

An 8th argument ``bypass-probe`` (tests/race_repro.py only) marks the store's server as probed,
so a server that ignores conditional creates is used anyway: what the commit's own checks do
there, measured outside CI."""

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
    if sys.argv[8:9] == ["bypass-probe"]:
        from featstore.storage import _s3_create as s3create

        s3create._HONOURED.add((os.getpid(), endpoint, url.removeprefix("s3://").split("/", 1)[0]))
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
