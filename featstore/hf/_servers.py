"""A pool of OpenAI-compatible servers as featstore's Model A: :class:`VLLMServers`.

Each batch's texts go to the servers as token ids (``POST /v1/completions`` with ``"prompt": [[ids,
...], ...]``, ``"prompt_logprobs": k``, ``"logprobs": k``, ``"max_tokens": 1``), a few texts a
request, the requests spread over the servers that answer (the least busy first, from another
server in each process, so Dask workers spread too). A request that fails (no connection, a
timeout, a 5xx, a torn answer) marks its server down for a while and is sent to another one: a
server that dies mid-compute costs only its requests in flight, computed again elsewhere, and a
shard is written only once all its rows are in, so nothing torn is committed. After ``retries``
rounds without an answer the task fails (:class:`~featstore.ComputeFailed`, naming each server's
error); rerunning compute keeps the finished shards.

**The served model.** Before its first request to a server, a process checks that the server
serves ``model`` (``GET /v1/models``); another model is :class:`~featstore.SourceMismatch` naming
both. A server cannot prove which weights it loaded (``/v1/models`` names a model by its name or
path), so the weights the version records are the digest its user declares: for servers that load
a local folder, :func:`~featstore.hf.model_files_digest` of that folder, which
:class:`~featstore.hf.VLLMTeacher` records for the same folder.

**Temperature.** A server returns the raw distribution (T = 1: vLLM's prompt log-probabilities
skip every sampling processor), so the pool stores ``@1`` only; compute another temperature with
:class:`~featstore.hf.VLLMTeacher` in the workers.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from featstore._json import JSONObject
from featstore._user_types import EngineIdentity
from featstore.errors import ComputeFailed, InvalidInput, SourceMismatch
from featstore.hf._engines import PromptTopK, TopKTeacher


class ServerDown(Exception):
    """A request a server did not answer (sent again to another server)."""


@dataclass
class _Server:
    """One server as this process sees it."""

    url: str
    down_until: float = 0.0
    busy: int = 0
    checked: bool = False  # its /v1/models named the teacher's model (again after it was down)
    error: str = ""


@dataclass
class _Pool:
    """This process's view of a pool: each server's state, under one lock."""

    servers: list[_Server]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def pick(self, tried: set[str]) -> _Server | None:
        """The least busy server that is up and not yet tried for this request (else the
        least recently failed one not tried: a server may be back), marked busy."""
        now = time.monotonic()
        with self.lock:
            free = [s for s in self.servers if s.url not in tried]
            if not free:
                return None
            up = [s for s in free if s.down_until <= now]
            server = min(up, key=lambda s: s.busy) if up else min(free, key=lambda s: s.down_until)
            server.busy += 1
            return server

    def done(self, server: _Server, error: str = "", cooldown: float = 0.0) -> None:
        with self.lock:
            server.busy -= 1
            if error:
                server.error, server.checked = error, False
                server.down_until = time.monotonic() + cooldown


_POOLS: dict[tuple[str, ...], _Pool] = {}
_POOLS_LOCK = threading.Lock()


def _pool(urls: tuple[str, ...]) -> _Pool:
    with _POOLS_LOCK:
        if urls not in _POOLS:
            servers = [_Server(u) for u in urls]
            random.Random(os.getpid()).shuffle(servers)  # each process starts on another server
            _POOLS[urls] = _Pool(servers)
        return _POOLS[urls]


class VLLMServers(TopKTeacher):
    """A pool of OpenAI-compatible servers (``vllm serve`` or ``python -m
    vllm.entrypoints.openai.api_server``; any server answering vLLM's ``prompt_logprobs`` extension of
    ``/v1/completions`` for token-id prompts; tested with vLLM) as Model A: each text's
    per-token top-``k`` log-probabilities, stored like :class:`~featstore.hf.VLLMTeacher`'s.

    ``urls``: the servers' base URLs (``http://host:port``); ``model``: the model they serve, as
    ``/v1/models`` names it (``--served-model-name``, else the path they loaded); ``weights``:
    the digest of those weights, declared (:func:`~featstore.hf.model_files_digest` of the folder
    the servers load); ``vocab_size``: the model's class count (its config's ``vocab_size``).
    The servers must allow ``--max-logprobs`` >= ``k``. ``timeout``: seconds a request may take;
    ``retries``: rounds over the pool before a task fails; ``texts_per_request``: texts a request.

    >>> teacher = featstore.hf.VLLMServers(["http://gpu1:8000", "http://gpu2:8000"], model="smollm2",
    ...                                    weights=featstore.hf.model_files_digest("/models/smollm2"),
    ...                                    vocab_size=49152, k=50)
    """

    def __init__(self, urls: Sequence[str], model: str, weights: str, vocab_size: int, k: int = 50,
                 timeout: float = 300.0, retries: int = 3, texts_per_request: int = 8,
                 cooldown: float = 30.0) -> None:
        if isinstance(urls, str) or not urls:
            raise InvalidInput("VLLMServers takes a non-empty list of base URLs (['http://host:8000', ...]).")
        if not (isinstance(weights, str) and weights):
            raise InvalidInput("VLLMServers needs weights=: the digest of the weights the servers load, declared "
                               "(featstore.hf.model_files_digest(folder)): a server cannot prove its weights.")
        super().__init__(k, 1.0, vocab_size)
        self.model = str(model)
        self.weights = weights
        # How to reach the servers, not what they compute: left out of the fingerprint (``_``).
        self._urls = tuple(u.rstrip("/") for u in urls)
        self._timeout, self._retries, self._per_request = float(timeout), int(retries), int(texts_per_request)
        self._cooldown = float(cooldown)

    def featstore_identity(self) -> EngineIdentity:
        """The declared weights and the served model, once the servers that answer serve it
        (:class:`~featstore.SourceMismatch` otherwise; :class:`~featstore.ComputeFailed` when
        none answers)."""
        pool = _pool(self._urls)
        errors = {}
        for server in pool.servers:
            try:
                self._check(server)
            except ServerDown as exc:
                errors[server.url] = str(exc)
        if len(errors) == len(pool.servers):
            raise ComputeFailed(f"no server of the pool answers: {errors}; start them, or check the URLs.")
        engine: JSONObject = {"name": "openai-compatible", "model": self.model, "route": "prompt_logprobs"}
        return EngineIdentity(self.weights, engine)

    def top_logprobs(self, prompts: list[list[int]]) -> list[PromptTopK]:
        chunks = [prompts[i:i + self._per_request] for i in range(0, len(prompts), self._per_request)]
        pool = _pool(self._urls)
        with ThreadPoolExecutor(min(len(chunks), 2 * len(pool.servers)), thread_name_prefix="featstore-serve") as ex:
            return [rows for got in ex.map(lambda c: self._request(pool, c), chunks) for rows in got]

    def _request(self, pool: _Pool, prompts: list[list[int]]) -> list[PromptTopK]:
        """One request, sent to server after server until one answers (``retries`` rounds)."""
        body = json.dumps({"model": self.model, "prompt": prompts, "max_tokens": 1, "temperature": 0.0,
                           "prompt_logprobs": self.k, "logprobs": self.k,
                           "return_tokens_as_token_ids": True}).encode()
        errors: dict[str, str] = {}
        for round_ in range(self._retries + 1):
            tried: set[str] = set()
            while (server := pool.pick(tried)) is not None:
                tried.add(server.url)
                try:
                    self._check(server)
                    answer = _post(server.url + "/v1/completions", body, self._timeout)
                    rows = _choices(answer, prompts, self.k, server.url)
                except ServerDown as exc:
                    errors[server.url] = str(exc)
                    pool.done(server, str(exc), self._cooldown)
                    continue
                except BaseException:
                    pool.done(server)
                    raise
                pool.done(server)
                return rows
            time.sleep(min(2.0 ** round_, 10.0))  # every server failed this round: give them a moment
        raise ComputeFailed(f"no server of the pool answered a request of {len(prompts)} texts in {self._retries + 1} "
                            f"rounds: {errors}; finished shards are kept, rerun compute once servers are up.")

    def _check(self, server: _Server) -> None:
        """That ``server`` serves this teacher's model (once, and again after it was down)."""
        if server.checked:
            return
        served = [str(m.get("id")) for m in _get(server.url + "/v1/models", min(self._timeout, 30.0)).get("data", [])]
        if self.model not in served:
            raise SourceMismatch(f"server {server.url} serves {served}, but this teacher claims model {self.model!r} "
                                 f"(weights {self.weights[:23]}...): its soft labels would be another model's under "
                                 f"this one's identity. Point the pool at servers of {self.model!r}, or name the "
                                 "model they serve (and declare its weights).")
        server.checked = True


def _get(url: str, timeout: float) -> Any:
    return _call(urllib.request.Request(url), timeout)


def _post(url: str, body: bytes, timeout: float) -> Any:
    return _call(urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}), timeout)


def _call(request: urllib.request.Request, timeout: float) -> Any:
    """One HTTP call's JSON answer; :class:`ServerDown` for what another server may answer
    (no connection, a timeout, a 5xx, a torn body), :class:`InvalidInput` for a refusal (4xx)."""
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:  # noqa: S310 - the user's own servers
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")[:500]
        if exc.code >= 500:
            raise ServerDown(f"HTTP {exc.code}: {text}") from None
        raise InvalidInput(f"{request.full_url} refused the request (HTTP {exc.code}): {text}; a server must allow "
                           "--max-logprobs >= k and --max-model-len > the longest text.") from None
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:  # refused, reset, timed out, torn
        raise ServerDown(f"{type(exc).__name__}: {exc}") from None


def _choices(answer: Any, prompts: list[list[int]], k: int, url: str) -> list[PromptTopK]:
    """Each prompt's rows from a completions answer (choices by index): the prompt's
    positions ``1 ..`` (``prompt_logprobs``: id -> {logprob, rank}) and the generated token's
    ``top_logprobs`` (``"token_id:ID"`` -> logprob) give rows ``0 ..``."""
    try:
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise ServerDown(f"{url} answered {len(choices)} choices for {len(prompts)} texts")
        out = []
        for prompt, c in zip(prompts, choices, strict=True):
            positions = c["prompt_logprobs"][1:]
            if len(positions) != len(prompt) - 1:
                raise ServerDown(f"{url} answered {len(positions)} prompt positions for a text of {len(prompt)} tokens")
            ids = np.empty((len(prompt), k), dtype=np.int64)
            lps = np.empty((len(prompt), k), dtype=np.float32)
            for t, pos in enumerate(positions):
                best = sorted(pos.items(), key=lambda kv: (kv[1]["rank"], -kv[1]["logprob"]))[:k]
                ids[t] = [int(i) for i, _ in best]
                lps[t] = [v["logprob"] for _, v in best]
            last = sorted(c["logprobs"]["top_logprobs"][0].items(), key=lambda kv: -kv[1])[:k]
            ids[-1] = [int(i.rsplit(":", 1)[-1]) for i, _ in last]
            lps[-1] = [v for _, v in last]
            out.append(PromptTopK(ids, lps))
        return out
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ServerDown(f"{url} answered without the prompt's log-probabilities ({type(exc).__name__}: {exc}); is "
                         "it a vLLM server (prompt_logprobs with token-id prompts)?") from None
