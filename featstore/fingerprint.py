"""Digests of Model A's weights, the dataset's identity and the compute config.

Same fingerprint => same stored outputs => nothing is recomputed. The weights digest reads the
``state_dict`` bytes (parameters and buffers), not the source code, so editing a comment does
not invalidate a version while changing one weight does.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .errors import InvalidInput
from .manifest import canonical_json

DATASET_SAMPLES = 16


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes()


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every state_dict entry's name, dtype, shape and bytes.

    >>> weights_digest(torch.nn.Linear(2, 2)) != weights_digest(torch.nn.Linear(2, 2))
    True
    """
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode() + b"\0")
        if isinstance(value, torch.Tensor):
            h.update(f"{value.dtype}{tuple(value.shape)}".encode())
            h.update(_tensor_bytes(value))
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def _update_item(h: "hashlib._Hash", item: Any) -> None:
    if isinstance(item, torch.Tensor):
        h.update(f"T{item.dtype}{tuple(item.shape)}".encode())
        h.update(_tensor_bytes(item))
    elif isinstance(item, np.ndarray):
        h.update(f"N{item.dtype}{item.shape}".encode())
        h.update(np.ascontiguousarray(item).tobytes())
    elif isinstance(item, Mapping):
        h.update(b"{")
        for k in sorted(item, key=str):
            h.update(repr(k).encode())
            _update_item(h, item[k])
        h.update(b"}")
    elif isinstance(item, (tuple, list)):
        h.update(b"[")
        for v in item:
            _update_item(h, v)
        h.update(b"]")
    elif item is None or isinstance(item, (bool, int, float, str, bytes)):
        h.update(repr(item).encode())
    else:
        raise InvalidInput(
            f"cannot fingerprint a dataset item of type {type(item).__name__}; pass "
            "ComputeOptions(dataset_id='...') naming the dataset's exact contents instead."
        )


def sample_positions(n: int, k: int = DATASET_SAMPLES) -> list[int]:
    """Evenly spaced indices (first and last included) used to digest a dataset's content."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def dataset_digest(dataset: Sequence[Any], dataset_id: str | None = None) -> dict[str, Any]:
    """The dataset's identity: its length plus a user id or a digest of sampled items."""
    n = len(dataset)
    if dataset_id is not None:
        return {"length": n, "id": str(dataset_id)}
    h = hashlib.sha256()
    for i in sample_positions(n):
        _update_item(h, dataset[i])
    return {"length": n, "sampled": DATASET_SAMPLES, "digest": h.hexdigest()}


def describe_key(key: Any) -> Any:
    """A JSON-able description of an ``input_key``/``keep`` selector (callables by source)."""
    if key is None or isinstance(key, (str, int)):
        return key
    if callable(key):
        try:
            src = inspect.getsource(key)
        except (OSError, TypeError):
            src = getattr(key, "__qualname__", repr(key))
        return {"callable": hashlib.sha256(src.encode()).hexdigest()}
    raise InvalidInput(f"input_key must be a str, an int, a callable or None, got {key!r}.")


def fingerprint(parts: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of every part."""
    return hashlib.sha256(canonical_json(dict(parts))).hexdigest()


def model_digest(model: torch.nn.Module | Callable[[], torch.nn.Module], model_id: str | None) -> str:
    """Digest for a module, or for a factory (built once here unless ``model_id`` is given)."""
    if model_id is not None:
        return "id:" + str(model_id)
    if isinstance(model, torch.nn.Module):
        return weights_digest(model)
    if callable(model):
        built = model()
        if not isinstance(built, torch.nn.Module):
            raise InvalidInput("the model factory must return a torch.nn.Module.")
        return weights_digest(built)
    raise InvalidInput(
        f"model must be a torch.nn.Module or a zero-argument factory, got {type(model).__name__}."
    )
