"""What the test files share: quiet compute options, the one way to write a version that a test
only needs to read, fresh S3 stores, an epoch read through DataLoader workers; and, re-exported,
the small deterministic models, datasets and augments.

The models, datasets and augments are defined in ``tests/models.py`` and ``tests/augments.py``
and stay there: Dask and DataLoader worker processes import them by those paths, and a model's
module path is part of its code digest (a version's fingerprint). Import them from here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import featstore
from featstore import ComputeOptions

from tests.augments import CountingAugment, global_noise, noisy_flip  # noqa: F401 - re-exported
from tests.models import (MULTI_OUTPUTS, CountingA, DoubleLin, FailsAt, GrowingData, IdData,  # noqa: F401
                          MultiA, NaNAt, Raises, RaisesFrom, ReluLin, ShapeShift, SlowData, Tile, TinyA, TinyLM,
                          TokenSeqs, VectorData, assert_close_across_processes, drop_a_token, on_grid)

#: Compute options without the terminal progress bar.
QUIET = ComputeOptions(progress=False)
#: QUIET with 16-row chunks: several chunks per shard even in a test's small versions.
QUIET16 = ComputeOptions(progress=False, chunk_rows=16)
#: The outputs most reader tests store: fp16 features (a cast on write) and exact logits.
TINY_OUTPUTS = {"features": "float16", "logits": "float32"}


# -- writing a version a test reads ------------------------------------------------------------
def write_version(store: featstore.FeatureStore, name: str, *, model: Any = None, dataset: Any = None,
                  n: int = 333, outputs: dict[str, str] | None = None, keep: Any = ("target",),
                  samples_per_shard: int | None = 32, batch_size: int = 32, options: ComputeOptions = QUIET16,
                  client: Any = None, **kw: Any) -> featstore.Version:
    """Compute and commit a version for a test that needs one to read: ``TinyA`` on
    ``VectorData(n)`` unless ``model``/``dataset`` are given, ``TINY_OUTPUTS`` unless ``outputs``
    are; every other keyword goes to ``store.compute`` as it is (``views=``, ``extends=``,
    ``tokens=``, ...). ``client=None`` computes in this process (``client="in-process"``: the
    same shard task, no Dask cluster to start); a test of compute on a given cluster passes its
    client. The one place that decides how tests write the versions they read."""
    return store.compute(name, model=TinyA() if model is None else model,
                         dataset=VectorData(n) if dataset is None else dataset, keep=keep,
                         outputs=dict(TINY_OUTPUTS if outputs is None else outputs),
                         samples_per_shard=samples_per_shard, batch_size=batch_size, options=options,
                         client="in-process" if client is None else client, **kw)


def served(version: Any) -> dict[str, Any]:
    """The arrays a reader serves in batches (A's outputs and the kept fields): every array of the
    version but featstore's own (each sample's input digest, views' seeds, token starts)."""
    from featstore.format import SERVED_SOURCES

    return {n: a for n, a in version.manifest.arrays.items() if a.source in SERVED_SOURCES}


class SharedVersions(dict):
    """The versions many test files read, each written once per session (per xdist worker) on
    first use, each in a store of its own: ``TinyA`` on ``VectorData(n)`` (``TINY_OUTPUTS``, the
    target kept, 32-row shards of 16-row chunks), by kind:

    - ``"local"`` / ``"s3"`` (moto): 333 samples, 11 shards, compression "auto";
    - ``"local-zstd"``, ``"local-raw"``, ``"s3-raw"``: the same, compression "zstd" / "none";
    - ``"local-400"``: 400 samples (2 ranks x 2 workers read 100 each: no padding).

    Tests only read them (a test that damages or deletes copies the version first)."""

    KINDS = {"local": (333, "auto"), "s3": (333, "auto"), "local-zstd": (333, "zstd"), "local-raw": (333, "none"),
             "s3-raw": (333, "none"), "local-400": (400, "auto")}

    def __init__(self, root: Path, s3_endpoint: str) -> None:
        super().__init__()
        self.root, self.s3_endpoint = root, s3_endpoint

    def __missing__(self, kind: str) -> featstore.Version:
        n, compression = self.KINDS[kind]
        store = (s3_store(self.s3_endpoint, bucket="shared") if kind.startswith("s3")
                 else featstore.open_store(self.root / kind))
        self[kind] = write_version(store, "tiny/ds", n=n, options=dataclasses.replace(QUIET16, compression=compression))
        return self[kind]


# -- stores ------------------------------------------------------------------------------------
def s3_store(endpoint: str, prefix: str = "feats", bucket: str = "t") -> featstore.FeatureStore:
    """A store in a fresh bucket (named ``<bucket>-<random>``) on the S3 server at ``endpoint``."""
    from featstore.testing import new_bucket

    return featstore.open_store(f"s3://{new_bucket(endpoint, bucket)}/{prefix}", {"endpoint_url": endpoint})


# -- reading -----------------------------------------------------------------------------------
def epoch(ds: Any, workers: int = 0, context: str | None = None, timeout: float = 120) -> list[dict[str, torch.Tensor]]:
    """One epoch of ``ds`` through a DataLoader with ``workers`` worker processes (0: in this
    process), started by ``context`` (None: the platform's default)."""
    loader = DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context=context,
                        timeout=timeout if workers else 0)
    return list(loader)
