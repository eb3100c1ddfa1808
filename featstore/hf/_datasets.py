"""Per-token soft labels of a featstore version, joined with the token ids they were computed
on, as the datasets Hugging Face trainers read: :class:`SoftLabels` (map-style, a torch
``Dataset``) and :meth:`SoftLabels.iterable` (a ``datasets.IterableDataset``).

Each sample is a :class:`Sample`: ``input_ids``, ``labels``, ``target_token_ids [T, K]``,
``target_logprobs [T, K]`` and ``index``, where row ``t`` of the targets is the teacher's
distribution of the token after position ``t`` (what the student's logit ``t`` predicts).

**Why a Sample is not a dict.** ``transformers.Trainer`` drops every key of a dict sample that
its model's ``forward`` does not name unless ``remove_unused_columns=False`` (DistillKit's PR #1
hit this); it leaves any other mapping alone, so the teacher's columns arrive at the collator
with the Trainer's defaults. The collator still refuses samples that lost them, naming the setting.

**Where the rows come from.** A dataset reads its teacher rows through one seam,
:class:`StoredRows` (``rows(indices) -> TokenRows``): a version's stored rows, checked against
the student's tokenizer and temperature first. A teacher run in the loop will read through the
same seam.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from featstore.codecs._parts import assemble
from featstore.codecs._ragged import TOKEN_LENGTH, TOKEN_START, gather_rows
from featstore.errors import InvalidInput, SourceMismatch
from featstore.hf._identity import SoftLabelSpec, check_soft_labels, vocabulary
from featstore.read._views import check_source
from featstore.versions import StoredVersion, stored
from featstore.versions._committed import HasStoredVersion
from featstore.versions import InputCheck


@dataclass(frozen=True)
class Sample(Mapping):
    """One sample as :class:`DistillCollator` reads it (a mapping, not a dict: see the module)."""

    input_ids: torch.Tensor  # [T] int64
    labels: torch.Tensor  # [T] int64, -100 where no loss is taken
    target_token_ids: torch.Tensor  # [T, K] int64
    target_logprobs: torch.Tensor  # [T, K] float32
    index: int

    def __getitem__(self, key: str) -> Any:
        if key not in _KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_KEYS)

    def __len__(self) -> int:
        return len(_KEYS)


_KEYS = tuple(f.name for f in fields(Sample))


@dataclass(frozen=True)
class TokenRows:
    """Teacher rows of some samples, sample after sample: ids and log-probs ``[T, K]``, and
    each sample's token count ``[B]``."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    lengths: np.ndarray


class StoredRows:
    """A version's per-token soft labels, read by sample index.

    Stored rows (ids and 8-bit levels: ~100 B a token at K=50) are read a whole Zarr chunk at a
    time (the unit zstd decodes anyway) and kept, in this process, up to ``cache_bytes`` (least
    recently used out): a map-style dataset's batches are random samples, and a batch that
    decoded a chunk for each sample and kept nothing would spend its time in zstd. The per-sample
    ``token_start``/``token_length`` are read once (12 B a sample). The version's tokenizer and
    temperature are checked against the student's first
    (:func:`~featstore.hf._identity.check_soft_labels`).
    """

    def __init__(self, version: StoredVersion | HasStoredVersion, output: str, tokenizer: Any, temperature: float,
                 cache_bytes: int = 2**30) -> None:
        self.version = version = stored(version)
        self.spec: SoftLabelSpec = check_soft_labels(version, output, vocabulary(tokenizer), temperature)
        arrays = version.manifest.arrays
        self.parts = tuple(n for n, a in arrays.items() if a.output == output)
        n = len(version)
        self.starts = version.read_rows(TOKEN_START, 0, n).astype(np.int64)
        self.lengths = version.read_rows(TOKEN_LENGTH, 0, n).astype(np.int64)
        self.per_shard, self.chunk = arrays[self.parts[0]].tokens  # token rows a shard owns, rows a chunk holds
        spp = version.manifest.layout.samples_per_shard
        self.written = np.bincount(np.arange(n) // spp, weights=self.lengths).astype(np.int64)  # rows per shard
        self.cache_bytes = cache_bytes
        self._chunks: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()
        self._held = 0

    def __len__(self) -> int:
        return len(self.version)

    def __getstate__(self) -> dict[str, Any]:  # a DataLoader worker starts with an empty cache
        return {**self.__dict__, "_chunks": OrderedDict(), "_held": 0}

    def _read_chunk(self, c: int) -> dict[str, np.ndarray]:
        """Every stored part of token chunk ``c`` (read once, then from the cache)."""
        if c in self._chunks:
            self._chunks.move_to_end(c)
            return self._chunks[c]
        lo = c * self.chunk
        shard = lo // self.per_shard
        hi = min(lo + self.chunk, shard * self.per_shard + int(self.written[shard]))
        got = {p: self.version.token_rows(p, shard, lo, hi) for p in self.parts}
        self._chunks[c] = got
        self._held += sum(a.nbytes for a in got.values())
        while len(self._chunks) > 1 and self._held > self.cache_bytes:
            self._held -= sum(a.nbytes for a in self._chunks.popitem(last=False)[1].values())
        return got

    def rows(self, indices: np.ndarray) -> TokenRows:
        """The rows of samples ``indices`` (in that order), ids int64 and float32 log-probs."""
        idx = np.asarray(indices, dtype=np.int64)
        lengths = self.lengths[idx]
        rows = gather_rows(self.starts[idx], lengths)
        chunk = rows // self.chunk
        specs = self.version.manifest.arrays
        stored = {p: np.empty((len(rows), *specs[p].shape), dtype=specs[p].dtype) for p in self.parts}
        for c in np.unique(chunk):
            at = np.flatnonzero(chunk == c)
            for p, a in self._read_chunk(int(c)).items():
                stored[p][at] = a[rows[at] - c * self.chunk]
        batch = assemble(specs, {p: self.version.decode(p, a) for p, a in stored.items()})
        name = self.spec.output
        return TokenRows(batch[f"{name}.ids"], batch[f"{name}.values"].float(), lengths)


class SoftLabels(torch.utils.data.Dataset):
    """A version's per-token soft labels joined with the token ids they were computed on: a
    map-style dataset for ``transformers.Trainer`` (its sampler shards the indices over DDP
    ranks, so each rank reads only its own samples, and a checkpoint resumes mid-epoch exactly).

    Args:
        version: the committed version (``store.open(ref)``) holding per-token soft labels.
        dataset: the dataset it was computed on (:class:`TokenizedTexts` or any map-style
            dataset whose items hold ``input_key``); checked against the version's length and
            sampled content digest at once, and every item as it is read against the input
            digest stored for its row (:class:`~featstore.SourceMismatch` naming the item).
        tokenizer: the student's tokenizer; the version must have been computed with the same
            vocabulary and special tokens, else :class:`~featstore.SourceMismatch` names what differs.
        temperature: the temperature the student distils at; must be the stored one.
        output: the soft-label output's name.
        input_key: the item's token ids; ``labels_key``: the item's labels (None: the token ids,
            every position trained).
        cache_bytes: the stored rows (about 100 B a token at K=50) kept in each process, whole
            chunks at a time, least recently used out (:class:`StoredRows`).

    >>> train = SoftLabels(store.open("smollm2/docs"), data, tokenizer=tok, temperature=1.0)
    >>> train[0]["target_logprobs"].shape      # [tokens, K]
    """

    def __init__(self, version: StoredVersion | HasStoredVersion, dataset: Any, *, tokenizer: Any,
                 temperature: float, output: str = "logits", input_key: str = "input_ids",
                 labels_key: str | None = None, cache_bytes: int = 2**30) -> None:
        self.teacher = StoredRows(version, output, tokenizer, temperature, cache_bytes)
        check_source(self.teacher.version, dataset, what="the dataset")
        self.dataset = dataset
        self.inputs = InputCheck.of(self.teacher.version)  # each item read is checked against its row
        self.input_key, self.labels_key = input_key, labels_key

    def __len__(self) -> int:
        return len(self.teacher)

    def __getitem__(self, index: int) -> Sample:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Sample]:
        """A batch's samples in one read of the store (``DataLoader`` calls this with a batch's
        indices), in the order asked."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"indices out of range for {len(self)} samples")
        items = [self.dataset[int(i)] for i in idx]
        if self.inputs is not None:
            self.inputs.check(idx, items, "the dataset")
        order = np.argsort(idx, kind="stable")  # reading in store order touches each chunk once
        rows = self.teacher.rows(idx[order])
        starts = np.concatenate([[0], np.cumsum(rows.lengths)])
        out: list[Sample | None] = [None] * len(idx)
        for pos, i in enumerate(idx[order]):
            a, b = int(starts[pos]), int(starts[pos + 1])
            out[order[pos]] = self._sample(int(i), items[order[pos]], rows.ids[a:b], rows.logprobs[a:b])
        return out  # type: ignore[return-value]

    def _sample(self, index: int, item: Any, ids: torch.Tensor, logprobs: torch.Tensor) -> Sample:
        input_ids = torch.as_tensor(item[self.input_key], dtype=torch.long).reshape(-1)
        if len(input_ids) != len(ids):
            raise SourceMismatch(f"sample {index} has {len(input_ids)} token ids in the dataset but {len(ids)} "
                                 f"rows of soft labels in {self.teacher.version.ref}: they do not align. Read the "
                                 "version with the dataset (and tokenization) it was computed on.")
        labels = input_ids if self.labels_key is None else torch.as_tensor(item[self.labels_key], dtype=torch.long)
        return Sample(input_ids, labels, ids, logprobs, index)

    @property
    def spec(self) -> SoftLabelSpec:
        """The soft-label output read: K, classes, temperature, codec."""
        return self.teacher.spec

    def iterable(self, *, shuffle: bool = True, seed: int = 0, buffer_size: int = 1024,
                 samples_per_group: int = 64) -> Any:
        """The same samples as a ``datasets.IterableDataset`` (what TRL's ``SFTTrainer`` takes):
        groups of ``samples_per_group`` consecutive samples are its shards (each read in one
        store read), shuffled per epoch with ``buffer_size`` samples in flight when ``shuffle``.
        Under ``accelerate`` with ``dispatch_batches=False`` each rank reads only its own groups
        (``datasets`` shards by group); with ``dispatch_batches=True`` rank 0 reads every group
        and sends each rank its batch. Either way every sample is read once per epoch."""
        import datasets

        if samples_per_group < 1:
            raise InvalidInput(f"samples_per_group must be a positive int, got {samples_per_group!r}.")
        n = len(self)
        groups = [(a, min(a + samples_per_group, n)) for a in range(0, n, samples_per_group)]
        it = datasets.IterableDataset.from_generator(_read_groups, gen_kwargs={"groups": groups, "source": self})
        return it.shuffle(seed=seed, buffer_size=buffer_size) if shuffle else it


def _read_groups(groups: list[tuple[int, int]], source: SoftLabels) -> Iterator[Sample]:
    """The samples of ``groups`` (ranges of indices), one store read per group."""
    for a, b in groups:
        yield from source.__getitems__(range(a, b))
