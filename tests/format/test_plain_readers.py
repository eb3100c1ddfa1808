"""Plain Zarr readers (TensorStore, zarr-python, xarray) read what featstore stored, bit for bit,
and say nothing while doing it; versions they cannot read in place go through ``featstore export``.

Every codec (float32, float16, bfloat16 bits, int8 + scale, topk, topp, sample), a version with
views, per-token outputs; ``extends=`` children and spread versions through the export route.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tensorstore as ts
import torch
import xarray as xr
import zarr

import featstore
from featstore import ComputeOptions, Tokens
from featstore.cli import main
from featstore.ragged import TOKEN_LENGTH, TOKEN_START, attention_mask, gather_rows
from featstore.ragged import pad_sequences as pad_tokens
from featstore.versions import stored

from tests.helpers import (MULTI_OUTPUTS, GrowingData, MultiA, TinyA, TinyLM, TokenSeqs, noisy_flip, write_version)
READERS = ("tensorstore", "zarr", "xarray")


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """One version per kind a plain reader meets."""
    store = featstore.open_store(tmp_path_factory.mktemp("plain") / "store")
    out = {
        "codecs": write_version(store, "plain/codecs", model=MultiA(), n=100, outputs=MULTI_OUTPUTS,
                                batch_size=256),
        "views": write_version(store, "plain/views", n=70, outputs={"features": "float16", "logits": "topk:2"},
                               views=2, augment=noisy_flip, batch_size=256),
        "tokens": write_version(store, "plain/tokens", model=TinyLM(), dataset=TokenSeqs(40),
                                outputs={"logits": "topk:4"}, batch_size=8, samples_per_shard=16,
                                tokens=Tokens(mask=attention_mask, max_tokens=12),
                                options=ComputeOptions(progress=False, collate=pad_tokens)),
        "spread": write_version(store, "plain/spread", n=90, outputs={"features": "bfloat16", "logits": "sample:3"},
                                samples_per_shard=16, batch_size=256,
                                options=ComputeOptions(progress=False, spread_prefixes=4)),
    }
    grown = dict(model=TinyA(), outputs={"features": "int8"}, keep=(), samples_per_shard=16, batch_size=256)
    parent = write_version(store, "plain/grown", dataset=GrowingData(64), **grown)
    out["extends"] = write_version(store, "plain/grown", dataset=GrowingData(100), extends=parent,
                                   **{**grown, "samples_per_shard": None})
    return out


def _groups(version):
    """(group path inside the version, featstore's Version reading it) for each group of arrays."""
    if version.views is None:
        return [("", version)]
    return [(f"_views/{v}", version.view(v)) for v in range(version.views)]


def _read(reader: str, root: str, group: str, field: str) -> np.ndarray:
    return _read_all(reader, root, group, [field])[field]


def _read_all(reader: str, root: str, group: str, fields) -> dict[str, np.ndarray]:
    """Each field's stored values, as ``reader`` opens the group (as its users would)."""
    path = f"{root}/{group}".rstrip("/")
    if reader == "tensorstore":
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}
        return {f: ts.open({**spec, "path": f}, read=True).result().read().result() for f in fields}
    if reader == "zarr":
        g = zarr.open_group(path, mode="r")
        return {f: g[f][...] for f in fields}
    ds = xr.open_zarr(root, group=group or None)
    return {f: ds[f].values for f in fields}


def _loudly(fn):
    """``fn()``, and every warning it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fn()
    return got, [f"{w.category.__name__}: {w.message}" for w in caught]


def _featstore_batch(source, n):
    """Every sample in order, through featstore's own reader (its shard decoder, not zarr)."""
    view = stored(source)._view
    ds = source.dataset(batch_size=n, shuffle=False, **({} if view is None else {"view": view}))
    return next(iter(ds))


def _as_batch(version, plain: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """A plain reader's stored arrays decoded the way featstore decodes stored values."""
    from featstore.codecs._parts import assemble
    from featstore.format import SERVED_SOURCES

    spec = version.manifest.arrays
    out = {}
    for field, values in plain.items():
        if spec[field].source not in SERVED_SOURCES:  # seeds, token starts, input digests: not in batches
            continue
        if spec[field].ragged:  # each sample's real tokens, sample after sample
            values = values[gather_rows(plain[TOKEN_START], plain[TOKEN_LENGTH])]
        out[field] = stored(version).decode(field, values)
    return assemble(spec, out)


def _check_reads_bit_for_bit(version, root: str) -> None:
    for group, source in _groups(version):
        want = _featstore_batch(source, len(version))
        for reader in READERS:
            plain, said = _loudly(lambda r=reader, g=group: _read_all(r, root, g, version.manifest.arrays))
            assert said == [], (reader, said)
            for field, values in plain.items():  # the stored values themselves, dtype included
                np.testing.assert_array_equal(values, stored(source).read_rows(field, 0, len(values)), strict=True)
            got = _as_batch(version, plain)
            for key, tensor in got.items():
                assert torch.equal(tensor, want[key]), (reader, group, key)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["codecs", "views", "tokens"])
def test_plain_readers_read_a_version_in_place_bit_for_bit_and_silently(versions, kind):
    v = versions[kind]
    _check_reads_bit_for_bit(v, v.url)
    if kind == "codecs":  # every codec is there, with its parts
        from featstore.codecs._parts import parts_codec

        canonical = {c if c.startswith(("float", "bfloat")) else parts_codec(c).name for c in MULTI_OUTPUTS.values()}
        assert {a.codec for a in v.manifest.arrays.values()} >= canonical
        assert {"bf16", "i8", "i8.scale", "topk.ids", "topk.values", "sample.ids", "sample.counts"} <= set(
            v.manifest.arrays)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["spread", "extends"])
def test_plain_readers_refuse_versions_whose_shards_lie_elsewhere_and_read_their_export(versions, kind, tmp_path):
    v = versions[kind]
    field = next(iter(v.manifest.arrays))
    with pytest.raises(Exception, match="featstore.mapped|chunk key encoding"):
        zarr.open_group(v.url, mode="r")[field][...]
    with pytest.raises(Exception, match="featstore.mapped|chunk_key_encoding|default"):
        _read("tensorstore", v.url, "", field)
    out = v.export(tmp_path / "copy.zarr")
    assert out.shards_checked == v.manifest.layout.n_shards * len(v.manifest.arrays)
    _check_reads_bit_for_bit(v, out.url)
    if kind == "extends":
        assert v.manifest.bases and out.objects == v.manifest.layout.n_shards * len(v.manifest.arrays)


def test_featstore_export_command_writes_a_standard_copy(versions, tmp_path, capsys):
    v = versions["views"]
    dest = tmp_path / "views.zarr"
    assert main(["export", stored(v).storage.url, v.ref, str(dest)]) == 0
    assert f"exported {v.ref} to" in capsys.readouterr().out
    _check_reads_bit_for_bit(v, str(dest))
    assert zarr.open_group(str(dest), mode="r").attrs["featstore"]["exported_from"] == v.ref
    assert main(["export", stored(v).storage.url, v.ref, str(dest)]) == 6  # not an empty folder: a conflict
