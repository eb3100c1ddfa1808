"""What featstore needs from an S3 server, checked on moto, on SeaweedFS and behind a proxy
that makes either of them ignore ``If-None-Match``.

- A 412 reply to a conditional create means "exists", whatever its body: SeaweedFS's has no
  ``<Condition>`` element, so s3fs raises ``OSError(EINVAL)`` where moto's reply gives
  ``FileExistsError``.
- The first create of a process on a store probes, once, that the server honours conditional
  creates; a server that does not is refused before anything is written.
"""

from __future__ import annotations

import errno
import os

import pytest
import s3fs

import featstore
from featstore import ComputeOptions, ConditionalWritesUnsupported
from featstore.storage._s3_create import _HONOURED, PROBE_FOLDER, put_if_absent, store_identity
from featstore.storage import Storage

from featstore.testing import FaultProxy, Rule
from tests.models import TinyA, VectorData
from tests.servers import both_servers, new_bucket


@pytest.fixture
def proxied(s3_endpoint):
    """A fresh bucket on the test's S3 server and a counting proxy in front of it."""
    proxy = FaultProxy(s3_endpoint).start()
    yield f"s3://{new_bucket(s3_endpoint)}/feats", proxy, s3_endpoint
    proxy.stop()


def _puts(proxy: FaultProxy) -> list[str]:
    return sorted(path for (op, path, _), n in proxy.clients.items() if op == "PUT" for _ in range(n))


@both_servers
def test_412_means_exists_whatever_its_body(s3_url, s3_server):
    url, opts = s3_url
    fs = s3fs.S3FileSystem(endpoint_url=opts["endpoint_url"], skip_instance_cache=True)
    path = url.removeprefix("s3://") + "/x.json"
    fs.pipe_file(path, b"first", mode="create")
    # The premise: s3fs's own mapping of the reply differs between the two servers.
    with pytest.raises(OSError) as raised:
        fs.pipe_file(path, b"second", mode="create")
    print(f"\n[412] {s3_server}: s3fs raises {type(raised.value).__name__}(errno={raised.value.errno})")
    if s3_server == "moto":
        assert isinstance(raised.value, FileExistsError)
    else:
        assert not isinstance(raised.value, FileExistsError) and raised.value.errno == errno.EINVAL
    assert put_if_absent(fs, path, b"third") is False  # featstore reads the status: "exists"
    assert fs.cat_file(path) == b"first"


@both_servers
def test_the_probe_runs_once_per_process_and_store(proxied, s3_server):
    url, proxy, _ = proxied
    storage = Storage(url, {"endpoint_url": proxy.url})
    key = (os.getpid(), *store_identity(storage.fs, storage.root))
    _HONOURED.discard(key)
    assert storage.create("a/one.json", b"1") is True
    first = _puts(proxy)
    assert storage.create("a/one.json", b"again") is False and storage.create("a/two.json", b"2") is True
    probes = [p for p in first if f"/{PROBE_FOLDER}/" in p]
    print(f"\n[probe] {s3_server}: first create sent {len(first)} PUTs ({len(probes)} to the probe key), "
          f"later creates {len(_puts(proxy)) - len(first)}")
    assert len(probes) == 2 and len(set(probes)) == 1  # one key, created twice: the second refused
    assert len(_puts(proxy)) - len(first) == 2  # no further probe
    assert key in _HONOURED
    assert storage.find("") == ["a/one.json", "a/two.json"]  # the probe key was deleted
    assert storage.read_bytes("a/one.json") == b"1"


@both_servers
def test_a_server_that_ignores_if_none_match_is_refused_before_any_write(proxied, s3_server, dask_client):
    """Before the probe, 4 processes racing one version there all "won" the create, and 2 of 7
    such races committed a version that could not be read (docs/reliability.md); now the
    first create of each process is refused and nothing is written."""
    url, proxy, endpoint = proxied
    proxy.set_rules(Rule("ignore_condition", ops=("PUT",), times=None))
    storage = Storage(url, {"endpoint_url": proxy.url})
    with pytest.raises(ConditionalWritesUnsupported, match="ignores conditional creates") as raised:
        storage.create("a/one.json", b"1")
    assert isinstance(raised.value, NotImplementedError) and "If-None-Match" in str(raised.value)
    store = featstore.open_store(url, storage_options={"endpoint_url": proxy.url})
    with pytest.raises(ConditionalWritesUnsupported):
        store.compute("srv/set", model=TinyA(), dataset=VectorData(64), outputs={"features": "float16"},
                      batch_size=32, samples_per_shard=32, client=dask_client, options=ComputeOptions(progress=False))
    dropped = proxy.faults[("ignore_condition", "PUT")]
    print(f"\n[ignored] {s3_server}: {dropped} PUTs lost their If-None-Match; refused with "
          f"{type(raised.value).__name__}")
    assert dropped >= 4  # two probes, each created twice
    assert Storage(url, {"endpoint_url": endpoint}).find("") == []  # nothing of a version, no probe left
