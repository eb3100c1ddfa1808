"""One contract for :class:`featstore.storage.Storage`, run against every backend featstore
supports: the local filesystem, fsspec's in-memory filesystem and S3 (the moto server, and a real
SeaweedFS server, whose replies are not AWS's: its 412 to a conditional create has no
``<Condition>`` element, for one).

Everything above Storage (claims, commits, tags) relies on exactly these properties, so a new
backend is supported when this class passes against it.
"""

from __future__ import annotations

import threading
import uuid

import pytest

from featstore.errors import FeatstoreError, StoreConflict
from featstore.storage._backends import Storage

from tests.servers import new_bucket


@pytest.fixture(params=["local", "memory", "s3", "s3-s3fs", "seaweedfs", "seaweedfs-s3fs"])
def storage(request, tmp_path, monkeypatch):
    """Each S3 server twice: reads through obstore (the default) and through s3fs
    (FEATSTORE_S3_CLIENT); "s3" is moto."""
    if request.param == "local":
        yield Storage(str(tmp_path / "root"))
    elif request.param == "memory":
        s = Storage(f"memory://contract-{uuid.uuid4().hex[:12]}")
        yield s
        s.delete("", recursive=True)
    else:
        server, _, client = request.param.partition("-")
        monkeypatch.setenv("FEATSTORE_S3_CLIENT", client or "obstore")
        endpoint = request.getfixturevalue("moto_endpoint" if server == "s3" else f"{server}_endpoint")
        url = f"s3://{new_bucket(endpoint)}/root"
        s = Storage(url, {"endpoint_url": endpoint})
        assert (s._s3_getter() is None) == (client == "s3fs")  # the client under test
        yield s


class LostReplyStorage(Storage):
    """The backend applies the conditional write but its reply is lost, so the caller sees
    "exists" (icechunk#2099). A real backend cannot be made to do this on demand: the one mock."""

    def create(self, key: str, data: bytes) -> bool:
        super().create(key, data)
        return False


def test_missing_key_reads_as_absent(storage):
    assert storage.read_bytes("no/such.json") is None
    assert storage.read_json("no/such.json") is None
    assert not storage.exists("no/such.json")
    assert storage.list_dirs("no") == [] and storage.find("no") == []


def test_write_read_overwrite(storage):
    storage.write_bytes("a/b.bin", b"one")
    assert storage.read_bytes("a/b.bin") == b"one"
    storage.write_bytes("a/b.bin", b"two")
    assert storage.read_bytes("a/b.bin") == b"two"
    storage.write_json("a/c.json", {"x": [1, 2]})
    assert storage.read_json("a/c.json") == {"x": [1, 2]}


def test_create_if_absent_has_exactly_one_winner_among_8_threads(storage):
    barrier = threading.Barrier(8)
    results: dict[int, bool] = {}

    def race(i: int) -> None:
        barrier.wait()
        results[i] = storage.create("race/key.json", f"writer {i}".encode())

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, won in results.items() if won]
    assert len(results) == 8 and len(winners) == 1
    assert storage.read_bytes("race/key.json") == f"writer {winners[0]}".encode()


def test_lost_reply_is_recognised_by_its_write_id(storage):
    lossy = LostReplyStorage(storage.url, storage._options)
    stored = lossy.create_json("v/manifest.json", {"id": "mine"})
    assert stored["id"] == "mine" and storage.read_json("v/manifest.json") == stored
    with pytest.raises(StoreConflict):  # another writer's object is still a conflict
        lossy.create_json("v/manifest.json", {"id": "theirs"})
    with pytest.raises(StoreConflict):
        storage.create_json("v/manifest.json", {"id": "theirs"})


def test_listing_after_write_is_never_stale(storage):
    other = storage.reopen()  # another process's view of the same store
    assert storage.list_dirs("l") == []
    storage.write_json("l/a.json", {})
    assert other.list_dirs("l") == ["a.json"] and storage.list_dirs("l") == ["a.json"]
    other.write_json("l/b/c.json", {})
    assert storage.list_dirs("l") == ["a.json", "b"]
    assert storage.find("l") == ["l/a.json", "l/b/c.json"]
    assert set(storage.find_modified("l")) == {"l/a.json", "l/b/c.json"}
    assert other.exists("l/b/c.json") and storage.read_json("l/b/c.json") == {}


def test_delete_object_and_folder(storage):
    for k in ("d/x.json", "d/y/z.json", "e.json"):
        storage.write_json(k, {"k": k})
    storage.delete("d/x.json")
    assert storage.read_json("d/x.json") is None and storage.exists("d/y/z.json")
    storage.delete("d", recursive=True)
    assert storage.find("d") == [] and storage.read_json("e.json") == {"k": "e.json"}
    storage.delete("d/never-there.json")  # deleting what is gone is not an error


@pytest.mark.parametrize("key", ["../x", "a/../../x", "/etc/passwd", "a\\..\\x", "a/../b"])
def test_keys_cannot_leave_the_root(storage, key):
    with pytest.raises(FeatstoreError, match="unsafe key"):
        storage.path(key)
    with pytest.raises(FeatstoreError):
        storage.write_bytes(key, b"x")
    assert storage.find("") == []


def test_ranges(storage):
    storage.write_bytes("r/obj", b"0123456789")
    assert storage.read_bytes("r/obj") == b"0123456789"
    assert storage.read_range("r/obj", 0, 3) == b"012"
    assert storage.read_range("r/obj", -4) == b"6789"  # the suffix, one request
    assert storage.read_range("r/obj", 5) == b"56789"
    assert storage.read_range("r/obj", 8, 100) == b"89"  # past the end: what there is
    assert storage.read_range("r/obj", 3, 7) == b"3456"
    assert storage.read_range("r/nope", 0, 3) is None and storage.read_range("r/nope", -3) is None
