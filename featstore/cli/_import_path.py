"""Objects named by import path (``pkg.module:factory``), for the command line.

Like ``uvicorn app.main:app``: the path, not the object, travels to the Dask workers, and each
worker imports and calls it there, so Model A and the dataset are built where they run and
never pickled. Pure: nothing here knows about Dask or the store.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from featstore.errors import InvalidInput
from featstore._user_code import call_factory, check_zero_arguments


def resolve(path: str) -> Any:
    """The object at ``path`` (``"pkg.module:name"``, the name may be dotted).

    >>> resolve("featstore.demo:ModelA").__name__
    'ModelA'
    """
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise InvalidInput(f"{path!r} is not an import path; write it as pkg.module:factory.")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        raise InvalidInput(f"cannot import {module!r} (from {path!r}): {exc}; is it installed, or "
                           "on PYTHONPATH, on this machine and on every Dask worker?") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise InvalidInput(f"module {module!r} has no {attr!r} (from {path!r}).") from None
    return obj


class Factory:
    """A zero-argument callable named by import path; pickles as the path alone.

    >>> make_model = Factory("featstore.demo:ModelA")   # called on each worker
    """

    def __init__(self, path: str) -> None:
        self.path = path
        target = resolve(path)
        if not callable(target):
            raise InvalidInput(f"{path!r} is not callable; name a class or a function that "
                               "takes no arguments.")
        check_zero_arguments(target, f"{path!r} names", "name a function without arguments that builds it "
                             "(def teacher(): return Model(...))")

    def __call__(self) -> Any:
        return resolve(self.path)()

    def __reduce__(self) -> tuple[Callable[[str], object], tuple[str]]:
        return (Factory, (self.path,))

    def __repr__(self) -> str:
        return f"Factory({self.path!r})"


class FactoryDataset:
    """A map-style dataset built by a factory on first use, in each process that uses it.

    Pickles as its import path, so the Dask workers build their own copy instead of receiving
    the caller's. Length and items are the built dataset's.
    """

    def __init__(self, path: str) -> None:
        self.factory = Factory(path)
        self._dataset: Any = None

    @property
    def dataset(self) -> Any:
        if self._dataset is None:
            self._dataset = call_factory(self.factory, "the dataset factory")
        return self._dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[i]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        getitems = getattr(self.dataset, "__getitems__", None)
        return list(getitems(indices)) if getitems else [self.dataset[i] for i in indices]

    def __reduce__(self) -> tuple[Callable[[str], object], tuple[str]]:
        return (FactoryDataset, (self.factory.path,))

    def __repr__(self) -> str:
        return f"FactoryDataset({self.factory.path!r})"
