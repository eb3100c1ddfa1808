"""Receipts (one per finished shard, compacted into runs by the tasks) and the shard records of
schema 2: what a resume and the commit read to know which shards are done.
"""


from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from itertools import groupby

from featstore.errors import CorruptChunk
from featstore._json import load_json
from featstore.format import RECORDS_PER_OBJECT, Manifest, ShardReceipt, ShardRecords, decode_records, encode_records
from featstore.format import ReceiptRun
from featstore.storage import Storage
from featstore.versions._keys import RECEIPTS, RECORDS, RUN_EVERY, concurrently, receipt_key


# -- receipts ----------------------------------------------------------------------------------
def write_receipt(storage: Storage, vkey: str, receipt: ShardReceipt) -> None:
    """Record a finished shard; written only once every array of the shard is stored."""
    storage.write_json(receipt_key(vkey, receipt.index), receipt.to_json())


def run_key(vkey: str, first: int, last: int) -> str:
    """The key of a run object holding the receipts of shards ``first..last`` (all of them)."""
    return f"{vkey}/{RECEIPTS}/run-{first:06d}-{last:06d}.json"


def contiguous_runs(indices: Iterable[int]) -> list[tuple[int, int]]:
    """``[(first, last), ...]`` of the maximal runs of consecutive shard indices.

    >>> contiguous_runs([5, 1, 2, 3, 7])
    [(1, 3), (5, 5), (7, 7)]
    """
    # within a run, a shard's index minus its position in the sorted list is constant
    runs = groupby(enumerate(sorted(set(indices))), key=lambda pos_i: pos_i[1] - pos_i[0])
    return [(shards[0], shards[-1]) for shards in ([i for _, i in run] for _, run in runs)]


def compact_receipts(storage: Storage, vkey: str, receipts: Sequence[ShardReceipt]) -> None:
    """Replace the per-shard receipts of ``receipts`` by one run object per contiguous run.

    The run is written first and the per-shard objects deleted after (one request per 1,000
    on S3), so a crash in between leaves both forms, which read the same. A resume then lists
    a few run objects instead of one object per shard.
    """
    by_index = {r.index: r for r in receipts}
    for first, last in contiguous_runs(by_index):
        if last == first:
            continue
        run = ReceiptRun(tuple(by_index[i] for i in range(first, last + 1)))
        storage.write_json(run_key(vkey, first, last), run.to_json())
        storage.delete_many([receipt_key(vkey, i) for i in range(first, last + 1)])


class ReceiptRuns:
    """Folds per-shard receipts into run objects every :data:`RUN_EVERY` finished shards (the
    driver feeds it as shard tasks finish): a resume of a 125,000-shard version then lists
    ~500 objects, not 125,000."""

    def __init__(self, storage: Storage, vkey: str) -> None:
        self.storage, self.vkey = storage, vkey
        self.pending: list[ShardReceipt] = []

    def add(self, receipts: Iterable[ShardReceipt]) -> None:
        self.pending.extend(receipts)
        if len(self.pending) >= RUN_EVERY:
            compact_receipts(self.storage, self.vkey, self.pending)
            self.pending = []


#: The name of a receipt object: one shard's (``000042.json``) or a run's (:func:`run_key`).
_RECEIPT_NAME = re.compile(r"(\d+)\.json|run-(\d+)-(\d+)\.json")


def _receipt_objects(storage: Storage, vkey: str) -> dict[str, range]:
    """``{object key: the shards it holds}`` from one listing of the receipts folder (no GETs)."""
    out = {}
    for entry in storage.list_dirs(f"{vkey}/{RECEIPTS}"):
        if got := _RECEIPT_NAME.fullmatch(entry):
            first, last = int(got[1] or got[2]), int(got[1] or got[3])
            if first <= last:
                out[f"{vkey}/{RECEIPTS}/{entry}"] = range(first, last + 1)
    return out


def finished_shards(storage: Storage, vkey: str) -> set[int]:
    """Shards with a receipt, by name alone: one LIST page per 1,000 objects, no GETs."""
    return {i for shards in _receipt_objects(storage, vkey).values() for i in shards}


def forget_receipts(storage: Storage, vkey: str, indices: Iterable[int]) -> None:
    """Remove the receipts of ``indices`` (their shards must be computed again), from per-shard
    objects and from run objects alike (a run keeps its other shards' receipts, per shard)."""
    drop = set(indices)
    if not drop:
        return
    for key, shards in _receipt_objects(storage, vkey).items():
        if drop.isdisjoint(shards):
            continue
        obj = storage.read_json(key) if len(shards) > 1 else None
        if obj is not None:
            for r in ReceiptRun.from_json(obj, storage.child_url(key)).receipts:
                if r.index not in drop:
                    write_receipt(storage, vkey, r)
        storage.delete(key)


def read_many(storage: Storage, keys: Sequence[str]) -> dict[str, bytes | None]:
    """Read many small metadata objects concurrently (the latency of S3 GETs overlaps)."""
    return dict(zip(keys, concurrently(lambda k: storage.read_bytes(k, metadata=True), keys), strict=True))


def read_receipts(storage: Storage, vkey: str, indices: Iterable[int] | None = None) -> dict[int, ShardReceipt]:
    """The receipts of ``indices`` (None: every receipt there is) that exist, by shard index.

    One listing finds which objects hold them; only those are read, concurrently.
    """
    objects = _receipt_objects(storage, vkey)
    wanted = None if indices is None else set(indices)
    keys = [k for k, shards in objects.items() if wanted is None or not wanted.isdisjoint(shards)]
    out: dict[int, ShardReceipt] = {}
    for key, data in read_many(storage, keys).items():
        if data is None:
            continue  # compacted into a run between the listing and the read: the run has it
        where = storage.child_url(key)
        obj = load_json(data, where)
        got = ReceiptRun.from_json(obj, where).receipts if "receipts" in obj else (ShardReceipt.from_json(obj, where),)
        out.update((r.index, r) for r in got if wanted is None or r.index in wanted)
    missing = [] if wanted is None else sorted(wanted - set(out))
    if missing and any(i in shards for shards in objects.values() for i in missing):
        # A per-shard receipt was compacted after our listing: read again (rare, bounded).
        out.update(read_receipts(storage, vkey, missing))
    return out


# -- shard records (schema 2) ------------------------------------------------------------------
def records_key(vkey: str, k: int, digest: str) -> str:
    """The key of records object ``k`` (content-addressed by its sha256)."""
    return f"{vkey}/{RECORDS}/{k:06d}-{digest[:16]}.bin"


def write_records(storage: Storage, vkey: str, receipts: Sequence[ShardReceipt],
                  fields: Sequence[str]) -> ShardRecords:
    """Store every shard's digests and statistics as fixed-width records; return where."""
    blobs = encode_records(receipts, list(fields), RECORDS_PER_OBJECT)
    digests = [hashlib.sha256(b).hexdigest() for b in blobs]
    jobs = [(records_key(vkey, k, d), b) for k, (d, b) in enumerate(zip(digests, blobs, strict=True))]
    concurrently(lambda kb: storage.write_bytes(*kb), jobs)
    return ShardRecords(tuple(fields), RECORDS_PER_OBJECT, tuple(digests))


def read_records(storage: Storage, vkey: str, manifest: Manifest, ref: str) -> list[ShardReceipt]:
    """Every shard's receipt of a schema 2 version, from its records objects (checksummed)."""
    rec = manifest.records
    assert rec is not None
    keys = [records_key(vkey, k, d) for k, d in enumerate(rec.objects)]
    got = read_many(storage, keys)
    out: list[ShardReceipt] = []
    for k, key in enumerate(keys):
        data, where = got[key], storage.child_url(key)
        if data is None or hashlib.sha256(data).hexdigest() != rec.objects[k]:
            raise CorruptChunk.damaged(ref, RECORDS, "/".join(key.rsplit("/", 2)[-2:]),
                                       "is missing" if data is None else "fails its sha256")
        out += decode_records(data, rec, k * rec.per_object, manifest.layout, where,
                              None if manifest.views is None else manifest.views.count)
    return out
