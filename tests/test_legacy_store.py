"""A store written by featstore 0.1.0 before the restructure opens, verifies and reads the same.

``tests/data/store-0.1.0`` was written by the code of commit 73b9ac2 (see
``tests/data/make_store_0_1_0.py``); its expected values were read back by that same code, so
they are checked here against values derived without featstore: each version's Model A run in
this process on its data, as ``tests/models.py`` defined them at 73b9ac2 (before the models were
put on an exact grid, so float32 sums here may round differently from the worker's: within one
step of the stored dtype).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import torch
from torch.utils.data import DataLoader

import featstore
from featstore.versions import stored

DATA = pathlib.Path(__file__).parent / "data"
FIXTURE = DATA / "store-0.1.0"
#: The relative step of each stored dtype: a derived value may differ by one (float32: its
#: rounding across processes).
STEP = {torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float32: 1e-5}


def _derived() -> dict[str, dict[str, torch.Tensor]]:
    """What each legacy version holds, computed here: TinyA and VectorData as they were at
    73b9ac2 (``nn.Linear`` layers seeded by ``manual_seed(seed)``, inputs ``randn``), and the
    bfloat16 version's ``Linear(12, 5)`` after ``manual_seed(1)``, as make_store_0_1_0.py ran."""
    with torch.no_grad(), torch.random.fork_rng():
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(40, 12, generator=g), torch.randint(0, 5, (40,), generator=g)
        torch.manual_seed(0)
        f, h = torch.nn.Linear(12, 8), torch.nn.Linear(8, 5)
        feats = torch.relu(f(x))
        tiny = {"features": feats.half(), "logits": h(feats), "target": y, "index": torch.arange(40)}
        g = torch.Generator().manual_seed(1)
        x = torch.randn(20, 12, generator=g)
        torch.manual_seed(1)
        bf = {"logits": torch.nn.Linear(12, 5)(x).bfloat16(), "index": torch.arange(20)}
    return {"legacy/tiny": tiny, "legacy/bf": bf}


def _assert_derived(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not want.is_floating_point():
        assert torch.equal(got, want), what
        return
    # one step of the stored dtype (ReLU's zeros and exact values: exactly)
    torch.testing.assert_close(got.float(), want.float(), rtol=STEP[want.dtype], atol=1e-6, msg=what)


def test_the_expected_values_are_what_the_models_compute():
    """The fixture's expected values (read back by the 0.1.0 code that wrote them) are what the
    models compute: the old code's own reading is not the only reference."""
    ids = json.loads((DATA / "store-0.1.0-ids.json").read_text())
    expected = np.load(DATA / "store-0.1.0-expected.npz")
    for name, fields in _derived().items():
        assert {k.split("/", 1)[1] for k in expected.files if k.startswith(ids[name])} == set(fields)
        for field, want in fields.items():
            _assert_derived(torch.from_numpy(expected[f"{ids[name]}/{field}"]), want, f"{name} {field}")


def _check(store: featstore.FeatureStore) -> None:
    ids = json.loads((DATA / "store-0.1.0-ids.json").read_text())
    expected = np.load(DATA / "store-0.1.0-expected.npz")
    derived = _derived()
    assert store.names() == sorted(ids)
    assert store.open("legacy/tiny@best").id == ids["legacy/tiny"]
    for name, vid in ids.items():
        v = store.open(name)
        assert v.id == vid and [x.id for x in store.versions(name)] == [vid]
        assert v.verify() == []
        got = v.load()
        assert set(got) == {k.split("/", 1)[1] for k in expected.files if k.startswith(vid)} == set(derived[name])
        for field, t in got.items():
            np.testing.assert_array_equal(t.float().numpy() if t.is_floating_point() else t.numpy(),
                                          expected[f"{vid}/{field}"])
            assert t.dtype == derived[name][field].dtype, (name, field)
            _assert_derived(t, derived[name][field], f"{name} {field}")
    v = store.open("legacy/tiny")
    seen = torch.cat([b["index"] for b in DataLoader(v.dataset(batch_size=7, seed=3), batch_size=None,
                                                       num_workers=2)])
    assert sorted(seen.tolist()) == list(range(len(v)))
    assert v.dataset(batch_size=40, shuffle=False).process_reads().shard_format("features") is not None


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
                np.testing.assert_array_equal(group[field][...], stored(v).read_rows(field, 0, len(v)), strict=True)
                np.testing.assert_array_equal(ds[field].values, stored(v).read_rows(field, 0, len(v)), strict=True)
        assert [str(w.message) for w in caught] == []
