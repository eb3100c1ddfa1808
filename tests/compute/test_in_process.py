"""client="in-process": the shard tasks run in the calling process without Dask, and write the very
version a Dask cluster writes (same fingerprint and id, manifest, receipts and object bytes); the
progress bar still shows, and errors are the same."""

from __future__ import annotations

import pathlib

import pytest
import torch

import featstore
from featstore import ComputeFailed, ComputeOptions, NonFiniteOutput, Views
from featstore.versions import stored

from ..augments import noisy_flip
from ..models import TinyA, VectorData

N = 150
ARGS = dict(keep=["target"], outputs={"features": "float16", "logits": "float32"}, samples_per_shard=32,
            batch_size=16)


def stored_objects(version) -> dict[str, bytes]:
    """Every object of the version's folder but its manifest (which records times), by path."""
    root = pathlib.Path(stored(version).storage.root) / stored(version).key
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "manifest.json"}


def same_manifests(a, b) -> None:
    ja, jb = a.manifest.to_json(), b.manifest.to_json()
    for key in ("created_at", "timings", "libraries"):
        ja.pop(key), jb.pop(key)
    assert ja == jb


@pytest.mark.parametrize("views", [None, 2], ids=["plain", "views"])
def test_in_process_writes_the_version_dask_writes(tmp_path, dask_client, views, capsys):
    kw = dict(ARGS, model=TinyA(), dataset=VectorData(N))
    if views:
        kw |= dict(views=Views(k=views, augment=noisy_flip, seed=5), keep={"target": "target", "flip": "flip"})
    on_dask = featstore.open_store(tmp_path / "dask").compute("t/x", client=dask_client,
                                                              options=ComputeOptions(progress=False), **kw)
    capsys.readouterr()
    here = featstore.open_store(tmp_path / "here").compute("t/x", client="in-process",
                                                           options=ComputeOptions(progress=True), **kw)
    assert "compute t/x" in capsys.readouterr().err  # the terminal bar, fed without a scheduler
    assert here.id == on_dask.id and here.fingerprint == on_dask.fingerprint
    same_manifests(here, on_dask)
    assert [(r.view, r.index, r.digests) for r in stored(here).shard_receipts()] == \
        [(r.view, r.index, r.digests) for r in stored(on_dask).shard_receipts()]
    assert stored_objects(here) == stored_objects(on_dask)  # every chunk, zarr.json and receipt run, byte for byte
    assert here.verify() == [] and here.manifest.timings["shards_computed"] == here.manifest.n_units


def test_in_process_resumes_and_finds_what_is_committed(tmp_path):
    store = featstore.open_store(tmp_path / "store")
    kw = dict(ARGS, model=TinyA(), dataset=VectorData(N), client="in-process",
              options=ComputeOptions(progress=False, model_id="tiny-a"))
    first = store.compute("t/r", **kw)
    assert store.compute("t/r", **kw) == first  # committed: found, nothing computed
    store.storage.delete(f"{stored(first).key}/manifest.json")
    from featstore.versions import forget_receipts

    forget_receipts(store.storage, stored(first).key, [1, 3])
    again = store.compute("t/r", **kw)
    assert again.id == first.id and again.manifest.timings["shards_computed"] == 2
    assert again.verify() == []


class NaNOn40:
    """TinyA whose features are NaN for sample 40 (the model is picklable: Dask sends it)."""

    def __init__(self) -> None:
        self.a = TinyA()

    def __call__(self) -> torch.nn.Module:
        return _NaN(self.a)


class _NaN(torch.nn.Module):
    def __init__(self, a: torch.nn.Module) -> None:
        super().__init__()
        self.a = a

    def forward(self, x):
        out = self.a(x)
        hit = (x[:, 0] == VectorData(N).x[40, 0]) & (x[:, 1] == VectorData(N).x[40, 1])
        out["features"][hit] = float("nan")
        return out


class Broken(torch.nn.Module):
    def forward(self, x):
        raise RuntimeError("A is broken")


@pytest.mark.parametrize("model,error,match", [(NaNOn40(), NonFiniteOutput, r"NaN/Inf in 'features'.*\[40\]"),
                                               (Broken(), ComputeFailed, "A is broken")])
def test_in_process_errors_are_the_errors_dask_raises(tmp_path, dask_client, model, error, match):
    opts = ComputeOptions(progress=False)
    got = {}
    for client in (dask_client, "in-process"):
        store = featstore.open_store(tmp_path / str(id(client)))
        with pytest.raises(error, match=match) as info:
            store.compute("t/err", model=model, dataset=VectorData(N), client=client, options=opts, **ARGS)
        got[client == "in-process"] = info.value
        assert store.versions("t/err") == []
    if isinstance(got[True], ComputeFailed):  # the user's exception is the cause, in both
        assert isinstance(got[True].__cause__, RuntimeError) and "A is broken" in str(got[False])
    assert "Dask task" not in str(got[True])  # no task of Dask to name
