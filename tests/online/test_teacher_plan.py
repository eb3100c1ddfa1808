"""The teacher in the loop plans with compute's own planner (featstore.compute.decide): for per-token
outputs, views_of and extends the planned manifest is the one compute commits, and a shard computed
in-process (featstore.compute.compute_shard, what the online reader runs) holds the task's bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader

from featstore import ComputeOptions, InvalidInput, Teacher, Tokens, Views
from featstore.compute import compute_shard, worker_model
from featstore.format import shard_digest
from featstore.online import plan_teacher
from featstore.versions import stored
from featstore.ragged import attention_mask, pad_sequences

from ..augments import noisy_flip
from ..models import GrowingData, TinyA, TinyLM, TokenSeqs, VectorData

N = 100
LM = dict(keep=["target"], outputs={"logits": "float16", "hidden": "topk:5"}, batch_size=8, samples_per_shard=16,
          options=ComputeOptions(progress=False, collate=pad_sequences),
          tokens=Tokens(mask=attention_mask, max_tokens=12, outputs=["logits"]))


class TwoHeadLM(torch.nn.Module):
    """TinyLM's per-token logits and a per-sample head (the last real token's logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TinyLM()

    def forward(self, x):
        logits = self.lm(x)
        last = x["attention_mask"].sum(1) - 1
        return {"logits": logits, "hidden": logits[torch.arange(len(logits)), last]}


def planned_part(manifest):
    """What is decided before any shard is computed (the commit adds statistics, records, times)."""
    return (manifest.id, manifest.fingerprint, manifest.fingerprint_parts, manifest.layout, manifest.arrays,
            manifest.views, manifest.bases, manifest.dataset_sample)


def epoch(ds):
    return list(DataLoader(ds, batch_size=None, num_workers=0))


def test_a_teacher_with_per_token_outputs_plans_the_version_compute_commits(local_store):
    teacher = Teacher(model=TwoHeadLM(), dataset=TokenSeqs(N), **LM)
    planned = plan_teacher(local_store.catalog, "lm/online", teacher)
    committed = local_store.compute("lm/online", model=TwoHeadLM(), dataset=TokenSeqs(N), client="in-process", **LM)
    assert planned.version.manifest.arrays["logits"].ragged and not planned.version.manifest.arrays["hidden.ids"].ragged
    assert planned_part(planned.version.manifest) == planned_part(committed.manifest)
    assert planned.spec.tokens == LM["tokens"] and planned.spec.ragged == ("logits",)
    # each shard computed here, as the online reader computes it, is the task's shard byte for byte
    device = torch.device("cpu")
    net = worker_model(teacher.model, planned.spec.model_key, 0, device)
    receipts = stored(committed).shard_receipts()
    for i in range(committed.manifest.layout.n_shards):
        rows = compute_shard(planned.spec, net, teacher.dataset, i, device)
        assert {name: shard_digest(buf) for name, buf in rows.buffers.items()} == receipts[i].digests, i
    fill = dataclasses.replace(teacher, fill=True)
    assert plan_teacher(local_store.catalog, "lm/online", fill) == committed  # committed already: read as stored
    # read online (tests/online/test_tokens_online.py compares every mode): the planned version
    online = local_store.dataset("lm/online", batch_size=10, teacher=teacher)
    assert online.online and online.version.id == committed.id


def test_a_teacher_on_another_versions_views_plans_and_reads_the_aligned_version(local_store):
    data = VectorData(N)
    base = local_store.compute("a/views", model=TinyA(), dataset=data, keep=["target"], samples_per_shard=32,
                               batch_size=16, views=Views(k=2, augment=noisy_flip, seed=3), client="in-process",
                               options=ComputeOptions(progress=False))
    kw = dict(model=TinyA(seed=1), dataset=data, outputs={"logits": "float32"}, samples_per_shard=None,
              batch_size=16, augment=noisy_flip, views_of=base.ref, options=ComputeOptions(progress=False))
    teacher = Teacher(**kw)
    assert not teacher.fresh
    online = local_store.dataset("b/views", batch_size=30, seed=2, teacher=teacher)
    stored = local_store.compute("b/views", client="in-process", **kw)
    assert planned_part(online.version.manifest) == planned_part(stored.manifest)
    assert stored.views_of == base.ref and online.version.views == 2
    plain = stored.dataset(batch_size=30, seed=2)
    for e in (0, 1):
        online.set_epoch(e)
        plain.set_epoch(e)
        got, want = epoch(online), epoch(plain)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert sorted(g) == sorted(w) and all(torch.equal(g[k], w[k]) for k in w)


def test_a_teacher_extending_a_version_plans_the_child_and_refuses_to_fill_it(local_store):
    opts = ComputeOptions(progress=False)
    kw = dict(keep=["target"], outputs={"features": "float32"}, batch_size=16, samples_per_shard=32, options=opts)
    parent = local_store.compute("grow/set", model=TinyA(), dataset=GrowingData(70), client="in-process", **kw)
    teacher = Teacher(model=TinyA(), dataset=GrowingData(130), extends=parent.ref, **kw)
    planned = plan_teacher(local_store.catalog, "grow/set", teacher)
    child = local_store.compute("grow/set", model=TinyA(), dataset=GrowingData(130), extends=parent.ref,
                                client="in-process", **kw)
    assert planned_part(planned.version.manifest) == planned_part(child.manifest) and child.manifest.bases
    with pytest.raises(InvalidInput, match="extends="):
        dataclasses.replace(teacher, fill=True)
