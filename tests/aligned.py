"""Two teachers on the same views, for the views_of and multi-teacher tests: teacher "a" computed
with K views, teacher "b" (another model, other outputs) computed with ``views_of=a``."""

from __future__ import annotations

import featstore

from .helpers import TinyA, VectorData, noisy_flip, write_version

N, SPP, K, SEED = 80, 32, 3, 7
OUT_A = {"features": "float16", "logits": "float32"}
OUT_B = {"logits": "topk:3"}  # another codec: b's batches carry logits.ids / logits.values


def teacher_a(store, views=K, name="teacher-a/train", data=None, **kw):
    """Model A (TinyA seed 0) on ``views`` views of VectorData(N) (None: no views)."""
    aug = {} if views is None else {"views": featstore.Views(k=views, augment=noisy_flip, seed=SEED)}
    return write_version(store, name, model=TinyA(), dataset=data or VectorData(N),
                         keep={"target": "target", "seen": "input"}, outputs=OUT_A, samples_per_shard=SPP,
                         batch_size=16, **aug, **kw)


def copy_to_s3(store, endpoint):
    """The local ``store``'s objects put as they are into a fresh bucket: the same versions on S3
    (reading them there is what the S3 tests exercise; computing on S3 is test_views' business)."""
    import s3fs

    from .servers import new_bucket

    bucket = new_bucket(endpoint)
    s3fs.S3FileSystem(endpoint_url=endpoint).put(f"{store.storage.root}/", f"{bucket}/feats", recursive=True)
    return featstore.open_store(f"s3://{bucket}/feats", {"endpoint_url": endpoint})


def teacher_b(store, base, augment=noisy_flip, name="teacher-b/train", data=None, **kw):
    """Another Model A (TinyA seed 1, a 5-class head stored top-3) on ``base``'s views."""
    if base.views is None and augment is noisy_flip:
        augment = None
    kw = {"samples_per_shard": None, **kw}  # None: base's layout
    return write_version(store, name, model=TinyA(seed=1), dataset=data or VectorData(N), keep={"seen": "input"},
                         outputs=OUT_B, batch_size=16, views_of=base.ref,
                         **({} if augment is None else {"augment": augment}), **kw)
