"""Which tokenizer a per-token output speaks: :class:`Vocabulary`, pure.

Per-token soft labels are class ids of a tokenizer's vocabulary: read with another tokenizer (or
another version of the same one), id 1,234 is another token and every stored distribution
silently means something else. A version computed with ``Tokens(..., vocabulary=...)`` records
its tokenizer's identity in its fingerprint and manifest (``fingerprint_parts["tokens"]
["vocabulary"]``), and a reader that is told the student's tokenizer refuses a version whose
vocabulary differs, naming what differs (:meth:`Vocabulary.differences`).
:func:`featstore.hf.vocabulary` builds one from a Hugging Face tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from featstore.errors import IncompatibleFormat, InvalidInput


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer's identity: what decides which token an id means.

    Attributes:
        name: the tokenizer's name (informational: the same vocabulary under another name is
            the same tokenizer).
        size: the number of ids (every token, added ones included).
        digest: sha256 of the vocabulary, every ``(token, id)`` pair (:func:`vocabulary_digest`).
        special: the special tokens that can appear in a sequence, by role (``bos_token``,
            ``eos_token``, ``unk_token``, ...), as their text.

    >>> v = Vocabulary("toy", 3, vocabulary_digest({"a": 0, "b": 1, "</s>": 2}), {"eos_token": "</s>"})
    >>> v.differences(Vocabulary("toy", 3, v.digest, {"eos_token": "<eos>"}))
    ["special tokens (eos_token '</s>' vs '<eos>')"]
    """

    name: str
    size: int
    digest: str
    special: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not isinstance(self.digest, str) or not self.digest:
            raise InvalidInput("Vocabulary needs a name and a digest (str); build one with "
                               "featstore.hf.vocabulary(tokenizer).")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise InvalidInput(f"Vocabulary.size must be a positive int, got {self.size!r}.")
        object.__setattr__(self, "special", {str(k): str(v) for k, v in sorted(dict(self.special).items())})

    def __hash__(self) -> int:  # ``special`` is a dict: hash its items
        return hash((self.name, self.size, self.digest, tuple(self.special.items())))

    def to_json(self) -> dict[str, Any]:
        """As the fingerprint and the manifest record it."""
        return {"name": self.name, "size": self.size, "digest": self.digest, "special": dict(self.special)}

    @classmethod
    def from_json(cls, obj: Any, where: str = "manifest") -> "Vocabulary":
        """Read back what :meth:`to_json` wrote (a malformed one is :class:`IncompatibleFormat`)."""
        try:
            return cls(str(obj["name"]), int(obj["size"]), str(obj["digest"]), dict(obj.get("special", {})))
        except (KeyError, TypeError, ValueError, AttributeError, InvalidInput) as exc:
            raise IncompatibleFormat(f"{where}: the tokenizer's identity is malformed ({exc}); recompute the "
                                     "version.") from exc

    def differences(self, other: "Vocabulary") -> list[str]:
        """What differs between two tokenizers, in words (empty: ids mean the same tokens in
        both). The name alone never makes a difference."""
        out = []
        if (self.size, self.digest) != (other.size, other.digest):
            out.append(f"vocabulary ({self.size} tokens, digest {self.digest[:12]} vs {other.size} tokens, "
                       f"digest {other.digest[:12]})")
        roles = sorted(set(self.special) | set(other.special))
        changed = [f"{r} {self.special.get(r)!r} vs {other.special.get(r)!r}" for r in roles
                   if self.special.get(r) != other.special.get(r)]
        if changed:
            out.append(f"special tokens ({', '.join(changed)})")
        return out


def vocabulary_digest(vocab: Mapping[str, int]) -> str:
    """sha256 of a vocabulary: every ``(token, id)`` pair, sorted by id then token.

    >>> vocabulary_digest({"b": 1, "a": 0})[:12]
    'ed2ad7c772b1'
    """
    pairs = sorted(((int(i), str(t)) for t, i in vocab.items()))
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()
