"""Real parts for every test: a moto S3 server on loopback, a Dask LocalCluster, temp folders."""

from __future__ import annotations

import logging
import os
import uuid

import pytest

# S3 tests use the standard credential chain (environment), never storage_options secrets.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing-key")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing-secret")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture(scope="session")
def moto_endpoint():
    """A real S3 HTTP endpoint on 127.0.0.1 and a free port, for the whole session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_url(moto_endpoint):
    """A fresh bucket per test; returns (url, storage_options)."""
    import boto3

    bucket = f"fs-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/feats", {"endpoint_url": moto_endpoint}


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """A FeatureStore on local disk and on S3 (moto), for contract tests run on both."""
    import featstore

    if request.param == "local":
        return featstore.open_store(tmp_path / "store")
    url, opts = request.getfixturevalue("s3_url")
    return featstore.open_store(url, storage_options=opts)


@pytest.fixture
def local_store(tmp_path):
    import featstore

    return featstore.open_store(tmp_path / "store")


@pytest.fixture(scope="session")
def dask_client():
    """One real LocalCluster (2 worker processes) shared by the compute tests."""
    from distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                           dashboard_address=":0", silence_logs=logging.ERROR)
    client = Client(cluster)
    yield client
    client.close()
    cluster.close()
