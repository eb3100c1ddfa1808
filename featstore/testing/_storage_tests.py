"""The storage contract as a class a backend's tests subclass, as zarr's ``StoreTests`` is.

Everything above :class:`~featstore.storage.Storage` (claims, commits, tags, gc) relies on
exactly these properties, so a new backend is supported when this class passes against it::

    import pytest
    from featstore.storage import Storage
    from featstore.testing import StorageTests

    class TestMyBackend(StorageTests):
        @pytest.fixture
        def storage(self, tmp_path):
            return Storage("myfs://bucket/root")

Needs pytest (the ``test`` extra); nothing else.
"""

from __future__ import annotations

import threading

import pytest

from featstore.errors import FeatstoreError, StoreConflict
from featstore.storage import Storage


def lost_reply(storage: Storage) -> Storage:
    """The same store through a backend that applies a conditional write but loses its reply,
    so the caller sees "exists" (icechunk#2099). A real backend cannot be made to do this on
    demand: the one mock of the contract."""

    def create(self: Storage, key: str, data: bytes) -> bool:
        type(storage).create(self, key, data)
        return False

    lossy = type(f"LostReply{type(storage).__name__}", (type(storage),), {"create": create})
    made: Storage = lossy(storage.url, storage._options)  # a class made with type(): Any to mypy
    return made


class StorageTests:
    """The contract. A subclass provides the ``storage`` fixture: an empty store root."""

    @pytest.fixture
    def storage(self) -> Storage:
        raise NotImplementedError("a StorageTests subclass defines the `storage` fixture (an empty store root)")

    def test_missing_key_reads_as_absent(self, storage: Storage) -> None:
        assert storage.read_bytes("no/such.json") is None
        assert storage.read_json("no/such.json") is None
        assert not storage.exists("no/such.json")
        assert storage.list_dirs("no") == [] and storage.find("no") == []

    def test_write_read_overwrite(self, storage: Storage) -> None:
        storage.write_bytes("a/b.bin", b"one")
        assert storage.read_bytes("a/b.bin") == b"one"
        storage.write_bytes("a/b.bin", b"two")
        assert storage.read_bytes("a/b.bin") == b"two"
        assert bytes(storage.read_buffer("a/b.bin") or b"") == b"two"  # the reader's copy-free GET
        assert storage.read_buffer("a/none.bin") is None
        storage.write_json("a/c.json", {"x": [1, 2]})
        assert storage.read_json("a/c.json") == {"x": [1, 2]}

    def test_create_if_absent_has_exactly_one_winner_among_8_threads(self, storage: Storage) -> None:
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

    def test_lost_reply_is_recognised_by_its_write_id(self, storage: Storage) -> None:
        lossy = lost_reply(storage)
        stored = lossy.create_json("v/manifest.json", {"id": "mine"})
        assert stored["id"] == "mine" and storage.read_json("v/manifest.json") == stored
        with pytest.raises(StoreConflict):  # another writer's object is still a conflict
            lossy.create_json("v/manifest.json", {"id": "theirs"})
        with pytest.raises(StoreConflict):
            storage.create_json("v/manifest.json", {"id": "theirs"})

    def test_listing_after_write_is_never_stale(self, storage: Storage) -> None:
        other = storage.reopen()  # another process's view of the same store
        assert storage.list_dirs("l") == []
        storage.write_json("l/a.json", {})
        assert other.list_dirs("l") == ["a.json"] and storage.list_dirs("l") == ["a.json"]
        other.write_json("l/b/c.json", {})
        assert storage.list_dirs("l") == ["a.json", "b"]
        assert storage.find("l") == ["l/a.json", "l/b/c.json"]
        assert set(storage.find_modified("l")) == {"l/a.json", "l/b/c.json"}
        assert other.exists("l/b/c.json") and storage.read_json("l/b/c.json") == {}

    def test_delete_object_and_folder(self, storage: Storage) -> None:
        for k in ("d/x.json", "d/y/z.json", "e.json"):
            storage.write_json(k, {"k": k})
        storage.delete("d/x.json")
        assert storage.read_json("d/x.json") is None and storage.exists("d/y/z.json")
        storage.delete("d", recursive=True)
        assert storage.find("d") == [] and storage.read_json("e.json") == {"k": "e.json"}
        storage.delete("d/never-there.json")  # deleting what is gone is not an error
        storage.write_json("m/1.json", {})
        storage.write_json("m/2.json", {})
        storage.delete_many(["m/1.json", "m/2.json", "m/never-there.json"])
        assert storage.find("m") == []

    @pytest.mark.parametrize("key", ["../x", "a/../../x", "/etc/passwd", "a\\..\\x", "a/../b"])
    def test_keys_cannot_leave_the_root(self, storage: Storage, key: str) -> None:
        with pytest.raises(FeatstoreError, match="unsafe key"):
            storage.path(key)
        with pytest.raises(FeatstoreError):
            storage.write_bytes(key, b"x")
        assert storage.find("") == []

    def test_ranges(self, storage: Storage) -> None:
        storage.write_bytes("r/obj", b"0123456789")
        assert storage.read_bytes("r/obj") == b"0123456789"
        assert storage.read_range("r/obj", 0, 3) == b"012"
        assert storage.read_range("r/obj", -4) == b"6789"  # the suffix, one request
        assert storage.read_range("r/obj", 5) == b"56789"
        assert storage.read_range("r/obj", 8, 100) == b"89"  # past the end: what there is
        assert storage.read_range("r/obj", 3, 7) == b"3456"
        assert storage.read_range("r/nope", 0, 3) is None and storage.read_range("r/nope", -3) is None

    def test_a_copy_for_another_process_reopens_the_same_root(self, storage: Storage) -> None:
        import copy

        storage.write_json("p.json", {"p": 1})
        # what a worker process receives: the state pickling carries (URL and options), reopened
        again = copy.deepcopy(storage)
        assert type(again) is type(storage) and again.read_json("p.json") == {"p": 1}
