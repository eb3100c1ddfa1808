"""Run by test_commit_races: one real process that commits a feature set at a signal, in each of
several stores in turn (one race per store: the process starts once, for all of them).

``python -m tests.race_child TARGETS SEED SPP SYNC ME SCHEDULER [bypass-probe]``: TARGETS is a
JSON list of ``[url, endpoint]`` (endpoint "" for a local store). For target k the process
creates ``SYNC/ready-k-ME``, waits for ``SYNC/go-k``, computes, tags, and writes its result to
``SYNC/result-k-ME.json``. A last argument ``bypass-probe`` (tests/race_repro.py only) marks
each store's server as probed, so a server that ignores conditional creates is used anyway:
what the commit's own checks do there, measured outside CI."""

import json
import os
import sys
import time

#: Samples of each run's feature set: 4 shards of 32 rows (2 of 64 for the other layout).
N = 128


def commit_once(url: str, endpoint: str, seed: int, spp: int, me: str, scheduler: str) -> dict:
    """Compute and tag the race's feature set in the store at ``url``: the result as JSON."""
    import featstore
    from featstore import ComputeOptions, FeatstoreError
    from tests.models import TinyA, VectorData

    try:
        store = featstore.open_store(url, storage_options={"endpoint_url": endpoint} if endpoint else None)
        v = store.compute("race/set", model=TinyA(seed=seed), dataset=VectorData(N), keep=["target"],
                          outputs={"features": "float16", "logits": "float32"}, batch_size=32,
                          samples_per_shard=spp, client=scheduler, options=ComputeOptions(progress=False))
        store.tag(v, "race")  # a shared, moving tag: last writer wins, never dangling
        store.tag(v, f"by-{me}")
        return {"status": "ok", "id": v.id, "fingerprint": v.fingerprint, "spp": v.manifest.layout.samples_per_shard,
                "computed": v.manifest.timings["shards_computed"], "created_at": v.manifest.created_at}
    except FeatstoreError as exc:
        return {"status": type(exc).__name__, "error": str(exc)}


def main(targets: list, seed: int, spp: int, sync_dir: str, me: str, scheduler: str, bypass: bool) -> None:
    import featstore  # noqa: F401 - imported before the first signal: the races start at once

    for k, (url, endpoint) in enumerate(targets):
        if bypass:
            from featstore.storage import _s3_create as s3create

            s3create._HONOURED.add((os.getpid(), endpoint, url.removeprefix("s3://").split("/", 1)[0]))
        open(os.path.join(sync_dir, f"ready-{k}-{me}"), "w").close()
        while not os.path.exists(os.path.join(sync_dir, f"go-{k}")):
            time.sleep(0.01)
        out = commit_once(url, endpoint, seed, spp, me, scheduler)
        path = os.path.join(sync_dir, f"result-{k}-{me}.json")
        with open(path + ".partial", "w") as f:
            json.dump(out, f)
        os.replace(path + ".partial", path)


if __name__ == "__main__":
    targets, seed, spp, sync_dir, me, scheduler = sys.argv[1:7]
    main(json.loads(targets), int(seed), int(spp), sync_dir, me, scheduler, sys.argv[7:8] == ["bypass-probe"])
