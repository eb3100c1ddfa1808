"""The face and what is behind it: a public :class:`featstore.Version` over a
:class:`~featstore.versions.StoredVersion` (:func:`featstore.versions.stored` turns one into the
other), a :class:`featstore.FeatureStore` that shows the user API and holds its catalog, and the
one "deleted or damaged?" decision (:func:`~featstore.versions.missing_data_error`)."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch

import featstore
from featstore import CorruptChunk, InvalidInput, VersionNotFound
from featstore.format._shard_decoder import ChunkRef
from featstore.versions import Catalog, Commits, StoredVersion, missing_data_error, stored

from tests.models import TinyA, VectorData

API = Path(__file__).resolve().parents[2] / "docs" / "api" / "featstore.md"
#: The commit protocol: the catalog's (``store.catalog.commits``), never the store's.
PROTOCOL = {"claim", "collect_receipts", "write_records", "commit", "live_refs", "delete_uncommitted"}


def documented(name: str) -> set[str]:
    """The members docs/api/featstore.md lists for ``featstore.<name>``."""
    block = API.read_text().split(f"::: featstore.{name}\n", 1)[1].split(":::", 1)[0]
    return set(re.findall(r"^        - (\w+)$", block, flags=re.M))


def public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


@pytest.fixture(scope="module")
def version(tmp_path_factory):
    store = featstore.open_store(tmp_path_factory.mktemp("store"))
    return store, store.compute("face/set", model=TinyA(), dataset=VectorData(24), keep=["target"],
                                outputs={"features": "float16"}, batch_size=8, samples_per_shard=8,
                                options=featstore.ComputeOptions(progress=False, processes=False, n_workers=1))


def test_the_public_classes_show_what_the_docs_list():
    assert public(featstore.FeatureStore) - {"storage", "catalog"} == documented("FeatureStore")
    assert public(featstore.Version) == documented("Version")
    assert not PROTOCOL & public(featstore.FeatureStore) and not PROTOCOL & public(Catalog)
    assert PROTOCOL <= public(Commits)


def test_stored_gives_the_version_behind_the_public_one(version):
    store, v = version
    assert isinstance(v, featstore.Version) and not isinstance(v, StoredVersion)
    inner = stored(v)
    assert isinstance(inner, StoredVersion) and stored(inner) is inner
    assert (inner.ref, inner.key, len(inner)) == (v.ref, f"face/set/_versions/{v.id}", len(v))
    assert store.catalog.open(v) is inner and store.catalog.open(v.ref) == v  # equal both ways
    assert v == inner and inner == v and hash(v) == hash(inner) and v == store.open(v.ref)
    assert v != store.open(v.ref).manifest and len({v, inner, store.open(v.ref)}) == 1
    for wrong in ("face/set", 3, None):
        with pytest.raises(InvalidInput, match="expected a featstore Version"):
            stored(wrong)


def test_the_public_version_reads_pickles_and_goes_everywhere_a_version_goes(version):
    store, v = version
    again = pickle.loads(pickle.dumps(v))
    assert isinstance(again, featstore.Version) and again == v and repr(again) == repr(v)
    assert repr(v) == f"<Version {v.ref} samples=24 arrays=['features', 'item_digest', 'target']>"
    assert torch.equal(v[3:5]["features"], v.load()["features"][3:5]) and v.verify() == []
    ds = featstore.FeatureDataset(v, batch_size=24, shuffle=False)  # a public Version, below the face
    assert ds.version is v and torch.equal(next(iter(ds))["target"], v.load()["target"])
    multi = store.dataset([v, v.ref], batch_size=24, shuffle=False)
    assert all(isinstance(x, featstore.Version) for x in multi.versions.values())  # the user's Versions
    assert [x.id for x in multi.versions.values()] == [v.id, v.id]
    assert isinstance(store.versions("face/set")[0], featstore.Version) and store.versions("face/set") == [v]
    with pytest.warns(DeprecationWarning, match="StoredVersion"):
        assert featstore.versions.Version is StoredVersion


def test_missing_data_is_damage_unless_the_version_was_deleted(version, tmp_path):
    store, v = version
    inner = stored(v)
    ref = ChunkRef(v.ref, "features", inner.chunk_key("features", 1))
    missing, empty = missing_data_error(inner, ref, None), missing_data_error(inner, ref, b"")
    assert isinstance(missing, CorruptChunk) and "is missing" in str(missing) and missing.chunk == ref.chunk
    assert isinstance(empty, CorruptChunk) and "is empty" in str(empty)
    gone = StoredVersion(featstore.open_store(tmp_path).storage, inner.manifest)  # no manifest there
    assert isinstance(missing_data_error(gone, ref, None), VersionNotFound)
    with pytest.raises(VersionNotFound, match="was deleted"):
        gone.read_rows("features", 0, 8)
