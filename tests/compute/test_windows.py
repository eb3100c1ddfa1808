"""Batches cut by input size (``ComputeOptions(group_by_length=True)``, the default): where a
collate pads inputs of different sizes, a shard task orders a window of its samples by size
before it cuts the batches, and stores the outputs in sample order all the same (issue 42)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import featstore
from featstore import ComputeOptions, OutputMismatch, Views
from featstore.compute._task_spec import Probe
from featstore.compute._windows import GROUP_BATCHES, Span, input_size, plan_windows, window_rows
from featstore.format._manifests import ArraySpec, Layout
from featstore.ragged import pad_sequences
from featstore.versions._views import SEED_FIELD

from tests.models import LengthDependent, MeanPool, RaisesOnToken, TokenSeqs, drop_a_token

N = 150


def compute(store, client, model=None, data=None, grouped=True, **kw):
    kw.setdefault("samples_per_shard", 24)
    return store.compute("pool/x", model=model or MeanPool(), dataset=data or TokenSeqs(N, lo=1, hi=40),
                         input_key="input", keep=["target"], outputs={"emb": "float32"}, batch_size=8, client=client,
                         options=ComputeOptions(progress=False, collate=pad_sequences, group_by_length=grouped), **kw)


def per_sample(data) -> torch.Tensor:
    """MeanPool's output for each sample alone (no padding at all)."""
    m = MeanPool()
    with torch.no_grad():
        return torch.cat([m(pad_sequences([data[i]["input"]])) for i in range(len(data))])


def batches(path) -> list[tuple[int, int, int]]:
    """(rows, padded width, real tokens) of each forward MeanPool logged, the probe's first."""
    return [tuple(map(int, line.split())) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("client", ["in-process", "dask"])
def test_batches_by_size_store_what_batches_in_order_store(tmp_path, dask_client, client):
    client = dask_client if client == "dask" else client
    data = TokenSeqs(N, lo=1, hi=40)
    got = {}
    for grouped in (True, False):
        log = tmp_path / f"log-{grouped}"
        v = compute(featstore.open_store(tmp_path / str(grouped)), client, MeanPool(path=str(log)), grouped=grouped)
        assert v.verify() == []
        got[grouped] = (v[0:N], batches(log))
    by_size, in_order = got[True], got[False]
    # the same rows, in sample order: A's outputs to rounding, the kept fields and digests exactly
    torch.testing.assert_close(torch.as_tensor(np.asarray(by_size[0]["emb"])), per_sample(data), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.as_tensor(np.asarray(in_order[0]["emb"])), per_sample(data), atol=1e-5, rtol=1e-5)
    for name in in_order[0]:
        if name != "emb":
            np.testing.assert_array_equal(np.asarray(by_size[0][name]), np.asarray(in_order[0][name]), err_msg=name)
    # every sample once, in batches of at most 8, padded far less
    for logged in (by_size[1], in_order[1]):
        assert sum(rows for rows, _, _ in logged[1:]) == N and max(rows for rows, _, _ in logged[1:]) <= 8
        assert sum(real for _, _, real in logged[1:]) == sum(len(s) for s in data.items)
    padded = {k: sum(rows * width for rows, width, _ in got[k][1][1:]) for k in got}
    assert padded[True] < 0.75 * padded[False], padded


def test_in_order_keeps_consecutive_batches(tmp_path):
    """group_by_length=False: each shard's batches are 8 consecutive samples from its first."""
    data = TokenSeqs(N, lo=1, hi=40)
    log = tmp_path / "log"
    compute(featstore.open_store(tmp_path / "s"), "in-process", MeanPool(path=str(log)), grouped=False)
    want = []
    for s0 in range(0, N, 24):
        for b0 in range(s0, min(s0 + 24, N), 8):
            rows = data.items[b0:min(b0 + 8, s0 + 24, N)]
            want.append((len(rows), max(map(len, rows)), sum(map(len, rows))))
    assert batches(log)[1:] == want


def test_views_of_batches_by_size_replay(tmp_path):
    """With views (an augment that changes lengths), the seeds stored with each row replay it."""
    data = TokenSeqs(N, lo=2, hi=40)
    store = featstore.open_store(tmp_path / "s")
    v = compute(store, "in-process", data=data, views=Views(k=2, augment=drop_a_token, seed=3))
    ref = compute(featstore.open_store(tmp_path / "o"), "in-process", data=data, grouped=False,
                  views=Views(k=2, augment=drop_a_token, seed=3))
    assert v.verify() == [] and v.id == ref.id
    for view in range(2):
        a, b = v.view(view).load(), ref.view(view).load()
        torch.testing.assert_close(a["emb"], b["emb"], atol=1e-5, rtol=1e-5)
        assert torch.equal(a[SEED_FIELD], b[SEED_FIELD]) and torch.equal(a["target"], b["target"])


def test_a_failing_batch_names_its_samples(tmp_path):
    data = TokenSeqs(N, vocab=5000, lo=1, hi=40)
    probed = {t for s in data.items[:8] for t in s.tolist()}  # the probe runs A on the first 8
    token = next(t for t in data.items[100].tolist() if t not in probed)
    holders = [i for i, s in enumerate(data.items) if token in s.tolist()]
    with pytest.raises(featstore.FeatstoreError, match=r"batched by size") as info:
        compute(featstore.open_store(tmp_path / "s"), "in-process", RaisesOnToken(token, vocab=5000), data=data,
                samples_per_shard=150)
    assert any(str(i) in str(info.value) for i in holders)


def test_an_output_shape_that_follows_the_padding_is_refused(tmp_path):
    with pytest.raises(OutputMismatch, match="must not change between batches"):
        compute(featstore.open_store(tmp_path / "s"), "in-process", LengthDependent())
    assert featstore.open_store(tmp_path / "s").versions("pool/x") == []


# -- pure arithmetic ---------------------------------------------------------------------------
def spec(n=100, per_shard=24, batch_size=8, width=4):
    base = featstore.compute._task_spec.TaskSpec  # the fields a window plan reads
    fields = {f.name: None for f in dataclasses.fields(base) if f.default is dataclasses.MISSING
              and f.default_factory is dataclasses.MISSING}
    fields.update(outputs={"emb": "float32"}, layout=Layout(n, per_shard, per_shard), batch_size=batch_size,
                  arrays={"emb": ArraySpec("float32", "float32", (width,), "output")}, keep={}, threads=0)
    return base(**fields, dtypes={"emb": "float32"})


def test_windows_hold_whole_shards_up_to_32_batches():
    s = spec(n=1000, per_shard=100, batch_size=8)
    assert window_rows(s) == GROUP_BATCHES * 8 == 256
    windows = plan_windows(s, range(10), by_size=True)
    assert [[w.shard for w in win.spans] for win in windows] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert all(sp.first and sp.last for win in windows for sp in win.spans)
    # a shard larger than a window is cut into windows of whole batches
    big = plan_windows(spec(n=600, per_shard=600, batch_size=8), [0], by_size=True)
    assert [(sp.b0, sp.b1, sp.first, sp.last) for win in big for sp in win.spans] == \
        [(0, 256, True, False), (256, 512, False, False), (512, 600, False, True)]
    # in order: one window per batch, from each shard's first sample
    assert plan_windows(spec(n=30, per_shard=12), [2], by_size=False)[0].spans == (Span(2, 24, 30, True, True),)


def test_a_window_holds_at_most_64_mib_of_outputs():
    assert window_rows(spec(batch_size=8, width=2**20)) == 16  # 4 MiB per sample: two batches
    assert window_rows(spec(batch_size=4, width=2**20)) == 16  # four
    assert window_rows(spec(batch_size=32, width=2**20)) == 32  # one batch at least


@pytest.mark.parametrize("x,size", [(torch.zeros(3, 4), 12), (np.zeros(5), 5), ([1, 2], 2), ("abc", 3),
                                    ({"a": torch.zeros(2), "b": [1, 2, 3]}, 5), (7, None), ({"a": 1}, None)])
def test_input_size(x, size):
    assert input_size(x) == size


def test_small_shards_join_into_one_task_where_batches_are_cut_by_size():
    from featstore.compute._driver import _shards_per_task

    s = dataclasses.replace(spec(n=1000, per_shard=100, batch_size=8), collate=pad_sequences)
    probe = Probe({}, 0.0, sizes_vary=True)
    assert _shards_per_task(s, probe, 1) == 2  # 256-sample windows: two shards of 100
    assert _shards_per_task(s, probe, 3) == 3 and _shards_per_task(s, probe, None) is None  # asked for: kept
    assert _shards_per_task(s, Probe({}, 0.0), 1) == 1  # inputs of one size
    assert _shards_per_task(dataclasses.replace(s, group_by_length=False), probe, 1) == 1
