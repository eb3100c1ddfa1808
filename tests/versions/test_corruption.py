"""Flipped bits, missing, truncated and empty chunk objects are detected, never read as data."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import featstore
from featstore.versions._digests import DIGEST_FIELD
from featstore.versions import stored
from featstore import ComputeOptions, CorruptChunk
from featstore.cli import main as cli

from tests.helpers import TinyA, VectorData, write_version

FLIPS = 120  # random single-bit flips per run (FEATSTORE_FLIPS overrides for a longer local run)
LOADER_FLIPS = 60  # through 2 DataLoader workers: 60 on local disk, 20 on S3


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine") / "store"
    store = featstore.open_store(root)
    v = write_version(store, "c/set", n=256, samples_per_shard=64)
    return root, v.id


@pytest.fixture
def damaged(pristine, tmp_path):
    """A private copy of the pristine store, to damage."""
    root, vid = pristine
    shutil.copytree(root, tmp_path / "store")
    store = featstore.open_store(tmp_path / "store")
    v = store.open(f"c/set@{vid}")
    return store, v, Path(stored(v).storage.path(stored(v).key))


def shard_objects(base: Path) -> list[Path]:
    return sorted(p for p in base.glob("*/c/**/*") if p.is_file())


def flip(f: Path, rng: random.Random) -> tuple[bytes, int, int]:
    """Flip one random bit of ``f``; return the original bytes, the byte and the bit."""
    data = bytearray(f.read_bytes())
    pos, bit = rng.randrange(len(data)), rng.randrange(8)
    data[pos] ^= 1 << bit
    original = f.read_bytes()
    f.write_bytes(bytes(data))
    return original, pos, bit


def read_error(action, *args) -> Exception | None:
    """The exception ``action(*args)`` raises, or None: a flip that reads back without one is a miss."""
    try:
        action(*args)
    except Exception as exc:  # noqa: BLE001 - the test classifies it
        return exc
    return None


def _decode_error(data: bytes, fmt, rows: int, ref) -> Exception | None:
    """What the reader's own shard decoder makes of ``data`` (the whole object, in memory): the
    path of ``store.dataset`` (a local uncompressed shard is first checked as mapped)."""
    from featstore.format._shard_decoder import decode_shard_rows, mapped_chunks

    try:
        if not fmt.compressed:
            n = -(-rows // fmt.chunk_rows)
            if mapped_chunks(data, fmt, n, range(n), ref) is not None:
                return None
        decode_shard_rows(data, fmt, 0, rows, None, ref)
    except Exception as exc:  # noqa: BLE001 - the test classifies it
        return exc
    return None


@pytest.mark.parametrize("field", ["target", "features"])
def test_every_single_bit_flip_of_one_shard_object_is_detected(damaged, field):
    """Every bit of one small shard object (a zstd one, ``target``, ~2,400 bits; an uncompressed
    one, ``features``, ~8,900 bits), flipped one at a time: each flip is a CorruptChunk naming
    that object from the reader's decoder. In memory, so the cost stays about a second."""
    from featstore.format._shard_decoder import ChunkRef, shard_format

    store, v, base = damaged
    rel = next(f.relative_to(base).as_posix() for f in shard_objects(base) if f.relative_to(base).parts[0] == field)
    assert rel in (f"{field}/c/0", f"{field}/c/0/0")
    data = (base / rel).read_bytes()
    fmt = shard_format(stored(v).array(field))
    assert fmt is not None and fmt.compressed == (v.manifest.arrays[field].compression != "none")
    ref = ChunkRef(v.ref, field, rel)
    assert _decode_error(data, fmt, 64, ref) is None  # the object as stored decodes
    missed = []
    for pos in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[pos] ^= 1 << bit
            err = _decode_error(bytes(flipped), fmt, 64, ref)
            if not (isinstance(err, CorruptChunk) and err.chunk == rel and err.array == field):
                missed.append(f"byte {pos} bit {bit}: {err!r}")
    assert missed == [], f"{len(missed)} of {8 * len(data)} flips of {rel} not detected: {missed[:5]}"


def test_random_bit_flips_over_every_object_are_detected(damaged):
    """FLIPS random single-bit flips over all 12 shard objects, read through the zarr path
    (``read_rows``); ``verify()`` on every 20th names exactly the flipped object."""
    store, v, base = damaged
    files = shard_objects(base)
    assert len(files) == 4 * 4  # 3 arrays and the input digests x 4 shards, one object each
    rng = random.Random(1234)
    flips = int(os.environ.get("FEATSTORE_FLIPS", FLIPS))
    wrong: list[str] = []  # flips read back silently, or with another error, or naming another object
    hit: set[str] = set()
    for i in range(flips):
        f = rng.choice(files)
        original, pos, bit = flip(f, rng)
        rel = f.relative_to(base).as_posix()
        field, shard = rel.split("/")[0], int(rel.split("/")[2])
        fresh = store.open(f"c/set@{v.id}")  # no cached decoded data
        err = read_error(stored(fresh).read_rows, field, shard * 64, shard * 64 + 64)
        if not (isinstance(err, CorruptChunk) and err.array == field and err.chunk == rel and v.id in err.version
                and rel in str(err) and "featstore verify" in str(err)):
            wrong.append(f"{rel} byte {pos} bit {bit}: {err!r}")
        if i % 20 == 0:  # the whole-version check names exactly that object
            problems = fresh.verify()
            if not (len(problems) == 1 and problems[0].startswith(rel)):
                wrong.append(f"verify after {rel} byte {pos} bit {bit}: {problems}")
        hit.add(rel)
        f.write_bytes(original)
    assert wrong == []
    assert len(hit) == len(files) or flips < 60  # every object was damaged at least once
    assert store.open(f"c/set@{v.id}").verify() == []  # restored: clean again


def _flips_through_loader(version, objects: dict[str, callable], flips: int, seed: int) -> list[str]:
    """Flip bits in stored shard objects and read a whole epoch through ``store.dataset`` with 2
    persistent DataLoader workers (the reader's own shard decoder, in worker processes) after
    each; return the flips that were not a CorruptChunk naming the object."""
    ds = version.dataset(batch_size=32, seed=0)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True, timeout=60)
    clean = sorted(torch.cat([b["index"] for b in loader]).tolist())
    assert clean == list(range(len(version)))
    rng = random.Random(seed)
    wrong = []
    for _ in range(flips):
        rel = rng.choice(sorted(objects))
        get, put = objects[rel]
        original = get()
        data = bytearray(original)
        pos, bit = rng.randrange(len(data)), rng.randrange(8)
        data[pos] ^= 1 << bit
        put(bytes(data))
        err = read_error(list, loader)
        # The error crosses the worker boundary: DataLoader rebuilds it from its message, and
        # CorruptChunk takes its fields back from there.
        if not (isinstance(err, CorruptChunk) and err.chunk == rel and rel in str(err) and version.id in err.version):
            wrong.append(f"{rel} byte {pos} bit {bit}: {err!r}")
        put(original)
    assert sorted(torch.cat([b["index"] for b in loader]).tolist()) == clean  # restored: reads again
    return wrong


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".flip")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_bit_flips_through_dataloader_workers_local(damaged):
    store, v, base = damaged
    # Replaced whole, as any tool rewrites a file: the reader maps local objects, and truncating
    # a file in place under a live map is a SIGBUS in whichever worker still reads it.
    # the loader reads no input digests (a source= join does; verify checks them, above)
    objects = {f.relative_to(base).as_posix(): (f.read_bytes, lambda b, f=f: _replace(f, b))
               for f in shard_objects(base) if f.relative_to(base).parts[0] != DIGEST_FIELD}
    flips = int(os.environ.get("FEATSTORE_FLIPS", LOADER_FLIPS))
    assert _flips_through_loader(store.open(f"c/set@{v.id}"), objects, flips, seed=99) == []


def test_bit_flips_through_dataloader_workers_s3(s3_url, pristine):
    url, opts = s3_url
    root, vid = pristine
    store = featstore.open_store(url, storage_options=opts)
    for path in Path(root).rglob("*"):  # the pristine version, uploaded as is
        if path.is_file():
            store.storage.write_bytes(path.relative_to(root).as_posix(), path.read_bytes())
    v = store.open(f"c/set@{vid}")
    objects = {}
    for key in store.storage.find(stored(v).key):
        rel = key[len(stored(v).key) + 1:]
        if "/c/" in rel and not rel.startswith(f"{DIGEST_FIELD}/"):  # the loader reads no input digests
            objects[rel] = (lambda k=key: store.storage.read_bytes(k), lambda b, k=key: store.storage.write_bytes(k, b))
    assert len(objects) == 12
    flips = int(os.environ.get("FEATSTORE_FLIPS", LOADER_FLIPS)) // 3
    assert _flips_through_loader(v, objects, flips, seed=7) == []


@pytest.mark.parametrize("damage", ["missing", "empty", "truncated"])
def test_missing_empty_or_truncated_object_raises(damaged, damage):
    store, v, base = damaged
    target = base / "logits" / "c" / "2" / "0"
    if damage == "missing":
        target.unlink()
    elif damage == "empty":
        target.write_bytes(b"")
    else:
        target.write_bytes(target.read_bytes()[: len(target.read_bytes()) // 2])
    fresh = store.open(f"c/set@{v.id}")
    with pytest.raises(CorruptChunk, match="logits/c/2/0"):
        stored(fresh).read_rows("logits", 128, 192)
    with pytest.raises(CorruptChunk):
        fresh.load()
    with pytest.raises(CorruptChunk):  # and through DataLoader worker processes
        list(DataLoader(fresh.dataset(batch_size=32), batch_size=None, num_workers=2, timeout=120))
    assert [p.split(" ")[0] for p in fresh.verify()] == ["logits/c/2/0"]
    assert torch.equal(fresh[0:64]["logits"], store.open(f"c/set@{v.id}")[0:64]["logits"])  # others fine


def test_all_zero_shards_are_stored_and_their_loss_detected(tmp_path, dask_client):
    zero = torch.nn.Linear(12, 4)
    with torch.no_grad():
        zero.weight.zero_()
        zero.bias.zero_()
    store = featstore.open_store(tmp_path / "store")
    v = store.compute("zeros", model=zero, dataset=VectorData(64), outputs={"z": "float32"},
                      samples_per_shard=32, client=dask_client, options=ComputeOptions(progress=False))
    base = Path(stored(v).storage.path(stored(v).key))
    assert len(shard_objects(base)) == 4  # z and the input digests: written although equal to the fill value
    assert torch.equal(v.load()["z"], torch.zeros(64, 4))
    batches = list(v.dataset(batch_size=16))  # the reader's own shard decoder, too
    assert sorted(torch.cat([b["index"] for b in batches]).tolist()) == list(range(64))
    assert all(torch.equal(b["z"], torch.zeros(len(b["index"]), 4)) for b in batches)
    (base / "z" / "c" / "1" / "0").unlink()
    with pytest.raises(CorruptChunk, match="missing"):
        store.open("zeros").load()  # never read back as zeros
    with pytest.raises(CorruptChunk, match="missing"):
        list(store.open("zeros").dataset(batch_size=16))


def test_cli_verify_reports_every_bad_chunk(damaged, capsys):
    store, v, base = damaged
    (base / "features" / "c" / "0" / "0").unlink()
    bad = base / "target" / "c" / "3"
    data = bytearray(bad.read_bytes())
    data[5] ^= 0x10
    bad.write_bytes(bytes(data))
    assert cli(["verify", str(store.url), f"c/set@{v.id}"]) == 1
    out = capsys.readouterr().out
    assert "features/c/0/0" in out and "target/c/3" in out and "2 bad" in out
    shutil.rmtree(base / "features")
    assert cli(["verify", str(store.url), f"c/set@{v.id}"]) == 1


def test_s3_bit_flip_detected(s3_url, dask_client):
    import boto3

    url, opts = s3_url
    store = featstore.open_store(url, storage_options=opts)
    v = store.compute("c/s3", model=TinyA(), dataset=VectorData(64), outputs={"features": "float32",
                      "logits": "float32"}, samples_per_shard=32, client=dask_client,
                      options=ComputeOptions(progress=False))
    s3 = boto3.client("s3", endpoint_url=opts["endpoint_url"])
    bucket, prefix = url[5:].split("/", 1)
    key = f"{prefix}/{stored(v).key}/logits/c/1/0"
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 3] ^= 0x04
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    with pytest.raises(CorruptChunk, match="logits/c/1/0"):
        featstore.open_store(url, storage_options=opts).open("c/s3").load()
    s3.delete_object(Bucket=bucket, Key=key)
    with pytest.raises(CorruptChunk, match="missing"):
        featstore.open_store(url, storage_options=opts).open("c/s3").load()
