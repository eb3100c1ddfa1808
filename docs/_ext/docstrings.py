"""A griffe extension for the API reference: featstore's docstrings, rendered as Markdown.

The docstrings are written for ``help()`` and the terminal: doctest examples (``>>>``) as plain
indented text, and Sphinx roles (:class:`~featstore.FeatureDataset`). Markdown would read a
doctest line as a block quote (and ``v[10:20]["features"]`` as a reference link) and show the
roles as they are typed. So, before mkdocstrings renders an object, each doctest block becomes a
fenced ``pycon`` block and each role the code span of its name. Nothing in ``featstore/`` changes.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

#: :class:`~featstore.FeatureDataset`, :func:`open_store`, :meth:`Version.dataset`, ...
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _role(m: re.Match[str]) -> str:
    target = m.group(2).strip()
    return f"`{target.rsplit('.', 1)[-1] if m.group(1) else target}`"


def _is_doctest(line: str) -> bool:
    return line.lstrip().startswith(">>>")


def fence_doctests(text: str) -> str:
    """Wrap each doctest block (a ``>>>`` line, its ``...`` continuations and its output, up to a
    blank line) in a fenced ``pycon`` block at the block's own indentation; leave fenced code,
    and everything else, as it is.

    >>> fence_doctests("Text.\\n\\n>>> 1 + 1\\n2")
    'Text.\\n\\n```pycon\\n>>> 1 + 1\\n2\\n```'
    """
    out: list[str] = []
    lines = text.split("\n")
    i, in_fence = 0, False
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        if in_fence or not _is_doctest(line):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        block = []
        while i < len(lines) and lines[i].strip():
            block.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        out += [f"{indent}```pycon", *(f"{indent}{b}" for b in block), f"{indent}```"]
    return "\n".join(out)


def markdown_docstring(text: str) -> str:
    """A docstring's text with doctests fenced and Sphinx roles as code spans, outside fences."""
    parts = re.split(r"(```.*?```)", fence_doctests(text), flags=re.S)
    return "".join(p if p.startswith("```") else ROLE.sub(_role, p) for p in parts)


class MarkdownDocstrings(griffe.Extension):
    """Rewrite every loaded object's docstring with :func:`markdown_docstring`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
