"""A store written by featstore 0.1.0 before the restructure opens, verifies and reads the same.

``tests/data/store-0.1.0`` was written by the code of commit 73b9ac2 (see
``tests/data/make_store_0_1_0.py``); its expected values were read back by that same code.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import torch
from torch.utils.data import DataLoader

import featstore

DATA = pathlib.Path(__file__).parent / "data"
FIXTURE = DATA / "store-0.1.0"


def _check(store: featstore.FeatureStore) -> None:
    ids = json.loads((DATA / "store-0.1.0-ids.json").read_text())
    expected = np.load(DATA / "store-0.1.0-expected.npz")
    assert store.names() == sorted(ids)
    assert store.open("legacy/tiny@best").id == ids["legacy/tiny"]
    for name, vid in ids.items():
        v = store.open(name)
        assert v.id == vid and [x.id for x in store.versions(name)] == [vid]
        assert v.verify() == []
        got = v.load()
        assert set(got) == {k.split("/", 1)[1] for k in expected.files if k.startswith(vid)}
        for field, t in got.items():
            np.testing.assert_array_equal(t.float().numpy() if t.is_floating_point() else t.numpy(),
                                          expected[f"{vid}/{field}"])
    v = store.open("legacy/tiny")
    seen = torch.cat([b["index"] for b in DataLoader(v.dataset(batch_size=7, seed=3), batch_size=None,
                                                       num_workers=2)])
    assert sorted(seen.tolist()) == list(range(len(v)))
    assert v.dataset(batch_size=40, shuffle=False)._shard_format("features") is not None


def test_legacy_local_store_opens_verifies_and_reads(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "store")
    _check(featstore.open_store(tmp_path / "store"))


def test_legacy_s3_store_opens_verifies_and_reads(s3_url):
    url, opts = s3_url
    store = featstore.open_store(url, storage_options=opts)
    for path in FIXTURE.rglob("*"):
        if path.is_file():
            store.storage.write_bytes(path.relative_to(FIXTURE).as_posix(), path.read_bytes())
    _check(store)


def test_legacy_versions_export_to_a_standard_copy_that_opens_silently(tmp_path):
    """featstore 0.1.0 versions have no consolidated metadata (zarr lists their folder and warns
    about featstore's own objects): their route to a warning-free plain read is the export."""
    import warnings

    import xarray as xr
    import zarr

    shutil.copytree(FIXTURE, tmp_path / "store")
    store = featstore.open_store(tmp_path / "store")
    ids = json.loads((DATA / "store-0.1.0-ids.json").read_text())
    for name, vid in ids.items():
        v = store.open(f"{name}@{vid}")
        out = v.export(tmp_path / f"{vid}.zarr")
        assert out.shards_checked == v.manifest.layout.n_shards * len(v.manifest.arrays)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            group, ds = zarr.open_group(out.url, mode="r"), xr.open_zarr(out.url)
            for field in v.manifest.arrays:
                np.testing.assert_array_equal(group[field][...], v.read_rows(field, 0, len(v)), strict=True)
                np.testing.assert_array_equal(ds[field].values, v.read_rows(field, 0, len(v)), strict=True)
        assert [str(w.message) for w in caught] == []
