"""Keywords declared once, in a frozen dataclass, and taken by the functions that accept them.

A function ``fn(first, name, **keywords)`` decorated with :func:`keywords_of` (or
``fn(first, **keywords)`` with :func:`own_keywords_of`) takes the keywords of ``cls``'s
constructor: type checkers see them through a ``ParamSpec``, ``help()``, ``inspect.signature`` and
the API pages through ``__signature__`` and an ``Args:`` section made from ``cls``'s
``Attributes:``. ``store.compute`` takes :class:`~featstore.compute.ComputeCall`'s this way, and
the readers (``store.dataset``, ``featstore.mix``, ``FeatureDataset``) take
:class:`~featstore.read.ReadKeywords`'. Imports nothing of featstore's but the floor.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")
T = TypeVar("T")


def split_attributes(doc: str) -> tuple[str, list[str], str]:
    """A docstring cut around its ``Attributes:`` section: the text before, the section's lines
    (dedented), the text after."""
    lines = inspect.cleandoc(doc).splitlines()
    if "Attributes:" not in lines:
        return "\n".join(lines), [], ""
    i = j = lines.index("Attributes:")
    while j + 1 < len(lines) and (lines[j + 1].startswith(" ") or (
            not lines[j + 1] and j + 2 < len(lines) and lines[j + 2].startswith(" "))):
        j += 1
    return "\n".join(lines[:i]).rstrip(), textwrap.dedent("\n".join(lines[i + 1:j + 1])).splitlines(), \
        "\n".join(lines[j + 1:]).strip()


def inherit_attributes(cls: type) -> None:
    """Document every attribute a dataclass of keywords takes: its base's ``Attributes:`` first,
    then its own (one declaration, one text); called from ``__init_subclass__``."""
    before, own, after = split_attributes(cls.__dict__.get("__doc__") or "")
    inherited = split_attributes(cls.__mro__[1].__doc__ or "")[1]
    cls.__doc__ = (before + "\n\nAttributes:\n" + textwrap.indent("\n".join(inherited + own), "    ")
                   + (f"\n\n{after}" if after else ""))


def _declare(fn: Callable[..., object], cls: Callable[..., object], first: str | None) -> None:
    """Set ``fn``'s signature to its own parameters before ``*args``/``**keywords``, then
    ``cls``'s (keyword-only unless ``fn`` takes ``*args``), and its docstring's ``Args:`` to
    ``first`` (the description of its last own parameter) and ``cls``'s ``Attributes:``."""
    own = inspect.signature(fn)
    kept_params = []
    for p in own.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            break
        kept_params.append(p)
    # fn(first, name, *args, **keywords) passes its positionals on to cls: they stay positional
    # where cls takes them so (compute's model and dataset); without *args, keywords only
    positional = any(p.kind is p.VAR_POSITIONAL for p in own.parameters.values())
    keywords = [p if positional else p.replace(kind=p.KEYWORD_ONLY)
                for p in inspect.signature(cls).parameters.values()]
    # inspect.signature reads __signature__; typeshed declares no such attribute on a callable
    fn.__signature__ = own.replace(parameters=kept_params + keywords)  # type: ignore[attr-defined]
    if isinstance(cls, type):
        entries = ([first] if first else []) + split_attributes(cls.__doc__ or "")[1]
        args = textwrap.indent("\n".join(entries), "    ")
        fn.__doc__ = f"{inspect.cleandoc(fn.__doc__ or '')}\n\nArgs:\n{args}"


def keywords_of(cls: Callable[P, Any], first: str = "name: the feature set (``\"resnet50/imagenet-train\"``)."
                ) -> Callable[[Callable[Concatenate[S, T, ...], R]], Callable[Concatenate[S, T, P], R]]:
    """Declare ``fn(self, arg, **keywords)`` as taking ``cls``'s keywords after ``arg`` (``first``:
    how its ``Args:`` describe ``arg``). ``fn`` builds ``cls(**keywords)`` (or reads them)."""
    def declare(fn: Callable[Concatenate[S, T, ...], R]) -> Callable[Concatenate[S, T, P], R]:
        _declare(fn, cls, first)
        return cast("Callable[Concatenate[S, T, P], R]", fn)  # the signature is cls's, as set above
    return declare


def own_keywords_of(cls: Callable[P, Any], first: str | None = None) -> Callable[
        [Callable[Concatenate[S, ...], R]], Callable[Concatenate[S, P], R]]:
    """Declare ``fn(arg, **keywords)`` (a method's ``arg`` is ``self``) as taking ``cls``'s
    keywords (``first``: how its ``Args:`` describe ``arg``; None: not at all)."""
    def declare(fn: Callable[Concatenate[S, ...], R]) -> Callable[Concatenate[S, P], R]:
        _declare(fn, cls, first)
        return cast("Callable[Concatenate[S, P], R]", fn)  # the signature is cls's, as set above
    return declare


def given(cls: Callable[..., T], keywords: dict[str, Any]) -> T:
    """``cls(**keywords)``: the keywords a decorated function received, checked by ``cls``'s
    constructor (the one place their types meet the declaration)."""
    return cls(**keywords)
