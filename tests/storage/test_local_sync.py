"""``LocalStorage.sync`` while another writer of the same folder renames its temp files into
place: the walk lists a ``*.partial`` file that is gone by the time it is opened (seen in CI as
a concurrent same-fingerprint commit failing with FileNotFoundError)."""

from __future__ import annotations

import threading

from featstore.storage import LocalStorage


def test_sync_survives_a_concurrent_writer_renaming_its_temp_files(tmp_path):
    storage = LocalStorage(str(tmp_path / "store"))
    storage.check_reachable()
    storage.write_bytes("v/manifest.json", b"{}")
    stop = threading.Event()
    writes = 0

    def writer() -> None:
        nonlocal writes
        while not stop.is_set():  # each write is a temp file renamed over the same key
            storage.write_bytes("v/manifest.json", b"x" * 4096)
            writes += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(1000):
            storage.sync("v")
    finally:
        stop.set()
        thread.join()
    assert writes > 0
    assert storage.read_bytes("v/manifest.json") == b"x" * 4096
