"""Validation of user-given names; nothing outside the store root may ever be addressed.

Names are checked by an allow-list, never by stripping bad parts: a segment starts with an ASCII
letter or digit, continues with letters, digits, ``.``, ``_`` or ``-`` and does not end in ``.``. So ``..``, absolute
paths, backslashes, ``%2e``, NUL and unicode look-alikes are all refused, and a segment can never
collide with featstore's own ``_versions``/``_tags`` folders (they start with ``_``).
"""

from __future__ import annotations

import re

from featstore.errors import InvalidName

# No trailing dot: Windows and some object-store tools strip it, so "a." would alias "a".
_SEGMENT = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62}[A-Za-z0-9_-])?"
_NAME_RE = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT}){{0,7}}")
_TAG_RE = re.compile(_SEGMENT)
_VERSION_RE = re.compile(r"[0-9a-f]{16}")
_FIELD_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
MAX_NAME = 255


def _check(kind: str, value: object, pattern: re.Pattern[str], rule: str) -> str:
    if not isinstance(value, str):
        raise InvalidName(f"{kind} must be a str, got {type(value).__name__}.")
    if len(value) > MAX_NAME or not pattern.fullmatch(value) or ".." in value:
        shown = value if len(value) <= 80 else value[:77] + "..."
        raise InvalidName(f"invalid {kind} {shown!r}: {rule}")
    return value


def check_name(name: object) -> str:
    """Return ``name`` if it is a valid feature-set name, else raise :class:`InvalidName`.

    >>> check_name("resnet50/imagenet-train")
    'resnet50/imagenet-train'
    """
    return _check(
        "feature-set name", name, _NAME_RE,
        "use 1-8 '/'-separated segments of ASCII letters, digits, '.', '_' or '-', each starting "
        "with a letter or digit, not ending with '.', at most 64 characters "
        "(e.g. 'resnet50/imagenet-train').",
    )


def check_tag(tag: object) -> str:
    """Return ``tag`` if it is a valid tag name (one segment, like ``best`` or ``v1.2``)."""
    return _check(
        "tag", tag, _TAG_RE,
        "use ASCII letters, digits, '.', '_' or '-', starting with a letter or digit, not ending "
        "with '.', at most 64 characters.",
    )


def is_version_id(value: str) -> bool:
    """Whether ``value`` has the shape of a version id (16 lowercase hex digits)."""
    return bool(_VERSION_RE.fullmatch(value))


def check_version_id(value: object) -> str:
    """Return ``value`` if it is a well-formed version id, else raise :class:`InvalidName`."""
    return _check("version id", value, _VERSION_RE, "a version id is 16 lowercase hex digits.")


def check_field(field: object) -> str:
    """Return ``field`` if it can name a stored array (``features``, ``logits``, ``target``)."""
    return _check(
        "array name", field, _FIELD_RE,
        "use a Python-identifier-like name: an ASCII letter, then letters, digits or '_'.",
    )
