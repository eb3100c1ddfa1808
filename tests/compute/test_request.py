"""Compute's request is declared once (featstore.compute.ComputeRequest): store.compute, the driver
and Teacher take exactly its keywords, with its defaults and its documentation, plus their own
(client; device and fill); what is checked without a dataset is checked where a call is made."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest

import featstore
from featstore import ComputeOptions, InvalidInput, Teacher, Tokens, Views
from featstore.compute import ComputeCall, ComputeRequest, compute
from featstore.store import FeatureStore

from ..augments import noisy_flip
from ..models import TinyA, VectorData

REQUEST = [f for f in dataclasses.fields(ComputeRequest) if f.init]
TAKERS = {"store.compute": (FeatureStore.compute, ["self", "name"], ["client"]),
          "featstore.compute.compute": (compute, ["catalog", "name"], ["client"]),
          "Teacher": (Teacher, [], ["device", "fill"])}


def default(f: dataclasses.Field) -> object:
    return inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default


@pytest.mark.parametrize("taker", sorted(TAKERS))
def test_every_request_keyword_is_taken_with_its_default_and_nothing_else(taker):
    fn, before, after = TAKERS[taker]
    params = inspect.signature(fn).parameters
    assert list(params) == before + [f.name for f in REQUEST] + after
    for f in REQUEST:
        assert params[f.name].default == default(f), f.name
        assert params[f.name].annotation == f.type, f.name  # the type declared once, shown where it is taken
        assert params[f.name].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    assert [p.name for p in params.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD] == \
        before + ["model", "dataset"]


@pytest.mark.parametrize("taker", sorted(TAKERS))
def test_every_keyword_is_documented_where_it_is_taken(taker):
    fn, before, after = TAKERS[taker]
    doc = inspect.getdoc(fn)
    for name in [f.name for f in REQUEST] + after:
        assert f"\n    {name}: " in doc, (taker, name)


def test_a_teacher_is_a_request_plus_where_a_runs():
    t = Teacher(model=TinyA(), dataset=VectorData(8), device="cpu", fill=True, tokens=None)
    assert isinstance(t, ComputeRequest) and not isinstance(t, ComputeCall)
    assert {f.name for f in dataclasses.fields(Teacher) if f.init} - {f.name for f in REQUEST} == {"device", "fill"}
    assert dataclasses.replace(t, fill=False).fill is False and Teacher(TinyA(), VectorData(8)).device == "cpu"
    with pytest.raises(TypeError):  # beyond model and dataset, keywords only (a third positional is refused)
        Teacher(TinyA(), VectorData(8), {"features": "float32"})


def test_arguments_are_checked_where_the_call_is_made():
    data = VectorData(8)
    for kw, match in [({"outputs": {}}, "outputs must be"), ({"outputs": {"f": "float7"}}, "unknown output codec"),
                      ({"batch_size": 0}, "batch_size"), ({"tokens": "all"}, "featstore.Tokens"),
                      ({"options": {"progress": False}}, "ComputeOptions"),
                      ({"options": ComputeOptions(autocast="int8")}, "autocast"),
                      ({"keep": ["a b"]}, "array name"),
                      ({"tokens": Tokens(mask=len, max_tokens=4, outputs=["x"])}, "not outputs"),
                      ({"views": Views(k=2, augment=noisy_flip), "augment": noisy_flip}, "inside views=")]:
        for make in (ComputeRequest, Teacher):
            with pytest.raises(InvalidInput, match=match):
                make(model=TinyA(), dataset=data, **kw)


def test_the_deprecated_views_keywords_warn_at_the_callers_line(local_store):
    data = VectorData(8)
    with pytest.warns(DeprecationWarning, match=r"compute\(views=K") as seen:
        with pytest.raises(InvalidInput, match="name"):  # the warning comes before the name is checked
            local_store.compute("bad name", model=TinyA(), dataset=data, views=2, augment=noisy_flip)
    assert seen[0].filename == __file__
    with pytest.warns(DeprecationWarning, match=r"Teacher\(views=K") as seen:
        t = Teacher(model=TinyA(), dataset=data, views=2, augment=noisy_flip, augment_seed=3)
    assert seen[0].filename == __file__ and (t.view_count, t.view_augment, t.view_seed) == (2, noisy_flip, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the Views form, and augment alone, warn nothing
        Teacher(model=TinyA(), dataset=data, views=Views(k=2, augment=noisy_flip, seed=3))
        Teacher(model=TinyA(), dataset=data, augment=noisy_flip)
        ComputeRequest(model=TinyA(), dataset=data, augment=noisy_flip, views_of="a/b@0123456789abcdef")


def test_augment_without_views_is_refused_by_compute_before_anything_runs(local_store):
    with pytest.raises(InvalidInput, match="augment= needs views"):
        local_store.compute("tiny/aug", model=TinyA(), dataset=VectorData(8), augment=noisy_flip, client="in-process")
    assert local_store.names() == []


def test_the_package_names_the_request_publicly():
    import featstore.compute as fc

    assert {"ComputeRequest", "ComputeCall", "ComputePlan", "decide", "compute_shard", "ShardRunner",
            "InProcessRunner", "DaskRunner", "IN_PROCESS"} <= set(fc.__all__)
    assert fc.IN_PROCESS == "in-process" and featstore.Teacher is featstore.online.Teacher
