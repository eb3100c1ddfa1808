"""1,000 hostile feature-set, tag and version names: every one refused, nothing written anywhere."""

from __future__ import annotations

import random

import pytest

import featstore
from featstore import InvalidName
from featstore._allowed_names import check_name, check_tag

from .models import VectorData

# Invalid wherever they stand: path escapes, encodings, control and look-alike characters.
ANYWHERE = ["..", "\\", "%2e%2e", "%2f", "%2e", "\0", "\n", "\t", " ", "~", "$HOME", "\u2024", "\uff0e",
            "\u2215", "\u2044", "\uff3c", "\u0430", "\u200b", "\ufeff", "é", "C:\\Windows", "file:///etc",
            "s3://other-bucket/x", "*", "?", "[a]", "'", '"', "<", ">", "|", ":", ";", "&", "#"]
# ("@" is not here: it separates name and tag in refs, see test_errors.)
# Invalid as a whole name or segment: absolute paths, empty or dot segments, reserved folders.
WHOLE = ["/etc/passwd", ".", "/", "//", "_versions", "_tags", "x" * 300, "", "a.", ".hidden"]
HOSTILE = ANYWHERE + WHOLE
SAFE = ["a", "set", "B1", "x-y", "v.2", "name_"]


def hostile_names(count: int = 1000, seed: int = 0) -> list[str]:
    """Names that each contain at least one forbidden piece, in many arrangements."""
    rng = random.Random(seed)
    names: set[str] = set(HOSTILE) | {f"a/{h}" for h in HOSTILE} | {f"{h}/a" for h in HOSTILE}
    while len(names) < count:
        parts = [rng.choice(SAFE) for _ in range(rng.randrange(0, 4))]
        parts.insert(rng.randrange(len(parts) + 1), rng.choice(ANYWHERE))
        sep = rng.choice(["/", "", "/", "\\", "/./", "/../"])
        names.add(sep.join(parts))
    return sorted(names)[:count]


NAMES = hostile_names()


def test_generator_makes_1000_distinct_hostile_names():
    assert len(NAMES) == 1000 == len(set(NAMES))


def refusal(fn, arg) -> str | None:
    """None when ``fn(arg)`` is refused with an InvalidName that says why, else what happened."""
    try:
        fn(arg)
    except InvalidName as err:
        return None if ("invalid" in str(err) or "must be" in str(err)) else f"unclear message: {err}"
    except Exception as err:  # noqa: BLE001 - any other outcome is a failure the test reports
        return f"{type(err).__name__}: {err}"
    return "accepted"


def test_every_hostile_name_is_refused_everywhere(local_store, tmp_path, dask_client):
    outside_before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    refused, wrong = 0, []
    for name in NAMES:
        calls = [(check_name, name), (local_store.open, name), (local_store.versions, name),
                 (local_store.tags, name), (local_store.open, f"ok/set@{name}"),
                 (lambda n: local_store.compute(n, model=None, dataset=VectorData(1), client=dask_client), name)]
        if "/" not in name:
            calls.append((check_tag, name))
        for fn, arg in calls:
            outcome = refusal(fn, arg)
            refused += outcome is None
            if outcome is not None:
                wrong.append((name, getattr(fn, "__name__", "compute"), outcome))
    assert wrong == []
    assert refused == 6 * 1000 + sum("/" not in n for n in NAMES)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == outside_before
    assert local_store.storage.find("") == []


def test_hostile_tags_are_refused_on_a_real_version(local_store, dask_client):
    from .models import TinyA

    v = local_store.compute("ok/set", model=TinyA(), dataset=VectorData(20), outputs={
        "features": "float32", "logits": "float32"}, client=dask_client,
        options=featstore.ComputeOptions(progress=False))
    before = local_store.storage.find("")
    for tag in NAMES:
        with pytest.raises(InvalidName):
            local_store.tag(v, tag)
        with pytest.raises(InvalidName):
            local_store.untag("ok/set", tag)
    assert local_store.storage.find("") == before


def test_hostile_names_on_s3_write_nothing(s3_url):
    import boto3

    url, opts = s3_url
    store = featstore.open_store(url, storage_options=opts)
    for name in NAMES[::10]:
        with pytest.raises(InvalidName):
            store.open(name)
        with pytest.raises(InvalidName):
            store.compute(name, model=None, dataset=VectorData(1))
    bucket = url[5:].split("/")[0]
    listing = boto3.client("s3", endpoint_url=opts["endpoint_url"]).list_objects_v2(Bucket=bucket)
    assert listing.get("KeyCount", 0) == 0
