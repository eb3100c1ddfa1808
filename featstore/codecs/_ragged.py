"""Per-token (ragged) outputs: only each sample's real tokens are stored, as flat token rows.

A language model as Model A returns per-token outputs ``[B, L, ...]`` padded to the batch's
longest sequence. With ``compute(..., tokens=Tokens(mask=..., max_tokens=...))`` featstore keeps
only the positions the mask marks (the user's attention mask), in order, and stores them as
plain Zarr arrays (pure functions here; the writer and reader call them):

- **token arrays**: one per ragged output (or per part of one, for ``topk:K`` and friends),
  axis 0 = token rows. Shard ``s`` of the version owns token rows ``[s * P, (s + 1) * P)``
  with ``P`` at least ``samples_per_shard * max_tokens`` (:func:`token_layout`; the manifest
  records it per array, as ``tokens``); its samples' tokens are packed from the start of that
  range and only they are stored (the rest of the range is never written, so it costs
  nothing: a Zarr shard stores only the chunks written to it).
- **per-sample arrays** ``token_start`` (int64: the sample's first row in the token arrays)
  and ``token_length`` (int32: its real tokens), like any other per-sample field. With plain
  Zarr, sample ``i``'s tokens are ``logits[token_start[i]:token_start[i] + token_length[i]]``.

Batches carry a ragged output as flat rows ``[T, ...]`` (the batch's samples' tokens, sample
after sample) and ``"<name>.offsets"`` (int64 ``[B + 1]``: sample ``b`` is rows
``offsets[b]:offsets[b + 1]``), or, with the reader's ``ragged="padded"``, as ``[B, L, ...]``
padded rows plus ``"<name>.lengths"``. Sharding, shuffling, resume and views work on samples.

>>> import torch
>>> flat, lengths = pack(torch.arange(6).reshape(2, 3), torch.tensor([[1, 1, 0], [1, 0, 0]]))
>>> flat.tolist(), lengths.tolist()
([0, 1, 3], [2, 1])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


from featstore.codecs._vocabulary import Vocabulary
from featstore.codecs._topk import TopK
from featstore.errors import InvalidInput, OutputMismatch
from featstore._lazy import np, torch  # imported on first use: the quick commands never need them


#: The per-sample arrays of a version with per-token outputs (reserved field names).
TOKEN_START = "token_start"
TOKEN_LENGTH = "token_length"
TOKEN_FIELDS = (TOKEN_START, TOKEN_LENGTH)
#: Token rows per chunk of a per-token array: at most (2**14, ~1 MiB at 64 B a row) and at least
#: (rows of a MiB or more each) this many (:func:`token_layout`).
MAX_TOKEN_CHUNK = 2**14
MIN_TOKEN_CHUNK = 16
#: The fewest real tokens a shard holds where compute chooses the shard size (a small version
#: is then spread over fewer than ``MIN_SHARDS`` shards): a shard's chunks are what zstd
#: compresses, and SmolLM2's top-50 stored in frames of ~170 tokens took 101 B a token, in one
#: of 1,000 tokens 94, in frames of 2,048 or more 81-82 (issue 42).
MIN_SHARD_TOKENS = 4096
#: How the reader returns a ragged output.
RAGGED_FORMS = ("flat", "padded")
OFFSETS = "offsets"
LENGTHS = "lengths"


@dataclass(frozen=True)
class Tokens:
    """Which outputs are per token, and which positions of them are real tokens.

    Attributes:
        mask: ``mask(x) -> [B, L]`` bool/int tensor on Model A's input batch ``x`` (what the
            ``collate`` of :class:`~featstore.compute.ComputeOptions` built): nonzero marks a
            real token (an attention mask). Part of the fingerprint (by source).
        max_tokens: the most real tokens a sample may have (a longer one is refused at compute
            time); sizes each shard's token range, so set it to the model's context length.
        outputs: the per-token outputs (``[B, L, ...]``, with ``L`` the mask's length); None:
            every output.
        vocabulary: the tokenizer whose ids the outputs are over
            (:class:`~featstore.codecs.Vocabulary`, e.g. ``featstore.hf.vocabulary(tok)``):
            recorded in the fingerprint and the manifest, so a reader told the student's
            tokenizer refuses logits of another one. None: not recorded (as before it existed).

    >>> Tokens(mask=lambda x: x["attention_mask"], max_tokens=512)  # doctest: +ELLIPSIS
    Tokens(mask=<function <lambda> at ...>, max_tokens=512, outputs=None, vocabulary=None)
    """

    mask: Callable[[Any], Any]
    max_tokens: int
    outputs: tuple[str, ...] | None = None
    vocabulary: Vocabulary | None = None

    def __post_init__(self) -> None:
        if not callable(self.mask):
            raise InvalidInput("Tokens.mask must be a function of A's input batch returning a [B, L] mask, "
                               "e.g. lambda x: x['attention_mask'].")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidInput("Tokens.max_tokens must be a positive int (the longest sample), "
                               f"got {self.max_tokens!r}.")
        if self.outputs is not None:
            if isinstance(self.outputs, str) or not isinstance(self.outputs, Sequence) or not self.outputs:
                raise InvalidInput("Tokens.outputs must be a non-empty list of output names, "
                                   "or None for every output.")
            object.__setattr__(self, "outputs", tuple(self.outputs))
        if self.vocabulary is not None and not isinstance(self.vocabulary, Vocabulary):
            raise InvalidInput("Tokens.vocabulary takes a featstore.codecs.Vocabulary, e.g. "
                               "featstore.hf.vocabulary(tokenizer).")

    def identity(self) -> dict[str, Any]:
        """What the fingerprint's ``tokens`` part records besides the mask and ``max_tokens``:
        the tokenizer's identity, only where one was given (so every earlier id stays)."""
        return {} if self.vocabulary is None else {"vocabulary": self.vocabulary.to_json()}

    def ragged_outputs(self, outputs: Sequence[str]) -> tuple[str, ...]:
        """The per-token outputs among ``outputs`` (checked: each must be one of them)."""
        if self.outputs is None:
            return tuple(outputs)
        unknown = sorted(set(self.outputs) - set(outputs))
        if unknown:
            raise InvalidInput(f"Tokens.outputs names {unknown}, which are not outputs {sorted(outputs)}.")
        return tuple(o for o in outputs if o in self.outputs)


def pad_sequences(seqs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A collate for token sequences of different lengths: ``{"ids": [B, L] right-padded with 0,
    "attention_mask": [B, L] bool}``, L the longest. Pair it with :func:`attention_mask`:
    ``ComputeOptions(collate=pad_sequences)``, ``Tokens(mask=attention_mask, max_tokens=...)``.

    >>> pad_sequences([torch.tensor([5, 6]), torch.tensor([7])])["attention_mask"].tolist()
    [[True, True], [True, False]]
    """
    width = max((len(s) for s in seqs), default=0)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.as_tensor(s), True
    return {"ids": ids, "attention_mask": mask}


def attention_mask(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """The real-token mask of a batch collated by :func:`pad_sequences` (a ``Tokens.mask``)."""
    return x["attention_mask"]


def batch_mask(tokens: Tokens, x: Any, rows: int, start: int) -> torch.Tensor:
    """The real-token mask of one input batch as bool ``[rows, L]``, checked."""
    try:
        mask = torch.as_tensor(tokens.mask(x))
    except Exception as exc:  # noqa: BLE001 - a user function
        raise InvalidInput(f"Tokens.mask raised {type(exc).__name__}: {exc} on samples [{start}, {start + rows}); "
                           "it gets A's input batch (after collate) and returns a [B, L] mask.") from exc
    if mask.dim() != 2 or mask.shape[0] != rows:
        raise InvalidInput(f"Tokens.mask returned shape {tuple(mask.shape)} on samples [{start}, {start + rows}); "
                           f"it must be [{rows}, L] (one row per sample, one column per position).")
    mask = mask.cpu().bool()
    longest = int(mask.sum(1).max()) if rows else 0
    if longest > tokens.max_tokens:
        worst = start + int(mask.sum(1).argmax())
        raise InvalidInput(f"sample {worst} has {longest} tokens, more than Tokens.max_tokens={tokens.max_tokens}; "
                           "raise max_tokens to the longest sequence (or truncate in collate).")
    return mask


def pack(values: torch.Tensor, mask: torch.Tensor, name: str = "output") -> tuple[torch.Tensor, torch.Tensor]:
    """A padded per-token output ``[B, L, ...]`` -> its real tokens ``[T, ...]`` (sample after
    sample, in position order) and each sample's token count ``[B]`` (int32)."""
    mask = _token_mask(tuple(values.shape), mask, name)
    return values[mask.to(values.device)], mask.sum(1).to(torch.int32)


def pack_topk(values: TopK, mask: torch.Tensor, name: str = "output") -> TopK:
    """:func:`pack` for an engine's top-k rows ``[B, L, k]``: the real tokens' rows ``[T, k]``."""
    return values.select(_token_mask(values.shape, mask, name))


def _token_mask(shape: tuple[int, ...], mask: torch.Tensor, name: str) -> torch.Tensor:
    mask = torch.as_tensor(mask).bool()
    if len(shape) < 2 or tuple(shape[:2]) != tuple(mask.shape):
        raise OutputMismatch(f"per-token output {name!r} has shape {shape}, but the token mask is "
                             f"{tuple(mask.shape)}: a per-token output must be [B, L, ...] with the mask's B and L.")
    return mask


def token_layout(samples_per_shard: int, max_tokens: int, row_bytes: int) -> tuple[int, int]:
    """(token rows per shard, token rows per chunk) of a per-token array whose rows are
    ``row_bytes`` each.

    A chunk is the unit zstd compresses, so it is sized by bytes: about 1 MiB of rows (a power
    of two, :data:`MIN_TOKEN_CHUNK` to :data:`MAX_TOKEN_CHUNK` rows), or the shard's whole
    token range where that is smaller; never cut down to whatever divides
    ``samples_per_shard * max_tokens`` (small chunks compress worse). The shard's range (every
    sample may reach ``max_tokens``) is rounded up to whole blocks of ``min(MAX_TOKEN_CHUNK,
    next power of two)`` rows, which every array's chunk divides, so all per-token arrays of a
    version share it whatever their row size. Rows past a shard's real tokens are never
    written, so the rounding stores nothing.

    >>> token_layout(100, 512, 256), token_layout(500, 77, 1), token_layout(3, 64, 100)
    ((65536, 4096), (49152, 16384), (256, 256))
    """
    need = samples_per_shard * max_tokens
    block = min(MAX_TOKEN_CHUNK, 1 << max(need - 1, 0).bit_length())
    mib_rows = 2**20 // max(row_bytes, 1)
    by_bytes = min(MAX_TOKEN_CHUNK, max(MIN_TOKEN_CHUNK, 1 << max(mib_rows.bit_length() - 1, 0)))
    return -(-need // block) * block, min(by_bytes, block)


def offsets(lengths: np.ndarray) -> np.ndarray:
    """Per-sample token counts -> offsets ``[B + 1]`` (int64) into the flat rows.

    >>> offsets(np.array([2, 0, 3])).tolist()
    [0, 2, 2, 5]
    """
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def gather_rows(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The flat row positions of samples given by (first row, count), sample after sample.

    >>> gather_rows(np.array([10, 3]), np.array([2, 3])).tolist()
    [10, 11, 3, 4, 5]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    shift = np.repeat(np.asarray(starts, dtype=np.int64) - (ends - lengths), lengths)
    rows: np.ndarray = np.arange(total, dtype=np.int64) + shift
    return rows


def padded(flat: torch.Tensor, lengths: torch.Tensor, pad: float | int = 0) -> torch.Tensor:
    """Flat token rows ``[T, ...]`` -> ``[B, max(lengths), ...]`` padded with ``pad``.

    >>> padded(torch.tensor([1, 2, 3]), torch.tensor([2, 1])).tolist()
    [[1, 2], [3, 0]]
    """
    lengths = lengths.long()
    width = int(lengths.max()) if len(lengths) else 0
    out = torch.full((len(lengths), width, *flat.shape[1:]), pad, dtype=flat.dtype)
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    out[mask] = flat
    return out


def pad_value(name: str, dtype: torch.dtype) -> float | int:
    """What fills the unused positions of a padded ragged field: the sparse parts' own sentinel
    (id -1, log-prob -inf, count 0), else 0."""
    if name.endswith(".ids"):
        return -1
    if name.endswith(".values"):
        return float("-inf")
    return 0 if not dtype.is_floating_point else 0.0


# -- the reader's side: a window's tokens, and a batch's ---------------------------------------
@dataclass(frozen=True)
class RaggedRows:
    """Token rows of some samples, sample after sample: ``flat[T, ...]`` and ``lengths[B]``."""

    flat: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)

    @staticmethod
    def concat(parts: Sequence["RaggedRows"]) -> "RaggedRows":
        """Several samples' rows after one another (a batch cut across two windows)."""
        return RaggedRows(np.concatenate([p.flat for p in parts]), np.concatenate([p.lengths for p in parts]))


class RaggedWindow:
    """One per-token array over a shuffle window: each piece's token rows (read per piece, in
    sample order), gathered per batch by window position like the per-sample arrays.

    >>> w = RaggedWindow([RaggedRows(np.arange(5), np.array([2, 3]))])
    >>> w.take(np.array([1, 0])).flat.tolist()
    [2, 3, 4, 0, 1]
    """

    def __init__(self, pieces: Sequence[RaggedRows]) -> None:
        joined = RaggedRows.concat(pieces)
        self.flat, self.lengths = joined.flat, joined.lengths
        self.starts = offsets(self.lengths)[:-1]

    def take(self, pos: np.ndarray) -> RaggedRows:
        """The rows of window positions ``pos``, in that order."""
        return RaggedRows(self.flat[gather_rows(self.starts[pos], self.lengths[pos])], self.lengths[pos])


def concat_rows(parts: Sequence[Any]) -> Any:
    """Batch rows cut from two windows, joined: numpy arrays or :class:`RaggedRows`."""
    if isinstance(parts[0], RaggedRows):
        return RaggedRows.concat(parts)
    return np.concatenate(parts)
