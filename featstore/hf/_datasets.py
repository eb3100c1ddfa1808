"""Per-token soft labels of a featstore version, joined with the token ids they were computed
on, as the datasets Hugging Face trainers read: :class:`SoftLabels` (map-style, a torch
``Dataset``) and :meth:`SoftLabels.iterable` (a ``datasets.IterableDataset``).

Each sample is a :class:`Sample`: ``input_ids``, ``labels``, ``target_token_ids [T, K]``,
``target_logprobs [T, K]``, ``index`` and ``temperature`` (the one the soft labels were stored
at, which the collator carries into the batch for the loss), where row ``t`` of the targets is
the teacher's distribution of the token after position ``t`` (what the student's logit ``t`` predicts).

**Why a Sample is not a dict.** ``transformers.Trainer`` drops every key of a dict sample that
its model's ``forward`` does not name unless ``remove_unused_columns=False`` (DistillKit's PR #1
hit this); it leaves any other mapping alone, so the teacher's columns arrive at the collator
with the Trainer's defaults. The collator still refuses samples that lost them, naming the setting.

**Where the rows come from.** A dataset reads its teacher rows through one seam,
:class:`StoredRows` (``rows(indices) -> TokenRows``): a version's stored rows, checked against
the student's tokenizer and temperature first, read by featstore's one row path
(:func:`featstore.read.rows_of`: the process's sources of the version, decoded chunks kept).

**Mixtures.** ``SoftLabels(featstore.mix([(code, 0.7), (prose, 0.3)], epoch_size=N), [code_texts,
prose_texts], ...)`` is a map-style dataset over the mixture's epoch: its ``N`` samples are the
ones the mixture's plan draws of each version (:meth:`featstore.FeatureDataset.samples`), each
joined with its own version's texts, every version checked against the student's tokenizer and
temperature. The Trainer's sampler shuffles them and shards them over ranks, as for one version.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from featstore.codecs import RaggedRows, assemble
from featstore.errors import InvalidInput, SourceMismatch
from featstore.hf._identity import SoftLabelSpec, check_soft_labels, vocabulary
from featstore.read import FeatureDataset, ProcessReads, check_source, rows_of
from featstore.versions import HasStoredVersion, InputCheck, StoredVersion, stored


@dataclass(frozen=True)
class Sample(Mapping[str, Any]):
    """One sample as :class:`DistillCollator` reads it (a mapping, not a dict: see the module)."""

    input_ids: torch.Tensor  # [T] int64
    labels: torch.Tensor  # [T] int64, -100 where no loss is taken
    target_token_ids: torch.Tensor  # [T, K] int64
    target_logprobs: torch.Tensor  # [T, K] float32
    index: int
    temperature: float = 1.0  # the stored soft labels' (their codec's ``@T``)

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
    """A version's per-token soft labels, read by sample index through featstore's one row path
    (:func:`featstore.read.rows_of`).

    Stored rows (ids and 8-bit levels: ~100 B a token at K=50) are decoded a whole inner chunk
    at a time (the unit zstd decodes anyway) and kept, in this process, up to ``cache_bytes``
    (least recently used out): a map-style dataset's batches are random samples, and a batch
    that decoded a chunk for each sample and kept nothing would spend its time in zstd. The
    version's tokenizer and temperature are checked against the student's first
    (:func:`~featstore.hf._identity.check_soft_labels`).
    """

    def __init__(self, version: StoredVersion | HasStoredVersion, output: str, tokenizer: Any, temperature: float,
                 cache_bytes: int = 2**30) -> None:
        self.version = version = stored(version)
        self.spec: SoftLabelSpec = check_soft_labels(version, output, vocabulary(tokenizer), temperature)
        self.parts = tuple(n for n, a in version.manifest.arrays.items() if a.output == output)
        self.cache_bytes = cache_bytes
        self._reads: ProcessReads | None = None

    def __len__(self) -> int:
        return len(self.version)

    def __getstate__(self) -> dict[str, Any]:  # a DataLoader worker opens its own reads, its cache empty
        return {**self.__dict__, "_reads": None}

    @property
    def reads(self) -> ProcessReads:
        """This process's reads of the version (its own after a fork)."""
        if self._reads is None or self._reads.pid != os.getpid():
            self._reads = ProcessReads(self.version, self.parts, chunk_bytes=max(1, self.cache_bytes))
        return self._reads

    def rows(self, indices: np.ndarray) -> TokenRows:
        """The rows of samples ``indices`` (in that order), ids int64 and float32 log-probs."""
        got = rows_of(self.reads, np.asarray(indices, dtype=np.int64))
        specs = self.version.manifest.arrays
        parts = {p: got[p] for p in self.parts}
        lengths = next(iter(parts.values()))
        assert isinstance(lengths, RaggedRows)  # per-token parts
        batch = assemble(specs, {p: self.version.decode(p, r.flat) for p, r in parts.items()
                                 if isinstance(r, RaggedRows)})
        name = self.spec.output
        return TokenRows(batch[f"{name}.ids"], batch[f"{name}.values"].float(), lengths.lengths.astype(np.int64))


class SoftLabels(torch.utils.data.Dataset[Sample]):
    """A version's per-token soft labels joined with the token ids they were computed on: a
    map-style dataset for ``transformers.Trainer`` (its sampler shards the indices over DDP
    ranks, so each rank reads only its own samples, and a checkpoint resumes mid-epoch exactly).

    Args:
        source: the committed version (``store.open(ref)``) holding per-token soft labels; or a
            reader over several such versions (``featstore.mix([(a, 0.7), (b, 0.3)],
            epoch_size=N, seed=0)``): then the dataset's samples are the mixture's epoch (see
            the module docstring).
        dataset: the dataset the version was computed on (:class:`TokenizedTexts` or any
            map-style dataset whose items hold ``input_key``), checked against the version's
            length and sampled content digest at once, and every item as it is read against the
            input digest stored for its row (:class:`~featstore.SourceMismatch` naming the item);
            a mixture: one per stream, in order.
        tokenizer: the student's tokenizer; every version must have been computed with the same
            vocabulary and special tokens, else :class:`~featstore.SourceMismatch` names what differs.
        temperature: the temperature the student distils at; must be every version's stored one.
        output: the soft-label output's name.
        input_key: the item's token ids; ``labels_key``: the item's labels (None: the token ids,
            every position trained).
        cache_bytes: the decoded rows (about 100 B a token at K=50) kept in each process per
            version, whole chunks at a time, least recently used out (:class:`StoredRows`).
        epoch: a mixture's epoch whose samples the dataset holds.

    >>> train = SoftLabels(store.open("smollm2/docs"), data, tokenizer=tok, temperature=1.0)
    >>> train[0]["target_logprobs"].shape      # [tokens, K]
    """

    def __init__(self, source: StoredVersion | HasStoredVersion | FeatureDataset, dataset: Any, *, tokenizer: Any,
                 temperature: float, output: str = "logits", input_key: str = "input_ids",
                 labels_key: str | None = None, cache_bytes: int = 2**30, epoch: int = 0) -> None:
        if isinstance(source, FeatureDataset):
            versions = [s.members[0].version for s in source.streams]
            if any(len(s.members) > 1 for s in source.streams):
                raise InvalidInput("SoftLabels reads one teacher's soft labels per stream; give a mixture of versions, "
                                   "not several teachers on the same rows.")
            datasets = list(dataset) if isinstance(dataset, (list, tuple)) else [dataset]
            samples = source.samples(epoch)
        else:
            versions, datasets = [stored(source)], [dataset]
            samples = [np.arange(len(versions[0]), dtype=np.int64)]
        if len(datasets) != len(versions):
            raise InvalidInput(f"give one dataset per stream: {len(versions)} versions, {len(datasets)} datasets.")
        self.teachers = [StoredRows(v, output, tokenizer, temperature, cache_bytes) for v in versions]
        for t, d in zip(self.teachers, datasets, strict=True):
            check_source(t.version, d, what="the dataset")
        self.datasets = datasets
        self.inputs = [InputCheck.of(t.version) for t in self.teachers]  # each item read is checked against its row
        # sample i of the dataset: stream stream[i], that stream's sample index[i]
        self.stream = np.concatenate([np.full(len(x), k, dtype=np.int64) for k, x in enumerate(samples)])
        self.index = np.concatenate(samples).astype(np.int64)
        self.input_key, self.labels_key = input_key, labels_key

    @property
    def teacher(self) -> StoredRows:
        """The first (or only) version's rows."""
        return self.teachers[0]

    @property
    def dataset(self) -> Any:
        """The first (or only) version's dataset."""
        return self.datasets[0]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, index: int) -> Sample:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Sample]:
        """A batch's samples in one read of the store per version (``DataLoader`` calls this with
        a batch's indices), in the order asked."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"indices out of range for {len(self)} samples")
        out: list[Sample | None] = [None] * len(idx)
        streams = self.stream[idx]
        for k in np.unique(streams).tolist():
            at = np.flatnonzero(streams == k)
            samples = self.index[idx[at]]
            order = np.argsort(samples, kind="stable")  # in store order: each chunk read once
            at, samples = at[order], samples[order]
            items = [self.datasets[k][s] for s in samples.tolist()]
            check = self.inputs[k]
            if check is not None:
                check.check(samples, items, "the dataset")
            rows = self.teachers[k].rows(samples)
            starts = np.concatenate([[0], np.cumsum(rows.lengths)])
            for pos, (i, sample) in enumerate(zip(at.tolist(), samples.tolist(), strict=True)):
                a, b = int(starts[pos]), int(starts[pos + 1])
                out[i] = self._sample(k, int(idx[i]), sample, items[pos], rows.ids[a:b], rows.logprobs[a:b])
        return out  # type: ignore[return-value]  # every position was filled above

    def _sample(self, k: int, index: int, sample: int, item: Any, ids: torch.Tensor, logprobs: torch.Tensor
                ) -> Sample:
        input_ids = torch.as_tensor(item[self.input_key], dtype=torch.long).reshape(-1)
        if len(input_ids) != len(ids):
            raise SourceMismatch(f"sample {sample} has {len(input_ids)} token ids in the dataset but {len(ids)} "
                                 f"rows of soft labels in {self.teachers[k].version.ref}: they do not align. Read "
                                 "the version with the dataset (and tokenization) it was computed on.")
        labels = input_ids if self.labels_key is None else torch.as_tensor(item[self.labels_key], dtype=torch.long)
        return Sample(input_ids, labels, ids, logprobs, index, self.teachers[k].spec.temperature)

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
