"""Transient S3 faults, injected by a loopback proxy in front of a real S3 server (moto; the
lost-reply tests on SeaweedFS too).

The proxy sits on TCP, so the driver, the Dask workers and the DataLoader workers all meet the
faults. Each test prints the figures it measured (faults injected, retries seen, attempts before
the typed error): run with ``-s`` to see them.
"""

from __future__ import annotations

import boto3
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import featstore
from featstore.versions import stored
from featstore import StoreConflict, StoreUnavailable
from featstore.storage._s3_create import PROBE_FOLDER
from featstore.storage import S3_MAX_ATTEMPTS, Storage

from featstore.testing import FaultProxy, Rule
from tests.helpers import QUIET, TINY_OUTPUTS, TinyA, VectorData, write_version
from tests.servers import both_servers, new_bucket

N, SPP = 256, 64
OUT = TINY_OUTPUTS
READ_TIMEOUT = 2  # seconds; the proxy's "timeout" fault stalls longer than this
#: How long the proxy's "timeout" fault stalls: far past READ_TIMEOUT, so a client that honours
#: its timeout hangs up first even on a loaded machine (the proxy stops waiting when it does).
STALL = 30


@pytest.fixture(scope="module")
def proxies():
    """One proxy per S3 server, started when a test first needs it."""
    made: dict[str, FaultProxy] = {}
    yield made
    for p in made.values():
        p.stop()


@pytest.fixture
def proxy(proxies, s3_server, s3_endpoint):
    if s3_server not in proxies:
        proxies[s3_server] = FaultProxy(s3_endpoint, stall=STALL).start()
    return proxies[s3_server]


@pytest.fixture
def faulty(proxy, s3_endpoint):
    """A fresh bucket reached through the proxy: (url, storage_options, boto3 client direct to the server)."""
    bucket = new_bucket(s3_endpoint, "flt")
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    proxy.set_rules()
    proxy.reset_counts()
    # A short read timeout is the user's choice (the stall fault would otherwise take 15 s);
    # featstore adds its retry policy to these config_kwargs.
    opts = {"endpoint_url": proxy.url, "config_kwargs": {"read_timeout": READ_TIMEOUT}}
    yield f"s3://{bucket}/feats", opts, s3, bucket
    proxy.set_rules()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free result, computed once on local disk."""
    store = featstore.open_store(tmp_path_factory.mktemp("ref") / "store")
    v = write_version(store, "flt/set", n=N, outputs=OUT, samples_per_shard=SPP, options=QUIET)
    return v, {k: t.numpy() for k, t in v.load().items()}


def manifests(s3, bucket: str) -> list[str]:
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    return [k for k in keys if k.endswith("manifest.json")]


def read_all_through_loader(version, workers: int) -> dict[str, np.ndarray]:
    ds = version.dataset(batch_size=50, shuffle=True, seed=3)
    # Spawned workers start without obstore's runtime whatever this process read before (a
    # forked one inherits it once started here, and then reads through s3fs: see featstore/storage/_s3_reads.py).
    loader = DataLoader(ds, batch_size=None, num_workers=workers, timeout=120 if workers else 0,
                        multiprocessing_context="spawn" if workers else None)
    it = iter(loader)
    try:
        batches = list(it)
    finally:
        # Stop the workers now: on an error the traceback keeps the iterator (and its workers,
        # still retrying their GETs) alive, and the next request counts would include theirs.
        if hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
    order = np.argsort(torch.cat([b["index"] for b in batches]).numpy())
    return {k: torch.cat([b[k] for b in batches]).numpy()[order] for k in batches[0]}


KINDS = ("503", "500", "reset", "timeout")
OPS = ("PUT", "GET", "LIST", "HEAD")


@pytest.mark.timeout(300)
def test_compute_and_read_survive_transient_faults(faulty, proxy, reference, dask_client):
    url, opts, s3, bucket = faulty
    ref_version, ref = reference
    # Every fault kind meets every request type: the first four distinct PUTs, GETs, LISTs and
    # HEADs get 503, 500, reset and stall in turn; then 3% of requests fail 1-2 times in a row;
    # one chunk PUT and one chunk GET fail 3 times in a row. The driver and the Dask workers go
    # through the proxy.
    proxy.set_rules(Rule("500", ops=("PUT",), path=r"/c/", times=3, min_times=3, first=1, rate=0),
                    Rule("503", ops=("GET",), path=r"/c/", times=3, min_times=3, first=1, rate=0),
                    *(Rule(KINDS, ops=(op,), times=2, rate=0.02, first=4, seed=i) for i, op in enumerate(OPS)))
    store = featstore.open_store(url, storage_options=opts)
    v = store.compute("flt/set", model=TinyA(), dataset=VectorData(N), keep=["target"], outputs=OUT,
                      batch_size=32, samples_per_shard=SPP, client=dask_client, options=QUIET)
    store.tag(v, "best")
    store.untag("flt/set", "best")  # an existence check: HEAD requests
    compute = (proxy.n_faults, proxy.retries_seen, sum(proxy.requests.values()))
    got = {k: t.numpy() for k, t in store.open("flt/set").load().items()}
    # The DataLoader workers' own reads, faulted afresh (every chunk object was read above, and
    # a request identity is faulted by its rule once): the first 6 chunk GETs of the workers
    # fail 1-2 times, then 20% of them.
    proxy.set_rules(Rule(KINDS, ops=("GET",), path=r"/c/", times=2, first=6, rate=0.2, seed=11))
    before, clients_before = proxy.n_faults, proxy.clients.copy()
    got_loader = read_all_through_loader(store.open("flt/set"), workers=2)
    loader_faults = proxy.n_faults - before
    # The workers (forked: the parent only read metadata, through s3fs) GET through obstore.
    loader_clients = {c for (op, path, c) in proxy.clients - clients_before if op == "GET" and "/c/" in path}
    print(f"\n[faults] compute+tag: {compute[0]} faults, {compute[1]} retries, {compute[2]} requests; "
          f"DataLoader workers' reads: {loader_faults} faults; total {proxy.n_faults} faults "
          f"{sorted(proxy.faults.items())}, {proxy.retries_seen} retries, {sum(proxy.requests.values())} requests")
    assert {(k, op) for k in KINDS for op in OPS} <= set(proxy.faults)  # HEAD included
    assert compute[0] >= 4 * len(OPS) + 3 + 3  # the first four of each type, and the two triples
    assert compute[1] == compute[0]  # every fault was retried (and then the request succeeded)
    assert loader_faults >= 6 and proxy.retries_seen == proxy.n_faults
    assert loader_clients == {"obstore"}
    assert v.id == ref_version.id
    assert [s.digests for s in stored(v).shard_receipts()] == [s.digests for s in stored(ref_version).shard_receipts()]
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k])
        np.testing.assert_array_equal(got_loader[k], ref[k])  # the workers' batches equal load()
    proxy.set_rules()
    assert v.verify() == []
    assert len(manifests(s3, bucket)) == 1


@pytest.mark.timeout(120)
@both_servers
def test_lost_reply_of_conditional_write_is_our_success(faulty, proxy):
    url, opts, s3, bucket = faulty
    storage = Storage(url, opts)
    proxy.set_rules(Rule("lost_reply", ops=("PUT",), path=r"/mine\.json\?", times=1))
    stored = storage.create_json("x/mine.json", {"v": 1})
    attempts = {k[1]: n for k, n in proxy.attempts.items() if k[0] == "PUT"}
    print(f"\n[lost-reply] faults={dict(proxy.faults)} forwarded PUTs={proxy.forwarded['PUT']} attempts={attempts}")
    assert proxy.faults[("lost_reply", "PUT")] == 1
    probes = sum(n for path, n in attempts.items() if f"/{PROBE_FOLDER}/" in path)
    assert probes == 2 and len(attempts) == 2  # this process's first create on the store probed it
    # the first PUT landed, the retry met If-None-Match: 412 (whatever the server's reply body)
    assert proxy.forwarded["PUT"] - probes == 2 and attempts[f"/{bucket}/feats/x/mine.json"] == 2
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
@both_servers
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
    # The DataLoader workers' chunk GETs (obstore) first: the typed error after the budget. (The
    # zarr reads of load() below go on in the background after it raised: they come last.)
    with pytest.raises(StoreUnavailable, match="cannot reach the store") as err:
        read_all_through_loader(featstore.open_store(url, storage_options=opts).open(f"flt/set@{v.id}"), workers=2)
    chunk = {k[1]: n for k, n in proxy.attempts.items() if "/c/" in k[1]}
    clients = {c for (op, path, c) in proxy.clients if op == "GET" and "/c/" in path}
    print(f"\n[persistent] DataLoader workers' chunk GET attempts per request={sorted(chunk.values())} by {clients}")
    # Each failed after exactly the budget; a worker's request still retrying when the other
    # worker's error stopped the loader has fewer.
    assert clients == {"obstore"} and max(chunk.values()) == S3_MAX_ATTEMPTS
    assert all(n <= S3_MAX_ATTEMPTS for n in chunk.values()) and "FEATSTORE_S3_CLIENT" in str(err.value)
    proxy.reset_counts()
    with pytest.raises(StoreUnavailable):
        featstore.open_store(url, storage_options=opts).open(f"flt/set@{v.id}").load()
    per_request = max(n for k, n in proxy.attempts.items() if "/c/" in k[1])
    print(f"\n[persistent] manifest PUT attempts={commit_attempts}; chunk GET attempts per request="
          f"{per_request}, faults={proxy.n_faults}")
    assert per_request == S3_MAX_ATTEMPTS


#: s3fs's own retries of throttling and connection errors, around botocore's (s3fs's default).
S3FS_RETRIES = 5
#: The clients a Storage reads with: obstore (the default), s3fs (FEATSTORE_S3_CLIENT=s3fs).
CLIENTS = ("obstore", "s3fs")


def with_retries(opts: dict, attempts: int, key: str = "total_max_attempts") -> dict:
    """``opts`` with the user's own botocore retry policy (``max_attempts``: botocore's client
    config counts retries there, so ``attempts`` + 1 attempts)."""
    return {**opts, "config_kwargs": {**opts["config_kwargs"], "retries": {"mode": "standard", key: attempts}}}


def _read_attempts(proxy, url: str, opts: dict, rule: Rule, client: str = "obstore",
                   ) -> tuple[BaseException, int]:
    """Read one object with ``rule`` in force: (the error raised, attempts of that request),
    checking that ``client`` sent them."""
    storage = Storage(url, {**opts, "skip_instance_cache": True})
    storage.write_bytes("x/obj", b"payload")
    proxy.reset_counts()
    proxy.set_rules(rule)
    try:
        storage.read_bytes("x/obj")
    except BaseException as exc:  # noqa: BLE001 - returned for the test to check
        error = exc
    else:
        error = AssertionError("the read succeeded through a persistent fault")
    proxy.set_rules()
    assert {c for (op, path, c) in proxy.clients if op == "GET" and path.endswith("/x/obj")} == {client}
    return error, max(n for k, n in proxy.attempts.items() if k[1].endswith("/x/obj"))


@pytest.mark.timeout(120)
def test_persistent_503_and_reset_end_in_store_unavailable_within_the_budget(faulty, proxy, monkeypatch):
    """The documented budget (README, docs/reliability.md): a persistent 503 or connection
    reset fails as StoreUnavailable after exactly the attempts of the policy through obstore
    (featstore's reads), and after at most s3fs's retries x botocore's attempts through s3fs
    (writes, listings, the zarr path, FEATSTORE_S3_CLIENT=s3fs). The s3fs 503 case runs with the
    user's own botocore budget of 2 attempts (featstore's default 5 makes it 25 attempts, ~36 s:
    measured, not run in CI); the arithmetic is the same."""
    url, opts, _, bucket = faulty
    user = with_retries(opts, 2)
    rule_503 = Rule("503", ops=("GET",), path=r"/x/obj", times=None)
    rule_reset = Rule("reset", ops=("GET",), path=r"/x/obj", times=None)
    error, attempts = _read_attempts(proxy, url, user, rule_503)
    print(f"\n[persistent] obstore: 503 with 2 attempts: {attempts} attempts, {type(error).__name__}")
    assert isinstance(error, StoreUnavailable) and "cannot reach the store" in str(error)
    assert attempts == 2  # exactly the user's budget: obstore adds no retries of its own
    error, attempts = _read_attempts(proxy, url, opts, rule_reset)
    print(f"[persistent] obstore: reset with featstore's policy: {attempts} attempts, {type(error).__name__}")
    assert isinstance(error, StoreUnavailable) and attempts == S3_MAX_ATTEMPTS
    # A stall past the read timeout: each attempt gives up after the timeout, not the stall: the
    # error comes with no stall waited out to its end (STALL is 15 read timeouts; the proxy counts).
    error, attempts = _read_attempts(proxy, url, user, Rule("timeout", ops=("GET",), path=r"/x/obj", times=None))
    waited_out = sum(n for k, n in proxy.waited_out.items() if k[1] == f"/{bucket}/feats/x/obj")
    print(f"[persistent] obstore: stall with 2 attempts: {attempts} attempts, {waited_out} stalls waited out, "
          f"{type(error).__name__}")
    assert isinstance(error, StoreUnavailable) and "cannot reach the store" in str(error)
    assert attempts == 2 and waited_out == 0  # the budget, each attempt ended by the read timeout

    monkeypatch.setenv("FEATSTORE_S3_CLIENT", "s3fs")
    error, attempts = _read_attempts(proxy, url, user, rule_503, client="botocore")
    print(f"[persistent] s3fs: 503 with 2 botocore attempts: {attempts} attempts, {type(error).__name__}")
    assert isinstance(error, StoreUnavailable) and "cannot reach the store" in str(error)
    assert attempts == S3FS_RETRIES * 2  # the user's budget, times s3fs's own retries: bounded
    error, attempts = _read_attempts(proxy, url, opts, rule_reset, client="botocore")
    print(f"[persistent] s3fs: reset with featstore's policy: {attempts} attempts, {type(error).__name__}")
    assert isinstance(error, StoreUnavailable)
    assert S3_MAX_ATTEMPTS <= attempts <= S3FS_RETRIES * S3_MAX_ATTEMPTS


@pytest.mark.timeout(120)
@pytest.mark.parametrize("client", CLIENTS)
def test_users_own_retry_settings_win(faulty, proxy, monkeypatch, client):
    """featstore fills in its retry policy only where the user set none: config_kwargs retries,
    or AWS_MAX_ATTEMPTS / AWS_RETRY_MODE in the environment, win, through either client (counted
    on a persistent 500, which s3fs does not retry around botocore)."""
    url, opts, _, _ = faulty
    monkeypatch.setenv("FEATSTORE_S3_CLIENT", client)
    sender = "obstore" if client == "obstore" else "botocore"
    rule = Rule("500", ops=("GET",), path=r"/x/obj", times=None)
    # featstore's own policy (5 attempts) is counted on persistent 500s by
    # test_persistent_failure_is_store_unavailable_and_commits_nothing, for both clients
    mine = with_retries(opts, 3)
    _, attempts = _read_attempts(proxy, url, mine, rule, sender)
    assert attempts == 3  # config_kwargs total_max_attempts
    _, attempts = _read_attempts(proxy, url, with_retries(opts, 1, "max_attempts"), rule, sender)
    assert attempts == 2  # config_kwargs max_attempts: botocore counts retries there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    assert "retries" not in Storage(url, opts)._options["config_kwargs"]
    _, attempts = _read_attempts(proxy, url, opts, rule, sender)
    assert attempts == 2  # the environment
