"""A Hugging Face tokenizer's identity, and the check that a version's soft labels speak it.

A student must never read per-token soft labels computed with another tokenizer (an id is
another token) or at another temperature (another distribution) without an error naming what
differs: :func:`check_soft_labels` compares what the version's manifest recorded at compute
time (``fingerprint_parts["tokens"]["vocabulary"]`` and the codec's temperature) with what the
student reads them with.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from featstore.codecs import is_parts_codec, parts_codec
from featstore.codecs import Vocabulary, vocabulary_digest
from featstore.errors import InvalidInput, SourceMismatch

#: The special tokens that can stand in a stored sequence. The pad token is left out: padding is
#: never stored (only real tokens are), and students often set their own (``pad = eos``).
SPECIAL_ROLES = ("bos_token", "eos_token", "unk_token", "sep_token", "cls_token", "mask_token")


def vocabulary(tokenizer: Any, name: str | None = None) -> Vocabulary:
    """The identity of a Hugging Face tokenizer: its name (``name``, else the last part of
    ``name_or_path``), size, a digest of every ``(token, id)`` pair and its special tokens.

    >>> featstore.hf.vocabulary(AutoTokenizer.from_pretrained(d, gguf_file=f)).size
    49152
    """
    try:
        vocab = tokenizer.get_vocab()
    except AttributeError:
        raise InvalidInput(f"vocabulary() takes a Hugging Face tokenizer (with get_vocab()), got "
                           f"{type(tokenizer).__name__}.") from None
    special = {r: str(getattr(tokenizer, r)) for r in SPECIAL_ROLES if getattr(tokenizer, r, None) is not None}
    if name is None:
        name = os.path.basename(str(getattr(tokenizer, "name_or_path", "") or "").rstrip("/\\"))
    return Vocabulary(name or type(tokenizer).__name__, max(len(vocab), len(tokenizer)), vocabulary_digest(vocab),
                      special)


@dataclass(frozen=True)
class SoftLabelSpec:
    """What a version stores for one per-token soft-label output: its name, K, the number of
    classes, the temperature and the codec."""

    output: str
    k: int
    classes: int
    temperature: float
    codec: str


def soft_label_spec(version: Any, output: str) -> SoftLabelSpec:
    """The soft-label output ``output`` of ``version``, or :class:`InvalidInput` saying what the
    version holds instead (no such output, a dense one, one not stored per token)."""
    arrays = version.manifest.arrays
    spec = arrays.get(f"{output}.ids")
    if spec is None or not is_parts_codec(spec.codec) or not spec.ragged:
        held = sorted({a.output or n for n, a in arrays.items() if a.ragged})
        raise InvalidInput(f"{version.ref} has no per-token soft labels named {output!r} (its per-token outputs: "
                           f"{held}); compute them with outputs={{'{output}': 'topkq:50'}} and tokens=, or pass "
                           "output= naming one.")
    codec = parts_codec(spec.codec)
    return SoftLabelSpec(output, spec.shape[-1], int(spec.params["num_classes"]), codec.temperature, codec.name)


def check_soft_labels(version: Any, output: str, student: Vocabulary, temperature: float) -> SoftLabelSpec:
    """The output's :class:`SoftLabelSpec`, once the student's tokenizer and temperature are the
    teacher's; otherwise :class:`~featstore.SourceMismatch` naming every difference."""
    spec = soft_label_spec(version, output)
    recorded = version.manifest.fingerprint_parts.get("tokens", {}).get("vocabulary")
    if recorded is None:
        raise SourceMismatch(f"{version.ref} was computed without the tokenizer's identity, so nothing proves its "
                             "ids are the student's tokens; recompute it with tokens=featstore.hf.teacher_tokens"
                             "(tokenizer, max_tokens=...).")
    teacher = Vocabulary.from_json(recorded, f"{version.ref}'s manifest")
    differs = teacher.differences(student)
    if not math.isclose(float(temperature), spec.temperature, rel_tol=1e-9):
        differs.append(f"temperature ({spec.temperature:g} vs {float(temperature):g})")
    if student.size < spec.classes:
        differs.append(f"vocabulary size ({spec.classes} classes stored, the student's tokenizer has {student.size})")
    if differs:
        raise SourceMismatch(
            f"{version.ref}'s soft labels {output!r} were computed with tokenizer {teacher.name!r} at temperature "
            f"{spec.temperature:g}; the student reads them with tokenizer {student.name!r} at temperature "
            f"{float(temperature):g}, and these differ: {'; '.join(differs)}. Read them with the teacher's tokenizer "
            "and temperature, or recompute the soft labels with the student's.")
    return spec
