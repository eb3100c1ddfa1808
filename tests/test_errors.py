"""Every bad input gets a typed error with a how-to-fix message and leaves nothing committed."""

from __future__ import annotations

import os
import re
import socket

import pytest
import torch

import featstore
from featstore import (ComputeOptions, EmptyDataset, FeatstoreError, InvalidName, MissingInputKey,
                       NonFiniteOutput, OutputMismatch, StoreUnavailable, VersionNotFound)
from featstore._allowed_names import check_name, check_tag

from .helpers import QUIET
from .models import IdData, NaNAt, Raises, ShapeShift, TinyA, VectorData



def nothing_committed(store, name):
    return store.versions(name) == [] and not any(k.endswith("manifest.json") for k in store.storage.find(""))


def run(store, client, model, data, name="bad/set", **kw):
    kw.setdefault("outputs", {"out": "float32"})
    return store.compute(name, model=model, dataset=data, client=client, batch_size=8,
                         samples_per_shard=16, options=kw.pop("options", QUIET), **kw)


def test_empty_dataset(local_store, dask_client):
    with pytest.raises(EmptyDataset, match="empty"):
        run(local_store, dask_client, TinyA(), VectorData(0))
    assert nothing_committed(local_store, "bad/set")


def test_missing_input_key(local_store, dask_client):
    with pytest.raises(MissingInputKey, match="input_key") as err:
        run(local_store, dask_client, TinyA(), VectorData(10), input_key="image")
    assert "['input', 'target']" in str(err.value)
    with pytest.raises(MissingInputKey):
        run(local_store, dask_client, TinyA(), VectorData(10), input_key="input", keep=["label"])
    assert nothing_committed(local_store, "bad/set")


@pytest.mark.parametrize("dtype_change", [False, True])
def test_output_shape_or_dtype_change_between_batches(store, dask_client, dtype_change):
    with pytest.raises(OutputMismatch, match="must not change between batches") as err:
        run(store, dask_client, ShapeShift(at=45, dtype_change=dtype_change), IdData(64))
    start = int(re.search(r"on samples \[(\d+), \d+\)", str(err.value)).group(1))
    assert start >= 40  # names a batch that really changed (tasks run concurrently)
    assert nothing_committed(store, "bad/set")


def test_nan_is_an_error_by_default_and_stored_on_request(local_store, dask_client):
    with pytest.raises(NonFiniteOutput, match=r"first: \[21\]"):
        run(local_store, dask_client, NaNAt(21), IdData(40))
    assert nothing_committed(local_store, "bad/set")
    allow = ComputeOptions(allow_nonfinite=True, progress=False)
    v = run(local_store, dask_client, NaNAt(21), IdData(40), options=allow)
    assert v.manifest.stats["out"]["nan"] == 4
    assert v.manifest.stats["out"]["nonfinite_samples"] == [21]
    assert torch.isnan(v[21]["out"]).all() and not torch.isnan(v[20]["out"]).any()


def test_float16_overflow_is_refused(local_store, dask_client):
    big = torch.nn.Linear(12, 2)
    with torch.no_grad():
        big.weight.fill_(1e5)
    with pytest.raises(NonFiniteOutput, match="overflow float16"):
        run(local_store, dask_client, big, VectorData(16), outputs={"out": "float16"})
    assert nothing_committed(local_store, "bad/set")


def test_model_exception_names_the_samples(local_store, dask_client):
    with pytest.raises(featstore.ComputeFailed, match=r"boom from Model A on samples \[0, \d+\).*task featstore-probe"):
        run(local_store, dask_client, Raises(), VectorData(16))
    assert nothing_committed(local_store, "bad/set")


def test_outputs_must_match_model_keys(local_store, dask_client):
    with pytest.raises(OutputMismatch, match=r"\['emb'\], which Model A does not return \(it returns "
                                             r"\['features', 'logits'\]\)"):
        run(local_store, dask_client, TinyA(), VectorData(16), outputs={"features": "float32", "emb": "float32"})
    with pytest.raises(featstore.InvalidInput, match="unknown output codec"):
        run(local_store, dask_client, TinyA(), VectorData(16), outputs={"features": "int3"})
    with pytest.raises(featstore.InvalidInput, match="reserved"):
        run(local_store, dask_client, torch.nn.Linear(12, 2), VectorData(16), outputs={"index": "float32"})
    assert nothing_committed(local_store, "bad/set")


BAD_NAMES = ["", "..", "../x", "a/../b", "/abs", "a//b", "a\\b", "%2e%2e/x", "a\0b", "a/./b",
             "x" * 300, "ａｂｃ", "caf\u00e9", ".hidden", "a/_versions", "a b", "a/", "-", "a\nb"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_refused_before_any_write(local_store, dask_client, name, tmp_path):
    with pytest.raises(InvalidName):
        run(local_store, dask_client, TinyA(), VectorData(8), name=name)
    with pytest.raises(InvalidName):
        local_store.open(name)
    assert local_store.storage.find("") == []


@pytest.mark.parametrize("tag", ["..", "a/b", "", "../../etc", "t\0"])
def test_bad_tags_are_refused(local_store, tag):
    with pytest.raises(InvalidName):
        check_tag(tag)


def test_good_names_pass():
    assert check_name("resnet50/imagenet-train.v2") == "resnet50/imagenet-train.v2"
    assert check_tag("best-1.0") == "best-1.0"


def test_unknown_version_and_tag(local_store, dask_client):
    with pytest.raises(VersionNotFound, match="no committed version"):
        local_store.open("nothing/here")
    run(local_store, dask_client, torch.nn.Linear(12, 2), VectorData(8), name="some/set")
    with pytest.raises(VersionNotFound, match="tags"):
        local_store.open("some/set@missing-tag")
    with pytest.raises(VersionNotFound):
        local_store.open("some/set@0123456789abcdef")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_store():
    with pytest.raises(StoreUnavailable, match="cannot reach"):
        featstore.open_store("s3://bucket/x", storage_options={
            "endpoint_url": f"http://127.0.0.1:{_closed_port()}",
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}})


def test_missing_credentials(moto_endpoint, monkeypatch, tmp_path):
    for var in list(os.environ):
        if var.startswith("AWS_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StoreUnavailable, match="credentials"):
        featstore.open_store("s3://bucket/x", storage_options={"endpoint_url": moto_endpoint,
                                                                "skip_instance_cache": True})


def test_missing_bucket(moto_endpoint):
    with pytest.raises(StoreUnavailable, match="bucket"):
        featstore.open_store("s3://no-such-bucket-here/x", storage_options={"endpoint_url": moto_endpoint})


def test_every_error_is_a_featstore_error():
    for name in featstore.__all__:
        obj = getattr(featstore, name)
        if isinstance(obj, type) and issubclass(obj, Exception) and not issubclass(obj, Warning):
            assert issubclass(obj, FeatstoreError)
    assert issubclass(VersionNotFound, KeyError) and str(VersionNotFound("msg")) == "msg"


#: Every error class and the builtin it also is (the error table of docs/errors.md).
BUILTIN_BASES = {
    "FeatstoreError": Exception, "InvalidInput": ValueError, "InvalidName": ValueError,
    "EmptyDataset": ValueError, "MissingInputKey": ValueError, "OutputMismatch": ValueError,
    "NonFiniteOutput": ValueError, "VersionNotFound": KeyError, "StoreConflict": FileExistsError,
    "StoreUnavailable": ConnectionError, "StorePermissionDenied": PermissionError, "StoreFull": OSError,
    "ConditionalWritesUnsupported": NotImplementedError,
    "IncompatibleFormat": ValueError, "CorruptChunk": OSError, "ComputeFailed": RuntimeError,
    "DeviceSetupError": RuntimeError, "DatasetMismatch": ValueError, "NondeterministicAugment": ValueError,
    "SourceMismatch": ValueError, "StoreNotFound": FileNotFoundError, "ClusterUnavailable": ConnectionError,
    "DistributedSetupError": RuntimeError, "VersionsMisaligned": ValueError,
}


def test_every_error_class_has_its_documented_builtin_base():
    import inspect
    import pickle
    from pathlib import Path

    from featstore import errors

    classes = {n: c for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, Exception)
               and not issubclass(c, Warning) and c.__module__ == errors.__name__}
    assert set(classes) == set(BUILTIN_BASES)  # a new error class gets its documented base here
    table = (Path(__file__).resolve().parents[1] / "docs" / "errors.md").read_text()
    for name, cls in classes.items():
        assert issubclass(cls, BUILTIN_BASES[name]) and issubclass(cls, errors.FeatstoreError), name
        assert getattr(featstore, name) is cls  # and it is public
        err = cls("what happened; what to do")
        assert str(err) == "what happened; what to do"  # KeyError would quote it
        back = pickle.loads(pickle.dumps(err))  # crosses Dask and DataLoader workers
        assert type(back) is cls and str(back) == str(err)
        if name != "FeatstoreError":
            assert f"| `{name}` | `{BUILTIN_BASES[name].__name__}` |" in table, name
