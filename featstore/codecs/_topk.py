"""A teacher's top-k computed where the full distribution lives (an inference engine, a server),
as Model A returns it instead of dense logits: :class:`TopK`.

A dense output ``[B, L, classes]`` is what the sparse codecs rank and keep K of; an engine such
as vLLM ranks on its side and hands back only its k most likely classes per row with their
normalised log-probabilities. Storing those through ``topk:K`` or ``topkq:K`` (K <= k) gives the
same arrays, manifest and identity as the dense path (:meth:`PartsCodec.encode_topk
<featstore.codecs.PartsCodec.encode_topk>`), without ever building ``classes`` floats a row.
"""

from __future__ import annotations

from dataclasses import dataclass

from featstore._lazy import torch  # imported on first use: the quick commands never need it
from featstore.errors import OutputMismatch


@dataclass(frozen=True)
class TopK:
    """Rows of a teacher's k most likely classes: ``ids [..., k]`` (int64, most likely first) and
    ``logprobs [..., k]`` (float32 log-probabilities of the teacher's full distribution over
    ``classes`` classes at ``temperature``, so ``exp`` sums to at most 1: the rest is the tail).

    Model A returns one (or a dict holding some) where it would return dense logits ``[...,
    classes]``; compute stores it with ``topk:K[@T]`` or ``topkq:K[:L][@T]``, K at most k and T
    the ``temperature`` the rows were computed at.

    >>> t = TopK(torch.tensor([[[3, 1]]]), torch.tensor([[[-0.1, -2.5]]]), classes=5)
    >>> t.shape, t.k
    ((1, 1, 5), 2)
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    classes: int
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if tuple(self.ids.shape) != tuple(self.logprobs.shape) or self.ids.dim() < 2:
            raise OutputMismatch(f"TopK's ids {tuple(self.ids.shape)} and logprobs {tuple(self.logprobs.shape)} "
                                 "must have one shape [..., k].")
        if self.k > self.classes:
            raise OutputMismatch(f"TopK holds {self.k} classes a row out of {self.classes}; k must be at most "
                                 "the class count.")

    @property
    def k(self) -> int:
        """Classes kept per row."""
        return int(self.ids.shape[-1])

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the dense output these rows stand for: ``(..., classes)``."""
        return (*tuple(self.ids.shape[:-1]), self.classes)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the dense output these rows stand for (log-probabilities: float32)."""
        return torch.float32

    def select(self, mask: torch.Tensor) -> TopK:
        """The rows where ``mask`` (the leading dimensions' shape) is true, as ``[rows, k]``."""
        m = mask.to(self.ids.device).bool()
        return TopK(self.ids[m], self.logprobs[m], self.classes, self.temperature)
