"""Which S3 servers a test runs on, and fresh buckets on them.

Every S3 test runs on moto (AWS's exact replies). The representative ones also run on SeaweedFS,
a real S3-compatible server (``seaweedfs_endpoint`` in conftest.py): the Storage contract, the
compute round trip, commit races, resume after SIGKILL, gc, extends, the CLI and some fault tests.
"""

from __future__ import annotations

import pytest

from featstore.testing import new_bucket  # noqa: F401 - the suite's fresh buckets

#: The S3 servers of the suite, by the name of their endpoint fixture (``<name>_endpoint``).
S3_SERVERS = ("moto", "seaweedfs")
#: Run a test that uses ``s3_url`` / ``s3_endpoint`` once per S3 server.
both_servers = pytest.mark.parametrize("s3_server", S3_SERVERS)
#: ``store`` on local disk and on every S3 server: ``@pytest.mark.parametrize("store", ALL_STORES, indirect=True)``.
ALL_STORES = ("local", *S3_SERVERS)
