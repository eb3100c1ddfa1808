"""Same-fingerprint commit races (4 processes, two layouts) behind a proxy that drops
``If-None-Match``: the measurement behind docs/reliability.md's figures, outside CI.

    python -m tests.race_repro --server moto --races 7                 # what featstore does there
    python -m tests.race_repro --server moto --races 7 --bypass-probe  # the commit's own checks alone

Prints one JSON line per race (each process's status, the committed versions and whether each
verifies and loads) and a summary line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from pathlib import Path

from tests import conftest  # noqa: F401 - the suite's pinned environment (credentials, threads)


def one_race(i: int, upstream: str, proxy_url: str, tmp: Path, scheduler: str, extra: tuple[str, ...]) -> dict:
    import featstore

    from .servers import new_bucket
    from .versions.test_commit_races import race

    url = f"s3://{new_bucket(upstream, 'race')}/feats"
    results = race(url, proxy_url, tmp / f"sync{i}", scheduler, *extra)
    store = featstore.open_store(url, storage_options={"endpoint_url": upstream})
    versions = []
    for v in store.versions("race/set"):
        try:
            state = "ok" if v.verify() == [] and v.load() else "verify fails"
        except featstore.FeatstoreError as exc:
            state = type(exc).__name__
        versions.append({"id": v.id, "samples_per_shard": v.manifest.layout.samples_per_shard, "reads": state})
    # Runs that adopt the winner report its creation time; each run that made a commit of its own
    # reports its own: one per version on a server that honours conditional creates.
    commits = len({r["created_at"] for r in results[:3] if r["status"] == "ok"})
    return {"race": i, "statuses": [r["status"] for r in results], "versions": versions,
            "same_fingerprint_commits": commits}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", choices=["moto", "seaweedfs"], default="moto")
    p.add_argument("--races", type=int, default=7)
    p.add_argument("--bypass-probe", action="store_true")
    args = p.parse_args()
    from distributed import Client, LocalCluster

    from featstore.testing import FaultProxy, Rule, SeaweedFS

    tmp = Path(tempfile.mkdtemp(prefix="race-repro-"))
    if args.server == "moto":
        from moto.server import ThreadedMotoServer

        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        moto.start()
        host, port = moto.get_host_and_port()
        upstream, stop = f"http://{host}:{port}", moto.stop
    else:
        weed = SeaweedFS(tmp / "weed", os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]).start()
        upstream, stop = weed.endpoint, weed.stop
    proxy = FaultProxy(upstream).start()
    proxy.set_rules(Rule("ignore_condition", ops=("PUT",), times=None))
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                           silence_logs=logging.ERROR)
    client = Client(cluster)
    extra = ("bypass-probe",) if args.bypass_probe else ()
    try:
        rows = []
        for i in range(args.races):
            rows.append(one_race(i, upstream, proxy.url, tmp, client.scheduler.address, extra))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        client.close()
        cluster.close()
        proxy.stop()
        stop()
    unreadable = sum(any(v["reads"] != "ok" for v in r["versions"]) for r in rows)
    both = sum(r["same_fingerprint_commits"] > 1 for r in rows)
    print(f"SUMMARY {args.server}{' (probe bypassed)' if args.bypass_probe else ''}: {unreadable} of {len(rows)} "
          f"races committed a version that does not read; in {both} two processes of one fingerprint both "
          f"committed; statuses {sorted({s for r in rows for s in r['statuses']})}")


if __name__ == "__main__":
    main()
