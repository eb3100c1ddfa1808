"""A module imported when first used: what keeps ``featstore --help``, ``list``, ``info``, ``verify``
and friends from importing torch (seconds) for commands that never touch a tensor.

>>> np = lazy_module("numpy")     # nothing imported yet
>>> np.zeros(2).tolist()          # imported here, once; the attribute is kept
[0.0, 0.0]

A module that uses numpy or torch only inside functions takes them from here
(``from featstore._lazy import np, torch``): a type checker sees the real modules, so
annotations such as ``np.ndarray`` and ``torch.Tensor`` are checked, while at runtime they are
the lazy stand-ins.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any


class LazyModule:
    """Stands for the module ``name``: the first attribute asked for imports it."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_lazy_name", name)

    def __getattr__(self, attr: str) -> Any:
        value = getattr(importlib.import_module(self._lazy_name), attr)
        object.__setattr__(self, attr, value)  # later uses skip this method
        return value

    def __repr__(self) -> str:
        return f"<lazy module {self._lazy_name!r}>"


def lazy_module(name: str) -> Any:
    """A stand-in for ``import name`` that imports it on first attribute use."""
    return LazyModule(name)


if TYPE_CHECKING:
    import numpy as np
    import torch
else:  # the quick commands never import them (tests/cli, benchmarks/cli_startup.py)
    np = lazy_module("numpy")
    torch = lazy_module("torch")


def lazy_exports(package: str, names: dict[str, str]) -> tuple[Any, Any]:
    """``__getattr__`` and ``__dir__`` for a package whose public names live in modules that
    import torch, Dask or zarr: each is imported when first asked for (PEP 562).

    >>> __getattr__, __dir__ = lazy_exports("featstore.read", {"FeatureDataset": "_dataset"})  # doctest: +SKIP
    """

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    def __dir__() -> list[str]:  # the package's own names too: some packages are only partly lazy
        return sorted(set(names) | set(vars(sys.modules[package])))

    return __getattr__, __dir__
