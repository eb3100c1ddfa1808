"""Several versions read as one weighted stream: :func:`mix` (a :class:`~featstore.FeatureDataset`).

>>> ds = featstore.mix([(web, 0.7), (code, 0.3)], epoch_size=100_000, batch_size=256, seed=0)
>>> for batch in DataLoader(ds, batch_size=None, num_workers=2):
...     batch["features"], batch["index"], batch["source"]   # source: the row's stream, ds.versions[i]

The plan is the pure one of :mod:`featstore.read.plans` (weights as Mosaic Streaming defines
them: ``proportion``, ``repeat``, ``choose``): each consumer (rank, DataLoader worker) takes its
span of the epoch's positions, cut into shuffle windows that read a run of each stream's shard
order and yield its rows in the window's stratified order, so every stretch of the stream holds
each stream in its proportion. Inside a batch the rows are grouped by stream (stream 0's first,
each read shard-contiguously), with ``"source"`` (each row's stream, an index into
:attr:`~featstore.FeatureDataset.versions`); ``"index"`` is the row's sample in its version.

The streams must read the same arrays (names, codecs, dtypes, per-sample shapes and codec
parameters, the tokenizer among them), or ``fields=`` names arrays they share that agree.
Per-token arrays, versions with views and several teachers per stream mix like any other.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from featstore._keywords import own_keywords_of
from featstore.errors import InvalidInput
from featstore.read._options import ReadKeywords, read_call
from featstore.read._reader import FeatureDataset
from featstore.read._streams import Stream, Versionish


@own_keywords_of(ReadKeywords, first="streams: :class:`Stream`\\ s, or ``(version, proportion)`` pairs.")
def mix(streams: Sequence[Stream | tuple[Versionish, float]], **keywords: Any) -> FeatureDataset:
    """Several versions read as one weighted stream (a :class:`~featstore.FeatureDataset`).

    ``streams``: :class:`Stream`\\ s, or ``(version, proportion)`` pairs; ``epoch_size``: samples
    per epoch with proportions (None: the versions' sizes summed); ``fields``: the arrays to read
    (None: all, which must agree across the versions); every other keyword as for any reader
    (:class:`~featstore.ReaderOptions`' fields: ``batch_size``, ``shuffle``, ``seed``, ...).

    >>> ds = featstore.mix([(web, 0.7), (code, 0.3)], epoch_size=50_000, batch_size=256, seed=0)
    """
    if "arrays" in keywords:
        warnings.warn("mix(arrays=...) is now fields=... (the keyword every reader takes).", DeprecationWarning,
                      stacklevel=2)
        keywords["fields"] = keywords.pop("arrays")
    given = [s if isinstance(s, Stream) else _pair(s) for s in streams]
    return FeatureDataset.of(given, read_call(keywords), mixture=True)


def _pair(s: object) -> Stream:
    if isinstance(s, tuple) and len(s) == 2:
        return Stream(s[0], proportion=s[1])
    raise InvalidInput(f"a mixture's streams are featstore.Stream(version, ...) or (version, proportion) pairs, "
                       f"got {s!r:.80}.")
