"""A sentinel secret given in storage_options never shows up in logs (DEBUG, every logger),
reprs, error messages, manifests, zarr attributes or any object featstore writes to the store."""

from __future__ import annotations

import logging
import pickle
import uuid

import boto3
import pytest

import featstore
from featstore import ComputeOptions, FeatstoreError
from featstore.storage import Storage

from tests import worker_logs
from tests.models import TinyA, VectorData

SECRET = f"SENTINEL-SECRET-{uuid.uuid4().hex}"
TOKEN = f"SENTINEL-TOKEN-{uuid.uuid4().hex}"


@pytest.fixture
def all_logs():
    """Every logger at DEBUG (featstore, s3fs, botocore, aiobotocore, fsspec, distributed...)."""
    worker_logs.start()
    yield worker_logs._state["handler"]
    worker_logs.stop()


@pytest.fixture
def dask_worker_logs(dask_client):
    """The same capture inside every Dask worker process (where the chunk and receipt PUTs
    happen); yields a function returning their records, by worker."""
    dask_client.run(worker_logs.start)
    collected: dict[str, list] = {}

    def collect() -> dict[str, list]:
        collected.update(dask_client.run(worker_logs.stop))
        return collected

    yield collect
    dask_client.run(worker_logs.stop)


@pytest.mark.timeout(180)
def test_sentinel_secret_never_leaks(moto_endpoint, dask_client, all_logs, dask_worker_logs):
    bucket = f"sec-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    s3.create_bucket(Bucket=bucket)
    opts = {"endpoint_url": moto_endpoint, "key": "testing-key", "secret": SECRET, "token": TOKEN}
    seen: list[str] = []

    store = featstore.open_store(f"s3://{bucket}/feats", storage_options=opts)
    v = store.compute("sec/set", model=TinyA(), dataset=VectorData(64), keep=["target"],
                      outputs={"features": "float16", "logits": "float32"}, batch_size=32,
                      samples_per_shard=32, client=dask_client, options=ComputeOptions(progress=False))
    store.tag(v, "best")
    v = store.open("sec/set@best")
    v.load()
    ds = store.dataset("sec/set", batch_size=16)
    batches = list(ds)  # shard objects through obstore, with the secret in its config
    getter = ds.process_reads().storage._s3_getter()
    assert getter is not None  # the obstore path really ran
    seen += [repr(getter), repr(getter._store)]  # its attributes hold them, as Storage._options does
    # An obstore error (nothing listens on port 9; no retries): the message, never the secret.
    dead = Storage(f"s3://{bucket}/feats", {**opts, "endpoint_url": "http://127.0.0.1:9",
                                             "config_kwargs": {"retries": {"total_max_attempts": 1}}})
    with pytest.raises(FeatstoreError) as err:
        dead.read_bytes("x")
    assert "FEATSTORE_S3_CLIENT" in str(err.value)  # obstore's message
    seen += [str(err.value), repr(err.value), repr(err.value.__cause__), repr(err.value.__context__)]
    seen += [repr(x) for x in (store, store.storage, v, ds, v.manifest, batches[0].keys())]
    seen.append(repr(store.storage.options) + str(store.storage.options))
    # Error messages: a missing version, and a bucket that does not exist.
    for action in (lambda: store.open("sec/nope"),
                   lambda: featstore.open_store(f"s3://no-such-{bucket}/x", storage_options=opts)):
        with pytest.raises(FeatstoreError) as err:
            action()
        seen += [str(err.value), repr(err.value)]

    in_workers = dask_worker_logs()
    worker_records = [r for recs in in_workers.values() for r in recs]
    worker_names = {n.split(".")[0] for n, _ in worker_records}
    assert len(in_workers) == 2 and {"botocore", "s3fs", "distributed"} <= worker_names  # really captured
    records = all_logs.records + worker_records
    names = {n.split(".")[0] for n, _ in records}
    assert {"botocore", "s3fs", "featstore"} <= names  # the capture really saw these loggers
    # obstore (Rust) does not log through Python logging at all: nothing of it to leak there.
    assert not any("obstore" in n or "object_store" in n for n in names)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    stored = [s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys]
    token_loggers = sorted({n for n, m in records if TOKEN in m})
    print(f"\n[secrets] {len(records)} DEBUG records ({len(worker_records)} from the Dask worker processes; "
          f"{len(all_logs.unformatted)} of this process's kept unformatted) from {sorted(names)}, "
          f"{len(keys)} stored objects, "
          f"{len(seen)} reprs/messages checked; session token logged by {token_loggers}")
    assert not any(SECRET in m for _, m in records)  # the secret key: nowhere, at any level
    # botocore's signer logs the canonical request at DEBUG, x-amz-security-token included: a
    # third-party leak documented in the README. Nothing outside botocore may log it.
    assert all(n.startswith("botocore.") for n in token_loggers)
    for secret in (SECRET, TOKEN):
        assert not any(secret in s for s in seen)
        assert not any(secret.encode() in b for b in stored)  # manifests, receipts, tags, zarr.json
    assert store.storage.options["secret"] == "***" and store.storage.options["token"] == "***"


def test_a_record_that_cannot_be_formatted_is_kept_with_its_arguments():
    """The capture keeps a record whose format fails (so the secret check sees it) instead of
    dropping it: its message and arguments, str and repr."""

    class Loud:
        def __str__(self):
            return f"holds {SECRET}"

    class Broken:
        def __repr__(self):
            raise RuntimeError("no repr")

    handler = worker_logs.Records()
    for msg, args in (("%d items", (Loud(),)), ("%s and %s", (TOKEN,)), ("%s", (Broken(),))):
        handler.handle(logging.LogRecord("featstore.x", logging.DEBUG, __file__, 1, msg, args, None))
    texts = [t for _, t in handler.records]
    assert len(texts) == 3 and handler.unformatted == ["featstore.x"] * 3
    assert SECRET in texts[0] and TOKEN in texts[1]


def test_secrets_travel_only_when_given_in_options(moto_endpoint):
    """Documented trade-off: options are pickled to workers, so secrets in them travel; the
    credential chain keeps them out of every pickle featstore makes."""
    bucket = f"sec-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=bucket)
    with_secret = Storage(f"s3://{bucket}/x", {"endpoint_url": moto_endpoint, "secret": SECRET, "key": "k"})
    assert SECRET.encode() in pickle.dumps(with_secret)  # needed by workers without a chain
    assert SECRET not in repr(with_secret)
    chain = Storage(f"s3://{bucket}/x", {"endpoint_url": moto_endpoint})
    assert b"SENTINEL" not in pickle.dumps(chain)
    assert pickle.loads(pickle.dumps(chain)).fs.ls(bucket) == []
