"""One storage contract (:class:`featstore.testing.StorageTests`), run against every backend and
server the suite has: local files, fsspec's in-memory filesystem, and S3 on the moto server and
on a real SeaweedFS server (whose replies are not AWS's: its 412 to a conditional create has no
``<Condition>`` element, for one), each S3 server through both clients (obstore reads, the
default, and s3fs reads, ``FEATSTORE_S3_CLIENT=s3fs``)."""

from __future__ import annotations

import uuid

import pytest

from featstore.storage import FsspecStorage, LocalStorage, S3Storage, Storage
from featstore.testing import StorageTests, new_bucket


class TestLocal(StorageTests):
    @pytest.fixture
    def storage(self, tmp_path):
        s = Storage(str(tmp_path / "root"))
        assert type(s) is LocalStorage
        return s


class TestMemory(StorageTests):
    @pytest.fixture
    def storage(self):
        s = Storage(f"memory://contract-{uuid.uuid4().hex[:12]}")
        assert type(s) is FsspecStorage
        yield s
        s.delete("", recursive=True)


class _S3(StorageTests):
    server = "moto"
    client = "obstore"

    @pytest.fixture
    def storage(self, request, monkeypatch):
        monkeypatch.setenv("FEATSTORE_S3_CLIENT", self.client)
        endpoint = request.getfixturevalue(f"{self.server}_endpoint")
        s = Storage(f"s3://{new_bucket(endpoint)}/root", {"endpoint_url": endpoint})
        assert type(s) is S3Storage and (s._s3_getter() is None) == (self.client == "s3fs")  # the client under test
        return s


class TestMoto(_S3):
    pass


class TestMotoS3fs(_S3):
    client = "s3fs"


class TestSeaweedFS(_S3):
    server = "seaweedfs"


class TestSeaweedFSS3fs(_S3):
    server, client = "seaweedfs", "s3fs"


def test_importing_featstore_testing_needs_no_test_only_package():
    import subprocess
    import sys

    code = ("import sys, featstore.testing; "
            "print(sorted(m for m in ('moto', 'boto3', 'pytest', 'botocore') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
