"""Real parts for every test: S3 servers on loopback (moto, SeaweedFS), a Dask LocalCluster, temp folders."""

from __future__ import annotations

import logging
import os
import sys

import pytest

# -- the environment the suite runs in --------------------------------------------------------
# The suite must pass the same on any machine, whatever the shell that starts it exports. These
# variables change what featstore or the parts under it do, so they are cleared or pinned here,
# at conftest import (before torch, botocore or Dask are imported by any test module), in
# os.environ: every child process (Dask worker processes, DataLoader workers, the subprocesses
# some tests start) inherits the same environment.

#: Cleared. AWS_MAX_ATTEMPTS / AWS_RETRY_MODE: featstore's S3 retry policy applies only when the
#: user sets none, and the fault tests count attempts (tests that need a user's setting set it
#: themselves). MALLOC_* / GLIBC_TUNABLES / LD_PRELOAD: featstore.allocator leaves a process whose
#: allocator the user configured alone, and a preloaded jemalloc/tcmalloc changes what glibc's
#: mallinfo2 reports. A profile, session token, endpoint, CA bundle or proxy would send the S3
#: tests' requests somewhere other than the loopback moto server, or sign them differently.
CLEARED = ("AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", "GLIBC_TUNABLES", "LD_PRELOAD", "AWS_PROFILE",
           "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL",
           "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy",
           "https_proxy", "all_proxy", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
#: Pinned. OMP_NUM_THREADS=1: the cores are shared by the test process, two Dask worker processes
#: and DataLoader workers; unpinned, each would start one OpenMP thread per core (and torch in
#: this process reads it once, at import). No value depends on it: the test models compute
#: exactly (tests/models.py). S3 tests use the standard credential chain (environment), never
#: storage_options secrets, and never a config file of the user's.
PINNED = {"OMP_NUM_THREADS": "1", "AWS_ACCESS_KEY_ID": "testing-key", "AWS_SECRET_ACCESS_KEY": "testing-secret",
          "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
          "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_EC2_METADATA_DISABLED": "true",
          "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
#: What this process inherited of those. glibc read MALLOC_*, GLIBC_TUNABLES and LD_PRELOAD when
#: this process started, so clearing them changes its children only: a test that inspects the
#: allocator of a process runs a fresh child (see test_compute).
INHERITED = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k in CLEARED or k in PINNED}
for _name in [k for k in os.environ if k.startswith("MALLOC_")] + list(CLEARED):
    os.environ.pop(_name, None)
os.environ.update(PINNED)
if "torch" in sys.modules:  # imported before this file (a plugin): pin its threads directly
    sys.modules["torch"].set_num_threads(1)


@pytest.fixture(scope="session")
def moto_endpoint():
    """A real S3 HTTP endpoint on 127.0.0.1 and a free port, for the whole session."""
    from featstore.testing import moto_server

    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def seaweedfs_endpoint(tmp_path_factory):
    """A real SeaweedFS S3 server (``weed server -s3``) on 127.0.0.1, for the whole session.

    Its one identity has the pinned AWS keys, so clients use the same credential chain as on
    moto. A server that cannot start fails the tests that need it (never a skip)."""
    from featstore.testing._servers import SeaweedFS

    with SeaweedFS(tmp_path_factory.mktemp("seaweedfs"), PINNED["AWS_ACCESS_KEY_ID"],
                   PINNED["AWS_SECRET_ACCESS_KEY"]) as server:
        yield server.endpoint


@pytest.fixture
def s3_server():
    """The S3 server a test's S3 fixtures use: moto, unless the test parametrizes ``s3_server``
    (``@both_servers`` from tests/servers.py runs it on moto and on SeaweedFS)."""
    return "moto"


@pytest.fixture
def s3_endpoint(request, s3_server):
    """The endpoint URL of the test's S3 server (see ``s3_server``)."""
    return request.getfixturevalue(f"{s3_server}_endpoint")


@pytest.fixture
def s3_url(s3_endpoint):
    """A fresh bucket per test on the test's S3 server; returns (url, storage_options)."""
    from .servers import new_bucket

    return f"s3://{new_bucket(s3_endpoint)}/feats", {"endpoint_url": s3_endpoint}


@pytest.fixture(params=["local", "moto"])
def store(request, tmp_path):
    """A FeatureStore on local disk and on S3 (moto), for contract tests run on both; a test
    parametrized with ``ALL_STORES`` (tests/servers.py) also gets one on SeaweedFS."""
    import featstore

    if request.param == "local":
        return featstore.open_store(tmp_path / "store")
    from .servers import new_bucket

    endpoint = request.getfixturevalue(f"{request.param}_endpoint")
    return featstore.open_store(f"s3://{new_bucket(endpoint)}/feats", storage_options={"endpoint_url": endpoint})


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


@pytest.fixture(scope="session")
def shared_versions(tmp_path_factory, moto_endpoint):
    """The versions many test files read, written once per session on first use (see
    ``tests/helpers.py``: ``SharedVersions``); ``shared_versions["local"]`` and so on."""
    from .helpers import SharedVersions

    return SharedVersions(tmp_path_factory.mktemp("shared"), moto_endpoint)


@pytest.fixture(scope="session", autouse=True)
def _close_the_runner():
    """Close the cluster ``write_version`` computed on (started only if a test wrote a version)."""
    yield
    from .helpers import close_runner

    close_runner()
