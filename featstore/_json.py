"""Canonical JSON and the one JSON loader: the floor that storage and the stored schemas both use.

Every object featstore stores besides array data is JSON written by :func:`canonical_json`
(sorted keys, no NaN: the same bytes for the same object, which fingerprints rely on) and read
by :func:`load_json` (never a pickle; anything but a JSON object is :class:`IncompatibleFormat`).
"""

from __future__ import annotations

import json
from typing import TypeAlias

from featstore.errors import IncompatibleFormat

#: A JSON value: what :func:`load_json` reads and :func:`canonical_json` writes.
JSON: TypeAlias = "None | bool | int | float | str | list[JSON] | dict[str, JSON]"
#: A JSON object: every object featstore stores beside array data is one.
JSONObject: TypeAlias = "dict[str, JSON]"


def canonical_json(obj: object) -> bytes:
    """Deterministic JSON bytes (sorted keys, no NaN): what fingerprints and stored objects use."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def load_json(data: bytes | str, where: str) -> JSONObject:
    """Parse one stored JSON object (never a pickle); anything else is :class:`IncompatibleFormat`.

    >>> load_json(b'{"a": 1}', "x.json")
    {'a': 1}
    """
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:  # bad UTF-8/JSON, huge ints, deep nesting
        raise IncompatibleFormat(f"{where} is not valid JSON ({exc}); the object is damaged. "
                                 "Delete the version and recompute it.") from exc
    if not isinstance(obj, dict):
        raise IncompatibleFormat(f"{where} does not hold a JSON object; the object is damaged or not "
                                 "featstore's. Delete it (or its version) and recompute.")
    return obj


def json_object(value: JSON, what: str) -> JSONObject:
    """``value``, which a stored object holds as ``what``, if it is a JSON object; else a
    ``TypeError`` (which the stored schemas' parsers report as a malformed object)."""
    if not isinstance(value, dict):
        raise TypeError(f"{what} is not a JSON object ({type(value).__name__})")
    return value


def json_list(value: JSON, what: str) -> list[JSON]:
    """``value`` (``what`` in a stored object) if it is a JSON array; else a ``TypeError``."""
    if not isinstance(value, list):
        raise TypeError(f"{what} is not a JSON array ({type(value).__name__})")
    return value

