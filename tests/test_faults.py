"""Transient S3 faults, injected by a loopback proxy in front of the real moto server.

The proxy sits on TCP, so the driver, the Dask workers and the DataLoader workers all meet the
faults. Each test prints the figures it measured (faults injected, retries seen, attempts before
the typed error): run with ``-s`` to see them.
"""

from __future__ import annotations

import uuid

import boto3
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import featstore
from featstore import ComputeOptions, StoreConflict, StoreUnavailable
from featstore.storage import S3_MAX_ATTEMPTS, Storage

from .faultproxy import FaultProxy, Rule
from .models import TinyA, VectorData

N, SPP = 256, 64
OUT = {"features": "float16", "logits": "float32"}
QUIET = ComputeOptions(progress=False)
READ_TIMEOUT = 2  # seconds; the proxy's "timeout" fault stalls longer than this


@pytest.fixture(scope="module")
def proxy(moto_endpoint):
    p = FaultProxy(moto_endpoint, stall=READ_TIMEOUT + 2).start()
    yield p
    p.stop()


@pytest.fixture
def faulty(proxy, moto_endpoint):
    """A fresh bucket reached through the proxy: (url, storage_options, boto3 client direct to moto)."""
    bucket = f"flt-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    s3.create_bucket(Bucket=bucket)
    proxy.set_rules()
    proxy.reset_counts()
    # A short read timeout is the user's choice (the stall fault would otherwise take 15 s);
    # featstore adds its retry policy to these config_kwargs.
    opts = {"endpoint_url": proxy.url, "config_kwargs": {"read_timeout": READ_TIMEOUT}}
    yield f"s3://{bucket}/feats", opts, s3, bucket
    proxy.set_rules()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dask_client):
    """The fault-free result, computed once on local disk."""
    store = featstore.open_store(tmp_path_factory.mktemp("ref") / "store")
    v = store.compute("flt/set", model=TinyA(), dataset=VectorData(N), keep=["target"], outputs=OUT,
                      batch_size=32, samples_per_shard=SPP, client=dask_client, options=QUIET)
    return v, {k: t.numpy() for k, t in v.load().items()}


def manifests(s3, bucket: str) -> list[str]:
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    return [k for k in keys if k.endswith("manifest.json")]


def read_all_through_loader(version, workers: int) -> dict[str, np.ndarray]:
    ds = version.dataset(batch_size=50, shuffle=True, seed=3)
    loader = DataLoader(ds, batch_size=None, num_workers=workers, timeout=120 if workers else 0)
    batches = list(loader)
    order = np.argsort(torch.cat([b["index"] for b in batches]).numpy())
    return {k: torch.cat([b[k] for b in batches]).numpy()[order] for k in batches[0]}


@pytest.mark.timeout(300)
def test_compute_and_read_survive_transient_faults(faulty, proxy, reference, dask_client):
    url, opts, s3, bucket = faulty
    ref_version, ref = reference
    # Every fault kind meets every request type: the first four distinct PUTs, GETs, LISTs and
    # HEADs get 503, 500, reset and stall in turn; then 3% of requests fail 1-2 times in a row;
    # one chunk PUT and one chunk GET fail 3 times in a row. The driver, the Dask workers and
    # the DataLoader workers all go through the proxy.
    kinds = ("503", "500", "reset", "timeout")
    proxy.set_rules(Rule("500", ops=("PUT",), path=r"/c/", times=3, min_times=3, first=1, rate=0),
                    Rule("503", ops=("GET",), path=r"/c/", times=3, min_times=3, first=1, rate=0),
                    *(Rule(kinds, ops=(op,), times=2, rate=0.02, first=4, seed=i)
                      for i, op in enumerate(("PUT", "GET", "LIST", "HEAD"))))
    store = featstore.open_store(url, storage_options=opts)
    v = store.compute("flt/set", model=TinyA(), dataset=VectorData(N), keep=["target"], outputs=OUT,
                      batch_size=32, samples_per_shard=SPP, client=dask_client, options=QUIET)
    compute_faults, compute_retries = proxy.n_faults, proxy.retries_seen
    got = {k: t.numpy() for k, t in store.open("flt/set").load().items()}
    got_loader = read_all_through_loader(store.open("flt/set"), workers=2)
    print(f"\n[faults] compute: {compute_faults} faults, {compute_retries} retries; compute+reads: "
          f"{proxy.n_faults} faults {sorted(proxy.faults.items())}, {proxy.retries_seen} retries, "
          f"{sum(proxy.requests.values())} requests, max attempts of one request "
          f"{max(proxy.attempts.values())}")
    assert {(k, op) for k in kinds for op in ("PUT", "GET", "LIST")} <= set(proxy.faults)
    assert v.id == ref_version.id
    assert [s.digests for s in v.manifest.shards] == [s.digests for s in ref_version.manifest.shards]
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k])
        np.testing.assert_array_equal(got_loader[k], ref[k])
    proxy.set_rules()
    assert v.verify() == []
    assert len(manifests(s3, bucket)) == 1


@pytest.mark.timeout(120)
def test_lost_reply_of_conditional_write_is_our_success(faulty, proxy):
    url, opts, s3, bucket = faulty
    storage = Storage(url, opts)
    proxy.set_rules(Rule("lost_reply", ops=("PUT",), path=r"/mine\.json\?", times=1))
    stored = storage.create_json("x/mine.json", {"v": 1})
    print(f"\n[lost-reply] faults={dict(proxy.faults)} forwarded PUTs={proxy.forwarded['PUT']} "
          f"attempts={dict((k[1], n) for k, n in proxy.attempts.items() if k[0] == 'PUT')}")
    assert proxy.faults[("lost_reply", "PUT")] == 1
    assert proxy.forwarded["PUT"] == 2  # the first PUT landed, the retry met If-None-Match: 412
    assert stored["v"] == 1 and storage.read_json("x/mine.json") == stored

    # A real competing writer is still a conflict, with or without a lost reply of our own.
    storage.create_json("x/theirs.json", {"v": "theirs"})
    with pytest.raises(StoreConflict, match="another writer"):
        storage.create_json("x/theirs.json", {"v": "ours"})
    proxy.set_rules(Rule("lost_reply", ops=("PUT",), path=r"/theirs\.json\?", times=1))
    with pytest.raises(StoreConflict):
        storage.create_json("x/theirs.json", {"v": "ours"})
    assert storage.read_json("x/theirs.json")["v"] == "theirs"


@pytest.mark.timeout(180)
def test_lost_reply_of_the_manifest_commits_once(faulty, proxy, dask_client, reference):
    url, opts, s3, bucket = faulty
    store = featstore.open_store(url, storage_options=opts)
    proxy.set_rules(Rule("lost_reply", ops=("PUT",), path=r"/manifest\.json\?", times=1))
    v = store.compute("flt/set", model=TinyA(), dataset=VectorData(N), keep=["target"], outputs=OUT,
                      batch_size=32, samples_per_shard=SPP, client=dask_client, options=QUIET)
    assert proxy.faults[("lost_reply", "PUT")] == 1
    assert v.id == reference[0].id and [x.id for x in store.versions("flt/set")] == [v.id]
    assert len(manifests(s3, bucket)) == 1


@pytest.mark.timeout(180)
def test_persistent_failure_is_store_unavailable_and_commits_nothing(faulty, proxy, dask_client):
    url, opts, s3, bucket = faulty
    store = featstore.open_store(url, storage_options=opts)
    proxy.set_rules(Rule("500", ops=("PUT",), path=r"/manifest\.json\?", times=None))
    with pytest.raises(StoreUnavailable, match="cannot reach the store"):
        store.compute("flt/set", model=TinyA(), dataset=VectorData(N), keep=["target"], outputs=OUT,
                      batch_size=32, samples_per_shard=SPP, client=dask_client, options=QUIET)
    commit_attempts = sum(n for k, n in proxy.attempts.items() if k[1].endswith("manifest.json") and k[0] == "PUT")
    proxy.set_rules()
    assert commit_attempts == S3_MAX_ATTEMPTS  # bounded: botocore's attempts, s3fs adds none for 500
    assert manifests(s3, bucket) == [] and store.versions("flt/set") == []

    # Reads: every chunk GET fails; Version.load raises the typed error, within bounded attempts.
    proxy.set_rules()
    v = store.compute("flt/set", model=TinyA(), dataset=VectorData(64), keep=["target"], outputs=OUT,
                      batch_size=32, samples_per_shard=32, client=dask_client, options=QUIET)
    proxy.reset_counts()
    proxy.set_rules(Rule("500", ops=("GET",), path=r"/c/", times=None))
    with pytest.raises(StoreUnavailable):
        featstore.open_store(url, storage_options=opts).open(f"flt/set@{v.id}").load()
    per_request = max(n for k, n in proxy.attempts.items() if "/c/" in k[1])
    print(f"\n[persistent] manifest PUT attempts={commit_attempts}; chunk GET attempts per request="
          f"{per_request}, faults={proxy.n_faults}")
    assert per_request == S3_MAX_ATTEMPTS
