"""A language model computed by an inference engine as featstore's Model A: the teacher's per-token
top-k comes back from the engine (vLLM in the worker, or a pool of OpenAI-compatible servers)
already ranked, as :class:`~featstore.codecs.TopK`, and is stored by ``topkq:K`` / ``topk:K`` in
the same arrays, with the same tokenizer identity and temperature, as the transformers forward's
(:class:`~featstore.hf.CausalLMLogits`): :class:`~featstore.hf.SoftLabels` reads either.

Row ``t`` of a text is the distribution of the token after position ``t`` (the transformers
convention, what a student's logit ``t`` learns). An engine's ``prompt_logprobs[p]`` is the
distribution of token ``p`` given the tokens before it (none at ``p = 0``), so row ``t`` is its
``p = t + 1``, and the last row (the token after the whole text) is the distribution of the one
token generated.
"""

from __future__ import annotations

import hashlib
import os
import threading
from abc import ABCMeta, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from featstore._user_types import EngineIdentity
from featstore.codecs import TopK
from featstore.errors import InvalidInput, OutputMismatch

#: The files of a model folder whose bytes are its weights and architecture (the tokenizer's
#: files are its own identity: :func:`featstore.hf.vocabulary`).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_FILES = ("config.json",)


@dataclass(frozen=True)
class PromptTopK:
    """One text's rows as an engine returns them: ``ids`` and ``logprobs`` ``[L, k]``, row ``t``
    the distribution of the token after position ``t``, most likely first."""

    ids: np.ndarray
    logprobs: np.ndarray


class TopKTeacher(torch.nn.Module, metaclass=ABCMeta):
    """Model A computed by an inference engine: ``forward`` takes the batch
    :func:`featstore.ragged.pad_sequences` builds (``ids``, ``attention_mask``) and returns a
    :class:`~featstore.codecs.TopK` ``[B, L, k]`` of each real token's next-token distribution
    at ``temperature`` over ``classes`` classes (padding rows are left out by ``Tokens``).
    Subclasses give :meth:`top_logprobs` (the engine) and :meth:`featstore_identity` (its weights
    and name, recorded in the version's fingerprint).

    Attributes whose names start with ``_`` (where the engine is, how to reach it) are left out
    of the fingerprint, as featstore's code digest leaves them out: moving the model's folder or
    the servers' ports does not make a new version; the weights digest says what they compute.
    """

    def __init__(self, k: int, temperature: float, classes: int) -> None:
        super().__init__()
        if not (isinstance(k, int) and k >= 1):
            raise InvalidInput(f"k must be a positive int (the top-k the engine returns), got {k!r}.")
        if not temperature > 0:
            raise InvalidInput(f"temperature must be > 0, got {temperature!r}.")
        self.k = k
        self.temperature = float(temperature)
        self.classes = int(classes)
        self._last: dict[tuple[int, ...], PromptTopK] = {}  # the rows of the last engine call, by text

    @abstractmethod
    def top_logprobs(self, prompts: list[list[int]]) -> list[PromptTopK]:
        """Each prompt's rows (:class:`PromptTopK`, ``len(prompt)`` rows of ``k``)."""

    @abstractmethod
    def featstore_identity(self) -> EngineIdentity:
        """The weights digest and the engine (see :class:`~featstore._user_types.EngineIdentity`)."""

    def forward(self, x: dict[str, torch.Tensor]) -> TopK:
        ids, mask = x["ids"], x["attention_mask"].bool()
        prompts = [row[m].tolist() for row, m in zip(ids.cpu(), mask.cpu(), strict=True)]
        keys = [tuple(p) for p in prompts]
        missing = [p for p, key in zip(prompts, keys, strict=True) if key not in self._last]
        if missing:
            # compute's probe runs A on up to 64 first samples, which the first task's batches
            # (of any size) then ask for again when they run in the same process: an engine's
            # answer is costly, so the last call's rows are kept (one call's, never more)
            fresh = dict(zip([tuple(p) for p in missing], self.top_logprobs(missing), strict=True))
            self._last = {**{k: self._last[k] for k in keys if k in self._last}, **fresh}
        got = [self._last[key] for key in keys]
        out_ids = np.zeros((*ids.shape, self.k), dtype=np.int64)
        out_lp = np.zeros((*ids.shape, self.k), dtype=np.float32)
        for b, (prompt, rows, m) in enumerate(zip(prompts, got, mask.cpu().numpy(), strict=True)):
            if rows.ids.shape != (len(prompt), self.k) or rows.logprobs.shape != rows.ids.shape:
                raise OutputMismatch(f"the engine returned {rows.ids.shape} top-k rows for a text of {len(prompt)} "
                                     f"tokens; {(len(prompt), self.k)} were expected.")
            out_ids[b, m] = rows.ids
            out_lp[b, m] = rows.logprobs
        return TopK(torch.from_numpy(out_ids), torch.from_numpy(out_lp), self.classes, self.temperature)


_DIGESTS: dict[tuple[str, int, int], str] = {}
_DIGESTS_LOCK = threading.Lock()


def model_files_digest(folder: str | os.PathLike[str]) -> str:
    """sha256 over a model folder's weight files (``*.safetensors``, ``*.bin``, ``*.pt``,
    ``*.pth``, ``*.gguf``, in every subfolder) and its ``config.json``: each file's path in the
    folder, size and bytes. What an engine teacher records as its weights (a version's
    ``fingerprint_parts["model"]``), and what a user declares for servers that load this folder
    (:class:`~featstore.hf.VLLMServers`). Kept per file (path, size, mtime) in this process.

    >>> featstore.hf.model_files_digest("/models/smollm2")                # doctest: +SKIP
    'sha256:4f0c...'
    """
    root = os.fspath(folder)
    if not os.path.isdir(root):
        raise InvalidInput(f"{root!r} is not a folder; a teacher engine's weights are identified by the files of a "
                           "local model folder (a hub name cannot be digested: download it to a folder first).")
    files = []
    for base, dirs, names in os.walk(root):
        dirs.sort()
        files += [os.path.join(base, n) for n in sorted(names) if n.endswith(WEIGHT_SUFFIXES) or n in CONFIG_FILES]
    if not any(f.endswith(WEIGHT_SUFFIXES) for f in files):
        raise InvalidInput(f"{root!r} holds no weight files ({', '.join(WEIGHT_SUFFIXES)}).")
    h = hashlib.sha256()
    for path in files:
        h.update(os.path.relpath(path, root).replace(os.sep, "/").encode() + b"\0")
        h.update(_file_digest(path).encode())
    return "sha256:" + h.hexdigest()


def _file_digest(path: str) -> str:
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    with _DIGESTS_LOCK:
        if key in _DIGESTS:
            return _DIGESTS[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = f"{st.st_size}:{h.hexdigest()}"
    with _DIGESTS_LOCK:
        _DIGESTS[key] = digest
    return digest


def check_prompts(prompts: Sequence[Sequence[int]], max_len: int, where: str) -> None:
    """Refuse a text the engine cannot score: empty, or longer than ``max_len`` tokens (the
    engine's context less the one token generated)."""
    long = [i for i, p in enumerate(prompts) if len(p) > max_len]
    if long or any(not p for p in prompts):
        raise InvalidInput(f"{where} scores texts of 1 to {max_len} tokens (its context length less the one token it "
                           f"generates); {len(long)} texts of this batch are longer: truncate them (TokenizedTexts's "
                           "max_tokens) or raise the engine's max_model_len.")
