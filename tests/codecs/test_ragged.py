"""Per-token (ragged) outputs of token sequences: stored as flat token rows plus per-sample
``token_start``/``token_length``, read back flat with ``<name>.offsets`` or padded (issue 10)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

import featstore
from featstore import ComputeOptions, InvalidInput, Tokens, kd
from featstore.format._shard_decoder import shard_format, shard_index
from featstore.ragged import RaggedRows, RaggedWindow, attention_mask, gather_rows, offsets, pack, padded, token_layout
from featstore.ragged import pad_sequences as pad_tokens
from featstore.versions import stored

from tests.models import TinyLM, TokenSeqs, drop_a_token

OPTS = ComputeOptions(progress=False, collate=pad_tokens)
TOKENS = Tokens(mask=attention_mask, max_tokens=12)
N, VOCAB = 60, 97


def _compute(store, codec="float16", name=None, **kw):
    return store.compute(name or f"lm/{codec.replace(':', '-')}", model=TinyLM(), dataset=TokenSeqs(N), keep=["target"],
                         outputs={"logits": codec}, batch_size=8, samples_per_shard=16, options=OPTS,
                         tokens=kw.pop("tokens", TOKENS), **kw)


def _teacher(rows):
    """A's per-token logits for samples ``rows``, computed directly: ``[T, vocab]`` and lengths."""
    data = TokenSeqs(N)
    x = pad_tokens([data[i]["input"] for i in rows])
    with torch.no_grad():
        return pack(TinyLM()(x), x["attention_mask"])


# -- pure arithmetic ---------------------------------------------------------------------------
@pytest.mark.parametrize("lengths", [[3, 0, 5], [0, 0], [1], [7, 7, 7, 1]])
def test_gather_rows_and_offsets_select_each_samples_rows(lengths):
    lengths = np.array(lengths)
    starts = np.array([100 * i for i in range(len(lengths))])
    want = [r for s, n in zip(starts, lengths, strict=True) for r in range(s, s + n)]
    assert gather_rows(starts, lengths).tolist() == want
    assert offsets(lengths).tolist() == [0, *np.cumsum(lengths).tolist()]


def test_ragged_window_gathers_rows_in_batch_order_and_pads():
    w = RaggedWindow([RaggedRows(np.arange(5), np.array([2, 3])), RaggedRows(np.arange(10, 11), np.array([1]))])
    got = w.take(np.array([2, 0, 1]))
    assert got.flat.tolist() == [10, 0, 1, 2, 3, 4] and got.lengths.tolist() == [1, 2, 3]
    assert padded(torch.from_numpy(got.flat), torch.from_numpy(got.lengths), -1).tolist() == \
        [[10, -1, -1], [0, 1, -1], [2, 3, 4]]


@pytest.mark.parametrize("spp,max_tokens", [(16, 12), (1, 512), (100, 512), (3, 7), (3, 64), (21, 64), (500, 77),
                                            (1, 1), (70, 64), (257, 4096)])
def test_token_layout_chunks_are_sized_by_bytes_and_every_array_shares_the_range(spp, max_tokens):
    need = spp * max_tokens
    ranges = set()
    for row_bytes in (1, 8, 50, 100, 194, 256, 65536, 2**21):  # topkq:50's tail, values, ids; a wide row
        per_shard, chunk = token_layout(spp, max_tokens, row_bytes)
        ranges.add(per_shard)
        assert need <= per_shard < 2 * need + 2**14 and per_shard % chunk == 0
        by_bytes = min(2**14, max(16, 1 << max((2**20 // row_bytes).bit_length() - 1, 0)))
        # ~1 MiB of rows (a power of two), or the shard's whole range where that is smaller
        assert chunk == min(by_bytes, per_shard)
        assert chunk * row_bytes <= max(2**20, 16 * row_bytes)
    assert len(ranges) == 1  # the ids, values and tail of one output own the same token rows


# -- storage: only the real tokens -------------------------------------------------------------
def test_only_real_tokens_are_stored_and_plain_zarr_reads_them(local_store):
    v = _compute(local_store)
    spec = v.manifest.arrays["logits"]
    assert spec.ragged and spec.shape == (VOCAB,)
    g = zarr.open_group(stored(v).storage.path(stored(v).key), mode="r")
    start, length = g["token_start"][:], g["token_length"][:]
    lengths = [len(TokenSeqs(N)[i]["input"]) for i in range(N)]
    assert length.tolist() == lengths
    assert g["logits"].metadata.dimension_names[0] == "token"
    # plain Zarr: sample i's tokens are logits[start[i]:start[i] + length[i]]
    flat, _ = _teacher([7])
    got = torch.from_numpy(g["logits"][start[7]:start[7] + length[7]]).float()
    torch.testing.assert_close(got, flat, atol=0.02, rtol=0.01)
    # each shard object holds only the chunks that cover its samples' tokens
    per_shard, chunk = spec.tokens
    fmt = shard_format(stored(v).array("logits"))
    for s, (a, b) in enumerate(v.manifest.layout.shard_range(i) for i in range(v.manifest.layout.n_shards)):
        raw = (stored(v).storage.path(stored(v).key) + f"/logits/c/{s}/0")
        index = shard_index(open(raw, "rb").read(), fmt)
        kept = int((index[:, 0] != np.uint64(2**64 - 1)).sum())
        assert kept == -(-int(length[a:b].sum()) // chunk)
        assert start[a] == s * per_shard


# topp:0.4 on TinyLM's flat teacher: of 439 tokens, 12 keep MIN_K=2, 122 stop at the cap of 16,
# the others keep 3-15 classes (each branch of the rule is exercised)
@pytest.mark.parametrize("codec", ["float16", "topk:8", "topp:0.4:2:16", "sample:16", "int8"])
def test_random_access_and_load_match_the_teachers_tokens(store, codec):
    v = _compute(store, codec)
    rows = [3, 20, 59, 21]
    got = v[rows]
    flat, lengths = _teacher(rows)
    assert got["logits.offsets"].tolist() == offsets(lengths.numpy()).tolist()
    if codec in ("float16", "int8"):
        torch.testing.assert_close(got["logits"].float(), flat, atol=0.05, rtol=0.02)
    elif codec == "topk:8":
        top = torch.log_softmax(flat, -1).topk(8)
        assert torch.equal(got["logits.ids"], top.indices)
        torch.testing.assert_close(got["logits.values"].float(), top.values, atol=0.01, rtol=0.01)
    elif codec.startswith("topp"):
        assert torch.equal(got["logits.ids"][:, 0], flat.argmax(-1))  # the most likely class first
        _check_top_p(got, flat, p=0.4, min_k=2, cap=16)
    else:  # counts sum to S per token, and S draws per token follow the teacher's distribution
        assert got["logits.counts"].sum(-1).tolist() == [16] * len(flat)
    one = v[20]
    assert "logits.offsets" not in one and len(one[next(k for k in one if k.startswith("logits"))]) == lengths[1]
    whole = v.load()
    assert int(whole["logits.offsets"][-1]) == sum(len(TokenSeqs(N)[i]["input"]) for i in range(N))
    if codec.startswith("sample"):  # every token's draws (439 tokens x 16) against the teacher
        _check_draws(whole, _teacher(range(N))[0], draws=16)
    if codec.startswith("topp"):  # the rule on every token of the version
        _check_top_p(whole, _teacher(range(N))[0], p=0.4, min_k=2, cap=16)
    assert v.verify() == []


def _check_top_p(got, flat, p: float, min_k: int, cap: int) -> None:
    """``topp:P:MIN_K:CAP``'s rule on every token, against the teacher's probabilities: the kept
    classes are the most likely ones, their stored values are their log-probabilities, and the
    set is the smallest reaching mass ``p`` (at least ``min_k``, at most ``cap``)."""
    prob = torch.softmax(flat.double(), -1)
    ids, vals = got["logits.ids"], got["logits.values"].double()
    kept = (ids >= 0).sum(-1)
    for t in range(len(flat)):
        k = int(kept[t])
        assert min_k <= k <= cap and (ids[t, k:] == -1).all()
        mine = prob[t, ids[t, :k]]
        top = prob[t].topk(k).values
        torch.testing.assert_close(mine.sum(), top.sum(), atol=1e-4, rtol=0)  # the k most likely
        torch.testing.assert_close(vals[t, :k], mine.log(), atol=0.02, rtol=0.01)  # fp16 log-probs
        mass, before = float(mine.sum()), float(mine[:-1].sum())
        assert k == cap or mass >= p - 1e-4, (t, k, mass)  # reaches p, or stops at the cap
        assert k == min_k or before < p + 1e-4, (t, k, before)  # and one class fewer would not


def _check_draws(got, flat, draws: int) -> None:
    """``sample:S`` draws from the teacher's distribution: the drawn ids' counts, summed over
    every token into bins of teacher rank (the most likely class, ranks 2-5, 6-20, the rest),
    against their expected S * P(bin); a Pearson chi-square with 3 degrees of freedom. The draws
    are seeded, so the statistic is one fixed number (last run: printed); 30 is p ~ 1e-6."""
    prob = torch.softmax(flat.double(), -1)
    ids, counts = got["logits.ids"], got["logits.counts"]
    assert ids.shape == counts.shape == (len(flat), draws) and (counts.sum(-1) == draws).all()
    assert ((ids >= 0) == (counts > 0)).all() and ((ids >= 0).sum(-1) == (counts > 0).sum(-1)).all()
    rank = prob.argsort(-1, descending=True).argsort(-1)  # each class's rank per token, 0 = most likely
    bins = torch.bucketize(rank, torch.tensor([1, 5, 20]), right=True)  # 0: top-1, 1: 2-5, 2: 6-20, 3: rest
    seen = torch.zeros(4, dtype=torch.float64)
    token = torch.arange(len(flat))[:, None].expand_as(ids)
    real = ids >= 0
    seen.index_add_(0, bins[token[real], ids[real]], counts[real].double())
    expected = torch.zeros(4, dtype=torch.float64).index_add_(0, bins.reshape(-1), prob.reshape(-1)) * draws
    chi2 = float(((seen - expected) ** 2 / expected).sum())
    print(f"\n[sample:{draws}] drawn per rank bin {seen.tolist()}, "
          f"expected {[round(e, 1) for e in expected.tolist()]}, chi2 {chi2:.2f}")
    assert chi2 < 30, (seen.tolist(), expected.tolist(), chi2)


def test_a_flipped_byte_in_a_token_shard_is_found_by_verify_and_the_reader(local_store):
    v = _compute(local_store)
    path = stored(v).storage.path(stored(v).key) + "/logits/c/1/0"
    data = bytearray(open(path, "rb").read())
    data[100] ^= 0x10
    open(path, "wb").write(bytes(data))
    problems = v.verify()
    assert len(problems) == 1 and "logits/c/1/0" in problems[0]
    with pytest.raises(featstore.CorruptChunk, match="logits"):
        for _ in local_store.dataset(v.ref, batch_size=8):
            pass


# -- the reader: samples, not tokens -----------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("form", ["flat", "padded"])
def test_reader_yields_every_samples_tokens_once(store, workers, form):
    v = _compute(store, "topk:8")
    whole = v.load()
    ds = store.dataset(v.ref, batch_size=7, shuffle=True, seed=3, ragged=form)
    seen = []
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    for batch in loader:
        for j, i in enumerate(batch["index"].tolist()):
            o = whole["logits.offsets"]
            want = whole["logits.ids"][o[i]:o[i + 1]]
            if form == "flat":
                bo = batch["logits.offsets"]
                got = batch["logits.ids"][bo[j]:bo[j + 1]]
            else:
                n = int(batch["logits.lengths"][j])
                got = batch["logits.ids"][j, :n]
                assert (batch["logits.ids"][j, n:] == -1).all()
                assert torch.isneginf(batch["logits.values"][j, n:]).all()
            assert torch.equal(got, want)
            seen.append(i)
    assert sorted(seen) == list(range(N))


def test_ranks_split_samples_and_resume_continues_mid_epoch(local_store):
    v = _compute(local_store)
    per_rank = [[i for b in local_store.dataset(v.ref, batch_size=5, rank=r, world_size=2, partition="even")
                 for i in b["index"].tolist()] for r in range(2)]
    assert sorted(per_rank[0] + per_rank[1]) == list(range(N)) and not set(per_rank[0]) & set(per_rank[1])
    ds = local_store.dataset(v.ref, batch_size=5, seed=1)
    full = list(ds)
    again = local_store.dataset(v.ref, batch_size=5, seed=1)
    again.load_state_dict(ds.state_dict(batches_seen=4))
    rest = list(again)
    assert [b["index"].tolist() for b in rest] == [b["index"].tolist() for b in full[4:]]
    for a, b in zip(rest, full[4:], strict=True):
        assert torch.equal(a["logits"], b["logits"]) and torch.equal(a["logits.offsets"], b["logits.offsets"])


def test_views_of_token_sequences_store_each_views_own_length(local_store):
    v = local_store.compute("lm/views", model=TinyLM(), dataset=TokenSeqs(N), keep=["target"],
                            outputs={"logits": "float16"}, batch_size=8, samples_per_shard=16, options=OPTS,
                            tokens=TOKENS, views=2, augment=drop_a_token)
    for view in range(2):
        got = v[view, [5, 6]]
        data = TokenSeqs(N)
        seen = [drop_a_token(data[i], torch.Generator().manual_seed(v.view_seed(i, view)))["input"] for i in (5, 6)]
        assert got["logits.offsets"].tolist() == [0, len(seen[0]), len(seen[0]) + len(seen[1])]
        x = pad_tokens(seen)
        with torch.no_grad():
            flat, _ = pack(TinyLM()(x), x["attention_mask"])
        torch.testing.assert_close(got["logits"].float(), flat, atol=0.05, rtol=0.02)
    epochs = []
    ds = local_store.dataset(v.ref, batch_size=16)
    for epoch in range(2):
        ds.set_epoch(epoch)
        epochs.append({(int(i), int(w)) for b in ds for i, w in zip(b["index"], b["view"], strict=True)})
    assert epochs[0] | epochs[1] == {(i, w) for i in range(N) for w in range(2)}


# -- KD on the sparse ragged form ---------------------------------------------------------------
@pytest.mark.parametrize("codec", ["topk:8", "sample:16"])
def test_kd_loss_on_sparse_ragged_tokens_equals_dense_kd_on_the_same_support(local_store, codec):
    v = _compute(local_store, codec)
    batch = next(iter(local_store.dataset(v.ref, batch_size=10, seed=2)))
    tokens = batch["logits.ids"].shape[0]
    student = torch.randn(tokens, VOCAB, generator=torch.Generator().manual_seed(0), requires_grad=True)
    sparse = kd.kd_loss(student, batch, "logits", temperature=2.0)
    teacher = kd.densify(batch, "logits", VOCAB)  # the same support and weights, dense [T, V]
    logq = torch.log_softmax(student / 2.0, -1)
    if codec.startswith("sample"):  # unbiased estimate: sum counts/S * (log p - log q) on the drawn ids
        ids, kept = batch["logits.ids"].clamp(min=0), batch["logits.ids"] >= 0
        logp = torch.zeros(tokens, VOCAB).scatter_add(1, ids, batch["logits.values"].float().masked_fill(~kept, 0))
    else:  # top-k rebuilt with the uniform tail: KL(teacher || student)
        logp = torch.log(teacher.clamp(min=1e-30))
    dense = (teacher * (logp - logq)).sum(-1).mean() * 4.0
    torch.testing.assert_close(sparse, dense, atol=1e-4, rtol=1e-4)
    sparse.backward()
    assert student.grad is not None and torch.isfinite(student.grad).all()


# -- never silently wrong ----------------------------------------------------------------------
def test_a_sample_longer_than_max_tokens_is_refused_and_nothing_is_committed(local_store):
    with pytest.raises(InvalidInput, match="max_tokens=8"):
        _compute(local_store, tokens=Tokens(mask=attention_mask, max_tokens=8))
    assert local_store.versions("lm/float16") == []


@pytest.mark.parametrize("bad,match", [
    (lambda: Tokens(mask=attention_mask, max_tokens=0), "max_tokens"),
    (lambda: Tokens(mask="attention_mask", max_tokens=4), "mask"),
    (lambda: Tokens(mask=attention_mask, max_tokens=4, outputs="logits"), "outputs"),
])
def test_bad_token_options_say_what_to_pass(bad, match):
    with pytest.raises(InvalidInput, match=match):
        bad()


def test_mask_of_the_wrong_shape_and_unknown_outputs_are_refused(local_store):
    with pytest.raises(InvalidInput, match=r"\[8, L\]"):
        _compute(local_store, tokens=Tokens(mask=lambda x: x["attention_mask"][:, :1].T, max_tokens=12))
    with pytest.raises(InvalidInput, match="not outputs"):
        _compute(local_store, tokens=Tokens(mask=attention_mask, max_tokens=12, outputs=["features"]))
    with pytest.raises(InvalidInput, match="reserved"):
        local_store.compute("lm/x", model=TinyLM(), dataset=TokenSeqs(N), keep={"token_length": "target"},
                            outputs={"logits": "float16"}, options=OPTS, tokens=TOKENS)


def test_extends_grows_token_sequences_and_reads_across_the_boundary(store):
    parent = _compute(store, "topk:8")
    data = TokenSeqs(N + 30)
    assert all(torch.equal(data[i]["input"], TokenSeqs(N)[i]["input"]) for i in range(N))
    child = store.compute("lm/topk-8", model=TinyLM(), dataset=data, keep=["target"], outputs={"logits": "topk:8"},
                          batch_size=8, samples_per_shard=16, options=OPTS, tokens=TOKENS, extends=parent.ref)
    assert child.manifest.bases and child.manifest.timings["shards_computed"] < child.manifest.layout.n_shards
    fresh = store.compute("lm/fresh", model=TinyLM(), dataset=data, keep=["target"], outputs={"logits": "topk:8"},
                          batch_size=8, samples_per_shard=16, options=OPTS, tokens=TOKENS).load()
    got = child.load()
    assert torch.equal(got["logits.offsets"], fresh["logits.offsets"])
    assert torch.equal(got["logits.ids"], fresh["logits.ids"])
    assert child.verify() == []
    seen = sorted(i for b in store.dataset(child.ref, batch_size=9) for i in b["index"].tolist())
    assert seen == list(range(N + 30))
    with pytest.raises(featstore.DatasetMismatch, match="tokens"):
        store.compute("lm/topk-8", model=TinyLM(), dataset=data, keep=["target"], outputs={"logits": "topk:8"},
                      batch_size=8, samples_per_shard=16, options=OPTS, extends=parent.ref,
                      tokens=Tokens(mask=attention_mask, max_tokens=13))
