"""No code from the store: nothing read from a store is unpickled, and every metadata object
(manifest, receipt, tag, zarr.json) is validated JSON; malformed or newer ones get a clear error."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

import featstore
from featstore import CorruptChunk, IncompatibleFormat

from tests.helpers import QUIET, write_version

SRC = Path(featstore.__file__).parent
NAME = "meta/set"


class Planted:
    """Unpickling this creates ``marker``: proof that something unpickled store bytes."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_featstore_source_never_deserialises_code():
    banned = re.compile(r"\b(pickle\.loads?|cloudpickle\.loads?|dill\.loads?|marshal\.loads?|torch\.load|"
                        r"np\.load|numpy\.load|yaml\.(unsafe_)?load|(?<!\.)eval|(?<!\.)exec|__import__)\s*\(")
    hits = [f"{p.name}:{i}: {line.strip()}" for p in SRC.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if banned.search(line)]
    assert hits == []


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("meta") / "store"
    store = featstore.open_store(root)
    v = write_version(store, NAME, n=96, options=QUIET)
    store.tag(v, "best")
    return root, v.id


@pytest.fixture
def copy(pristine, tmp_path):
    """A private copy of the store: (store, version dir, version id, marker path)."""
    root, vid = pristine
    dst = tmp_path / "store"
    shutil.copytree(root, dst)
    return featstore.open_store(dst), dst / NAME / "_versions" / vid, vid, tmp_path / "UNPICKLED"


def read_everything(store, vid):
    store.names(), store.tags(NAME)
    v = store.open(f"{NAME}@{vid}")
    v.load()
    return v


def test_planted_pickles_are_never_loaded(copy):
    store, vdir, vid, marker = copy
    payload = pickle.dumps(Planted(str(marker)))
    # Next to the real objects: never read at all.
    for extra in ("manifest.pkl", "model.pt", "features/c/0/0.pkl", "_receipts/000000.pkl"):
        (vdir / extra).parent.mkdir(parents=True, exist_ok=True)
        (vdir / extra).write_bytes(payload)
    read_everything(store, vid)
    # In place of the real objects, one at a time (the others intact, so each case reaches the
    # object it plants): refused with a typed error naming that object, never unpickled.
    cases = [("_tags/best.json", IncompatibleFormat, lambda: store.open(f"{NAME}@best")),
             ("features/c/1/0", CorruptChunk, lambda: store.open(f"{NAME}@{vid}").load()),
             ("features/c/1/0", CorruptChunk, lambda: list(store.open(f"{NAME}@{vid}").dataset(batch_size=32))),
             ("manifest.json", IncompatibleFormat, lambda: store.open(NAME))]
    for rel, err_type, action in cases:
        target = (vdir.parents[1] / rel) if rel.startswith("_tags") else vdir / rel
        good = target.read_bytes()
        target.write_bytes(payload)
        with pytest.raises(err_type) as err:
            action()
        if err_type is CorruptChunk:
            assert err.value.chunk == rel, (rel, str(err.value))
        else:
            assert rel.split("/")[-1] in str(err.value), (rel, str(err.value))
        target.write_bytes(good)
        read_everything(store, vid)  # restored: every object reads again
    # An array's zarr.json: featstore reads rows from the shard objects by the manifest's layout,
    # so a planted one changes no row; the whole-version check names it, never unpickled.
    rows = store.open(f"{NAME}@{vid}").load()
    (vdir / "features/zarr.json").write_bytes(payload)
    report = store.open(f"{NAME}@{vid}").verify()
    assert report and all("features/zarr.json" in line and "not a JSON object" in line for line in report), report
    with pytest.raises(CorruptChunk, match="features/zarr.json"):  # nor an export of it
        store.open(f"{NAME}@{vid}").export(marker.parent / "exported")
    again = store.open(f"{NAME}@{vid}").load()
    assert all(torch.equal(rows[k], again[k]) for k in rows)
    assert not marker.exists()


def manifest_variants(m: dict) -> dict[str, tuple[dict | bytes, str]]:
    def edit(**kw):
        return {**m, **kw}

    arrays_bad_name = {**m["arrays"], "../../escape": m["arrays"]["features"]}
    return {
        "not-json": (b"\x80\x04garbage", "not valid JSON"),
        "a-list": (b"[1, 2]", "not hold a JSON object"),
        "no-schema": ({k: v for k, v in m.items() if k != "schema"}, "not a featstore.manifest"),
        "newer": (edit(schema_version=3), "upgrade featstore"),
        "version-string": (edit(schema_version="1"), "malformed schema_version"),
        "missing-field": ({k: v for k, v in m.items() if k != "layout"}, "malformed"),
        "path-in-array-name": (edit(arrays=arrays_bad_name), "malformed"),
        "unknown-codec": (edit(arrays={**m["arrays"], "features": {**m["arrays"]["features"], "codec": "pickle"}}),
                          "malformed"),
        "moved": (edit(id="0" * 16), "not"),
        "records-do-not-cover": (edit(records={**m["records"], "objects": []}), "records objects for"),
        "records-miss-an-array": (edit(records={**m["records"], "fields": ["features"]}), "do not name"),
        "bad-records-digest": (edit(records={**m["records"], "objects": ["x"]}), "malformed"),
        "inline-shards-in-schema-2": (edit(shards=[]), "malformed"),
        "bases-overlap": (edit(bases=[{"name": NAME, "id": "0" * 16, "first": 0, "stop": 2, "n_samples": 10**6},
                                      {"name": NAME, "id": "1" * 16, "first": 1, "stop": 2, "n_samples": 10**6}]),
                          "overlap"),
        "base-of-other-rows": (edit(bases=[{"name": NAME, "id": "0" * 16, "first": 0, "stop": m["layout"]["n_samples"]
                                            // m["layout"]["samples_per_shard"] + 1, "n_samples": 10**6}]),
                               "other rows"),
        "schema-1-shards-do-not-tile": (edit(schema_version=1, shards=[]), "do not tile"),
    }


def test_malformed_or_newer_manifests_are_refused_clearly(copy):
    store, vdir, vid, _ = copy
    good = (vdir / "manifest.json").read_bytes()
    variants = manifest_variants(json.loads(good))
    for label, (content, words) in variants.items():
        (vdir / "manifest.json").write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
        for action in (lambda: store.open(f"{NAME}@{vid}"), lambda: store.open(NAME)):
            with pytest.raises(IncompatibleFormat) as err:
                action()
            msg = str(err.value)
            assert words in msg, (label, msg)
            assert re.search(r"delete|upgrade|recompute|point featstore", msg, re.I), (label, msg)
        # it affects only its own version: listed as damaged (with the command that removes it), not hidden
        assert vid not in [v.id for v in store.versions(NAME)]
        assert words in store.damaged(NAME)[f"{NAME}@{vid}"] and "featstore delete" in msg, label
    (vdir / "manifest.json").write_bytes(good)
    assert store.open(NAME).id == vid
    print(f"\n[metadata] {len(variants)} malformed/newer manifest variants refused")


def zarr_variants(meta: dict) -> dict[str, tuple[object, type, str]]:
    inner = meta["codecs"][0]["configuration"]
    swapped = json.loads(json.dumps(meta))
    gzip = {"name": "gzip", "configuration": {"level": 1}}
    swapped["codecs"][0]["configuration"]["codecs"] = [inner["codecs"][0], gzip]
    return {
        "garbage": (b"{nope", CorruptChunk, "not a JSON object"),
        "newer-zarr": ({**meta, "zarr_format": 4}, IncompatibleFormat, "upgrade"),
        "other-dtype": ({**meta, "data_type": "float64"}, CorruptChunk, "data_type"),
        "other-shape": ({**meta, "shape": [5, 8]}, CorruptChunk, "shape"),
        "foreign-codec": (swapped, CorruptChunk, "codecs"),
        "no-sharding": ({**meta, "codecs": inner["codecs"]}, CorruptChunk, "not what featstore wrote"),
    }


def test_malformed_or_newer_zarr_json_is_refused_before_decoding(copy):
    store, vdir, vid, _ = copy
    path = vdir / "features" / "zarr.json"
    good = path.read_bytes()
    variants = zarr_variants(json.loads(good))
    for label, (content, err_type, words) in variants.items():
        path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
        with pytest.raises(err_type) as err:
            store.open(f"{NAME}@{vid}").load()
        assert words in str(err.value), (label, str(err.value))
        assert "features" in str(err.value) and vid in str(err.value)
    path.write_bytes(good)
    assert len(store.open(f"{NAME}@{vid}").load()["features"]) == 96
    print(f"\n[metadata] {len(variants)} malformed/newer zarr.json variants refused")


def test_malformed_or_newer_tags_and_receipts(copy):
    store, vdir, vid, _ = copy
    tag = vdir.parents[1] / "_tags" / "best.json"
    good = json.loads(tag.read_text())
    assert good["schema"] == "featstore.tag" and store.open(f"{NAME}@best").id == vid
    for content, words in [({**good, "schema_version": 7}, "upgrade"), ({**good, "version": "../../x"}, "damaged"),
                           ({"version": vid}, "not a featstore.tag"), ([vid], "not hold a JSON object")]:
        tag.write_text(json.dumps(content))
        with pytest.raises(IncompatibleFormat, match=words):
            store.open(f"{NAME}@best")
    # Receipts (resume markers) carry a schema too; a newer or damaged one is refused.
    from featstore.format._manifests import ShardReceipt

    receipt = json.loads((vdir / "_receipts" / "000001.json").read_text())
    assert receipt["schema"] == "featstore.receipt" and ShardReceipt.from_json(receipt).index == 1
    with pytest.raises(IncompatibleFormat, match="upgrade featstore"):
        ShardReceipt.from_json({**receipt, "schema_version": 9})
    with pytest.raises(IncompatibleFormat, match="rerun compute"):
        ShardReceipt.from_json({**receipt, "digests": {"../x": "0" * 64}})
