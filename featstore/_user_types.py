"""The types of what users hand featstore: a map-style dataset and its items, Model A, the
selectors of an item's fields. Types only (torch is imported for the type checker alone), so
every layer's signatures can name them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

from featstore._json import JSONObject

if TYPE_CHECKING:
    from torch.nn import Module

#: One item of a user's dataset: a tensor, an array, a number, a string, or a tuple, list or
#: dict of them. ``Any``, not ``object``: featstore reads its fields by the user's own key,
#: index or callable, and the user's callables (``augment``, ``input_key``) type items their way.
Item: TypeAlias = Any


class MapDataset(Protocol):
    """A map-style dataset: ``len(ds)`` items, ``ds[i]`` an :data:`Item`."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Item: ...


#: Model A as given: an ``nn.Module``, or a zero-argument factory that builds it (on each worker).
ModelSpec: TypeAlias = "Module | Callable[[], Module]"

#: Which field of an item Model A takes or a stored array keeps: a key, an index, a callable on
#: the item, or None (the item itself).
FieldKey: TypeAlias = str | int | Callable[[Item], Item] | None

#: A user's collate (``ComputeOptions.collate``): items -> Model A's input batch.
Collate: TypeAlias = Callable[[list[Item]], object]


@dataclass(frozen=True)
class EngineIdentity:
    """What identifies a Model A whose weights are not in its ``state_dict`` (an inference engine
    in the worker, a pool of servers): ``weights``, a digest of the model's weight files (or the
    one its user declares for servers that cannot prove theirs), recorded as the version's
    ``fingerprint_parts["model"]``; ``engine``, what computes with them (name, version, dtype,
    ...), recorded as ``fingerprint_parts["engine"]``. Both are part of the fingerprint."""

    weights: str
    engine: JSONObject


@runtime_checkable
class DeclaresIdentity(Protocol):
    """Model A that names its own weights and engine (:class:`EngineIdentity`), read by the
    fingerprint instead of digesting its (empty) ``state_dict``."""

    def featstore_identity(self) -> EngineIdentity: ...
