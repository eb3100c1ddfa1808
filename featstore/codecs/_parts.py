"""Codecs that store one output as several plain Zarr arrays ("parts"): sparse soft labels and
int8: pure encode/decode, no IO.

Chosen per output like the dense dtypes (``outputs={"logits": "topk:20"}``):

- ``topk:K[@T]``: the K largest classes of each row. Parts ``<name>.ids`` (unsigned ints wide
  enough for the class count: uint16 up to 65,535 classes, else uint32; never floats) and
  ``<name>.values`` (float16 log-probabilities at temperature T, default 1).
- ``topp:P:MIN_K[:CAP][@T]``: the smallest set of classes whose probability reaches P, at least
  MIN_K and at most CAP (default ``max(MIN_K, 100)``) per row; stored CAP wide, the unused
  slots padded (below) and zstd-compressed, so a row costs about what it keeps.
- ``sample:S[@T]``: S class ids drawn with replacement from the teacher's distribution at T,
  seeded by the sample index (reproducible), kept as unique ids with their ``<name>.counts``:
  ``counts / S`` is an unbiased estimate of the distribution (Sparse Logit Sampling,
  Anshumann et al., ACL 2025), unlike top-k, which drops the tail.
- ``topkq:K[:L][@T]``: the K largest classes of each row, compact (:mod:`featstore.codecs._quantised`):
  ``<name>.ids`` sorted ascending (uint16/uint32), ``<name>.values`` and ``<name>.tail``
  (the mass not kept) as uint8 square-root levels, L of them (default 128); about 92 B/token at
  K=50 on a 49,152-token vocabulary, against ~154 for ``topk:50``. Batches carry ids and
  normalised float32 log-probabilities, like ``topk``.
- ``int8``: per-row (per-sample) absmax quantisation of a dense output (embeddings): parts
  ``<name>`` (int8) and ``<name>.scale`` (float32, ``absmax / 127``); readers get
  ``int8 * scale`` back as float32.

**Padding sentinel.** On disk an unused slot holds id ``iinfo(ids dtype).max`` (so 65,535 is
never a class id with uint16), value ``-inf`` and count 0. In a batch, ids are int64 and an
unused slot holds id ``-1`` (:data:`PAD_ID`), value ``-inf`` (its probability ``exp(-inf)`` is
0) and count 0.

**Reconstruction rules** (what :mod:`featstore.kd` does with the parts, recorded in the
manifest): ``uniform_tail`` for top-k/top-p (the kept probabilities as stored, the missing mass
``1 - sum`` spread evenly over the other classes: "marginal smoothing"), ``counts`` for sample
(``counts / S`` on the drawn ids).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


from featstore.codecs._dense import OUTPUT_CODECS, finite_rows
from featstore.errors import IncompatibleFormat, InvalidInput
from featstore._allowed_names import check_field
from featstore._lazy import np, torch  # imported on first use: the quick commands never need them

import featstore.codecs._quantised as _quantised
from featstore.codecs._topk import TopK
from featstore.codecs._sparse import (PAD_ID, SAMPLE_SEED, check_finite, encode_int8, fp16_logp,
                                      sample_ids, sparse_diagnostics, sparse_error, store_ids, top_p, ids_dtype,
                                      check_given_rows)



@dataclass(frozen=True)
class PartSpec:
    """One stored part of an encoded output: its array-name suffix, numpy dtype and row shape."""

    part: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PartsCodec:
    """A codec that stores an output as several arrays.

    ``kind``: ``topk``, ``topp``, ``sample``, ``topkq`` or ``int8``; ``k``: K, S, or top-p's cap;
    ``min_k``/``p``: top-p's floor and mass; ``temperature``: of the stored distribution;
    ``levels``: ``topkq``'s square-root levels L.
    """

    kind: str
    k: int = 0
    p: float = 0.0
    min_k: int = 0
    temperature: float = 1.0
    levels: int = 0

    @property
    def name(self) -> str:
        """The canonical name (what the manifest and the fingerprint record)."""
        t = f"@{self.temperature:g}"
        if self.kind == "topk":
            return f"topk:{self.k}{t}"
        if self.kind == "topp":
            return f"topp:{self.p:g}:{self.min_k}:{self.k}{t}"
        if self.kind == "sample":
            return f"sample:{self.k}{t}"
        if self.kind == "topkq":
            return f"topkq:{self.k}:{self.levels}{t}"
        return "int8"

    @property
    def sparse(self) -> bool:
        return self.kind != "int8"

    @property
    def always_compressed(self) -> bool:
        """Whether ``compression="auto"`` stores every part with zstd, whatever the probe batch
        says: ``topkq``'s parts are made for it (sorted ids, small levels), and its one-byte
        ``tail``, which a probe batch of a few hundred bytes shows as incompressible, would,
        stored raw, cost the whole of each shard's last chunk, unwritten rows included (1.4 B a
        token of SmolLM2's top-50 where zstd stores 0.8-0.9)."""
        return self.kind == "topkq"

    @property
    def rule(self) -> str:
        return {"topk": "uniform_tail", "topp": "uniform_tail", "topkq": "uniform_tail",
                "sample": "counts"}.get(self.kind, "absmax")

    def part_dtypes(self) -> dict[str, tuple[str, ...]]:
        """The dtypes each stored part of this codec may have (what a manifest is checked against)."""
        if not self.sparse:
            return {"": ("int8",), "scale": ("float32",)}
        if self.kind == "topkq":
            return {"ids": ("uint16", "uint32"), "values": ("uint8",), "tail": ("uint8",)}
        return {"ids": ("uint16", "uint32"), "values": ("float16",), "counts": ("uint8", "uint16")}

    # -- layout ---------------------------------------------------------------------------
    def parts(self, row_shape: tuple[int, ...], output: str = "output") -> tuple[PartSpec, ...]:
        """The stored parts for an output of per-sample shape ``row_shape``; raises
        :class:`InvalidInput` where the codec cannot store it (K > classes, too many classes)."""
        if not self.sparse:
            return (PartSpec("", "int8", row_shape), PartSpec("scale", "float32", ()))
        if len(row_shape) < 1:
            raise InvalidInput(f"{self.name} stores a distribution over the last axis, but {output!r} "
                               "is a scalar per sample; store it as 'float16' or 'float32'.")
        classes = row_shape[-1]
        if self.k > classes or (self.kind == "topp" and self.min_k > classes):
            raise InvalidInput(f"{self.name} keeps {max(self.k, self.min_k)} entries per row, but "
                               f"{output!r} has only {classes} classes; use a smaller K (or store it dense).")
        lead = tuple(row_shape[:-1])
        if self.kind == "topkq":  # ids never padded here: a sentinel-free dtype holds 65,536 classes
            return (PartSpec("ids", "uint16" if classes <= 2**16 else ids_dtype(classes, output), (*lead, self.k)),
                    PartSpec("values", "uint8", (*lead, self.k)), PartSpec("tail", "uint8", lead))
        parts = [PartSpec("ids", ids_dtype(classes, output), (*lead, self.k)),
                 PartSpec("values", "float16", (*lead, self.k))]
        if self.kind == "sample":
            parts.append(PartSpec("counts", "uint8" if self.k <= 255 else "uint16", (*lead, self.k)))
        return tuple(parts)

    def params(self, row_shape: tuple[int, ...]) -> dict[str, Any]:
        """What the manifest records next to each part: how to read the parts back."""
        if not self.sparse:
            return {"representation": "int8 * scale", "rule": "absmax", "scale": "per sample",
                    "row_shape": list(row_shape)}
        return {"row_shape": list(row_shape), "representation": "logprob", "temperature": self.temperature,
                "rule": self.rule,
                "num_classes": int(row_shape[-1]), "k": self.k,
                **({"p": self.p, "min_k": self.min_k, "cap": self.k} if self.kind == "topp" else {}),
                **({"samples": self.k, "seed": SAMPLE_SEED} if self.kind == "sample" else {}),
                **(_quantised.params(self.k, self.levels) if self.kind == "topkq" else {}),
                "pad": {"id": "iinfo(dtype).max on disk, -1 in batches", "value": "-inf", "count": 0}}

    # -- encode ---------------------------------------------------------------------------
    def encode(self, values: torch.Tensor | TopK, first_sample: int,
               output: str = "output") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Encode one batch (samples ``first_sample, ...``): the stored parts (by part name) and
        the codec's error statistics (merge with :func:`merge_error`)."""
        if isinstance(values, TopK):
            return self.finish(self.encode_topk(values, output), first_sample, output)
        x = values.detach().to("cpu", torch.float32)
        finite = finite_rows(x)
        check_finite(self, finite, first_sample, output)  # before any codec-specific check
        if not self.sparse:
            return encode_int8(x)
        return self.finish(self.encode_tensors(x, first_sample, output, finite), first_sample, output)

    def encode_tensors(self, values: torch.Tensor, first_sample: int, output: str = "output",
                       finite: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The heavy half of a sparse codec's :meth:`encode`, on ``values``' device (a GPU runs
        it before the copy to the host, which then moves K entries per row, not every class):
        the parts as tensors (ids int64, -1 unused; float16 log-probs; counts) and per-row
        diagnostics (:data:`DIAGNOSTICS`), which :meth:`finish` turns into stored arrays and
        statistics on the host. ``finite``: :func:`finite_rows` of ``values`` when the caller
        has it already."""
        x = values.detach().to(dtype=torch.float32)
        self.parts(tuple(x.shape[1:]), output)  # K larger than the class count: InvalidInput here
        classes = x.shape[-1]
        rows = x.reshape(-1, classes)
        logp = torch.log_softmax(rows / self.temperature, dim=-1)
        lead = (x.shape[0], *x.shape[1:-1], self.k)
        common = {"finite": finite_rows(x) if finite is None else finite, "classes": torch.tensor(classes)}
        if self.kind == "topkq":
            parts = _quantised.encode_rows(logp, self.k, self.levels)
            shaped = {"ids": lead, "values": lead, "tail": lead[:-1]}
            return {**common, **{n: (t.reshape(shaped[n]) if n in shaped else t) for n, t in parts.items()}}
        if self.kind == "topk":
            vals, ids = torch.topk(logp, self.k, dim=-1)
            counts = None
        elif self.kind == "topp":
            vals, ids = top_p(logp, self.p, self.min_k, self.k)
            counts = None
        else:
            per = int(np.prod(x.shape[1:-1], dtype=np.int64))
            row_ids = np.arange(first_sample * per, (first_sample + x.shape[0]) * per, dtype=np.int64)
            ids, counts = sample_ids(logp, self.k, row_ids)
            vals = torch.where(ids >= 0, torch.gather(logp, 1, ids.clamp(min=0)), -math.inf)
        out = {"ids": ids.reshape(lead), "values": fp16_logp(vals, ids).reshape(lead), **common,
               **sparse_diagnostics(logp, ids, vals, self.rule)}
        if counts is not None:
            out["counts"] = counts.reshape(lead)
        return out

    def encode_topk(self, top: TopK, output: str = "output") -> dict[str, torch.Tensor]:
        """:meth:`encode_tensors` for rows whose top k an engine already ranked (:class:`TopK`):
        the same parts and diagnostics, from the first K of its k classes, less the KL to the
        full distribution (``kl``: only the full rows give it). Only ``topk`` and ``topkq`` store
        such rows, at the temperature they were computed at (a top-k cannot be re-tempered: that
        needs every class)."""
        if self.kind not in ("topk", "topkq"):
            raise InvalidInput(f"{output!r} comes from a teacher that returns its top {top.k} classes a row, which "
                               f"stores as topk:K or topkq:K with K <= {top.k}, not as {self.name}.")
        if self.k > top.k:
            raise InvalidInput(f"{self.name} keeps {self.k} classes a row of {output!r}, but its teacher returns "
                               f"only its top {top.k}; ask the teacher for k >= {self.k}, or store fewer.")
        if not math.isclose(top.temperature, self.temperature, rel_tol=1e-9):
            raise InvalidInput(f"{output!r}'s teacher returns its distribution at temperature {top.temperature:g}, "
                               f"but {self.name} stores it at {self.temperature:g}; a top-k cannot be re-tempered "
                               f"(that needs every class): build the teacher with temperature={self.temperature:g}, "
                               f"or store @{top.temperature:g}.")
        self.parts(top.shape[1:], output)
        lead = (*top.ids.shape[:-1], self.k)
        ids = top.ids[..., :self.k].reshape(-1, self.k).long()
        vals = top.logprobs[..., :self.k].reshape(-1, self.k).float()
        check_given_rows(ids, vals, top.classes, output)
        finite = torch.isfinite(top.logprobs).reshape(len(top.logprobs), -1).all(-1)
        common = {"finite": finite, "classes": torch.tensor(top.classes)}
        if self.kind == "topkq":
            parts = _quantised.encode_top(vals, ids, self.levels)
            shaped = {"ids": lead, "values": lead, "tail": lead[:-1]}
            return {**common, **{n: (t.reshape(shaped[n]) if n in shaped else t) for n, t in parts.items()}}
        stored = fp16_logp(vals, ids)
        return {"ids": ids.reshape(lead), "values": stored.reshape(lead), **common,
                "mass": vals.exp().sum(-1), "kept": torch.full((len(ids),), self.k),
                "stored_mass": stored.float().exp().sum(-1)}

    def finish(self, tensors: Mapping[str, torch.Tensor], first_sample: int,
               output: str = "output") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The host half of :meth:`encode`: :meth:`encode_tensors`' tensors (on any device) as
        the stored parts and the codec's error statistics; raises :class:`NonFiniteOutput`."""
        t = {k: v.cpu() for k, v in tensors.items()}
        check_finite(self, t["finite"], first_sample, output)
        lead = tuple(t["ids"].shape)
        specs = {s.part: s for s in self.parts((*lead[1:-1], int(t["classes"])), output)}
        if self.kind == "topkq":  # sorted ids are all real: no sentinel, so 65,536 classes fit uint16
            out = {"ids": t["ids"].numpy().astype(specs["ids"].dtype), "values": t["values"].numpy(),
                   "tail": t["tail"].numpy()}
            return out, sparse_error(t, self.rule)
        out = {"ids": store_ids(t["ids"], specs["ids"].dtype), "values": t["values"].numpy()}
        if "counts" in t:
            out["counts"] = t["counts"].numpy().astype(specs["counts"].dtype)
        return out, sparse_error(t, self.rule)

    # -- decode ---------------------------------------------------------------------------
    def decode_part(self, part: str, stored: np.ndarray) -> torch.Tensor:
        """One stored part as the tensor a batch carries (ids int64 with -1 padding; a
        ``topkq`` level as its unnormalised ``log q``, normalised by :func:`assemble`)."""
        if self.kind == "topkq" and part in ("values", "tail"):
            return _quantised.decode_levels(stored, self.levels)
        if self.kind == "topkq" and part == "ids":
            return torch.from_numpy(np.ascontiguousarray(stored).astype(np.int64))
        if part == "ids":
            ids = torch.from_numpy(np.ascontiguousarray(stored).astype(np.int64))
            return ids.masked_fill_(ids == int(np.iinfo(stored.dtype).max), PAD_ID)
        if part == "counts":
            return torch.from_numpy(np.ascontiguousarray(stored).astype(np.int64))
        return torch.from_numpy(np.ascontiguousarray(stored))


# -- parsing and the registry -----------------------------------------------------------------
_NUM = r"(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)"
_PATTERNS = {
    "topk": re.compile(rf"topk:(\d+)(?:@{_NUM})?"),
    "topp": re.compile(rf"topp:{_NUM}:(\d+)(?::(\d+))?(?:@{_NUM})?"),
    "sample": re.compile(rf"sample:(\d+)(?:@{_NUM})?"),
    "topkq": re.compile(rf"topkq:(\d+)(?::(\d+))?(?:@{_NUM})?"),
}
DEFAULT_TOPP_CAP = 100


def is_parts_codec(name: str) -> bool:
    """Whether ``name`` (a user's or a manifest's codec name) is one of this module's codecs."""
    return isinstance(name, str) and (name == "int8" or name.split(":", 1)[0] in _PATTERNS)


#: Every output codec ``compute(outputs=...)`` accepts, as messages and the command line's help list them.
CODEC_CHOICES = ("float32 (exact for float32 outputs), float16, bfloat16, int8 (per-sample absmax), and sparse "
                 "soft labels topk:K[@T], topp:P:MIN_K[:CAP][@T], sample:S[@T], topkq:K[:L][@T] (compact top-k)")


def check_output_codec(name: Any) -> str:
    """The canonical name of any output codec a compute accepts (dense or stored in parts): the
    one place that validates what a user writes in ``outputs``.

    >>> check_output_codec("float16"), check_output_codec("topk:20")
    ('float16', 'topk:20@1')
    """
    if is_parts_codec(name):
        return parts_codec(name).name
    if isinstance(name, str) and name in OUTPUT_CODECS:
        return OUTPUT_CODECS[name].name
    raise InvalidInput(f"unknown output codec {name!r}; choose one of {CODEC_CHOICES} (README: 'Stored dtypes' "
                       "and 'Soft labels and int8').")


@functools.lru_cache(maxsize=64)
def parts_codec(name: str) -> PartsCodec:
    """Parse ``topk:K[@T]``, ``topp:P:MIN_K[:CAP][@T]``, ``sample:S[@T]``, ``topkq:K[:L][@T]`` or ``int8``.

    >>> parts_codec("topk:20@2").name, parts_codec("topp:0.95:5").name, parts_codec("topkq:50").name
    ('topk:20@2', 'topp:0.95:5:100@1', 'topkq:50:128@1')
    """
    if name == "int8":
        return PartsCodec("int8")
    kind = name.split(":", 1)[0]
    m = _PATTERNS[kind].fullmatch(name) if kind in _PATTERNS else None
    if m is None:
        raise InvalidInput(f"cannot parse codec {name!r}; write 'topk:K', 'topk:K@T', "
                           "'topp:P:MIN_K[:CAP][@T]', 'sample:S[@T]', 'topkq:K[:L][@T]' or 'int8'.")
    g = m.groups()
    t = float(g[-1]) if g[-1] is not None else 1.0
    if not (math.isfinite(t) and t > 0):
        raise InvalidInput(f"codec {name!r}: the temperature must be > 0.")
    if kind == "topp":
        p, min_k = float(g[0]), int(g[1])
        cap = int(g[2]) if g[2] is not None else max(min_k, DEFAULT_TOPP_CAP)
        if not 0 < p <= 1 or min_k < 1 or cap < min_k:
            raise InvalidInput(f"codec {name!r}: need 0 < P <= 1 and 1 <= MIN_K <= CAP.")
        return PartsCodec("topp", k=cap, p=p, min_k=min_k, temperature=t)
    k = int(g[0])
    if kind == "topkq":
        levels = int(g[1]) if g[1] is not None else _quantised.DEFAULT_LEVELS
        if k < 1 or not 1 <= levels <= _quantised.MAX_LEVELS:
            raise InvalidInput(f"codec {name!r}: K must be at least 1 and the levels L between 1 and "
                               f"{_quantised.MAX_LEVELS} (a uint8).")
        return PartsCodec("topkq", k=k, temperature=t, levels=levels)
    if k < 1 or (kind == "sample" and k > 65535):
        raise InvalidInput(f"codec {name!r}: K (or S) must be between 1 and 65535.")
    return PartsCodec(kind, k=k, temperature=t)


def manifest_parts_codec(name: str, where: str) -> PartsCodec:
    """:func:`parts_codec` for a name read from a manifest (a bad one is :class:`IncompatibleFormat`)."""
    try:
        return parts_codec(name)
    except InvalidInput as exc:
        raise IncompatibleFormat(f"{where}: unknown codec {name!r} ({exc}); upgrade featstore.") from exc


def part_array(output: str, part: str) -> str:
    """The stored array of one part: ``logits.ids``; the int8 values keep the output's name."""
    return f"{output}.{part}" if part else output


# -- error statistics, merged like the value statistics ----------------------------------------
def merge_error(a: Mapping[str, Any] | None, b: Mapping[str, Any]) -> dict[str, Any]:
    """Combine two batches' error statistics (``*_min``: min, ``*_max``: max, ``*_hist``:
    element-wise sum, anything else: sum)."""
    if a is None:
        return dict(b)
    out: dict[str, Any] = {}
    for k in b:
        x, y = a[k], b[k]
        if k.endswith("_min"):
            out[k] = min(x, y)
        elif k.endswith("_max"):
            out[k] = max(x, y)
        elif k.endswith("_hist"):
            out[k] = [i + j for i, j in zip(x, y, strict=True)]
        else:
            out[k] = x + y
    return out


def finalize_error(s: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's view: ``*_sum`` over rows become ``*_mean`` (the mass histogram stays)."""
    rows = max(int(s.get("rows", 0)), 1)
    kl_rows = max(int(s.get("kl_rows", rows)), 1)  # before kl_rows existed, the KL covered every row
    return {(k[:-4] + "_mean" if k.endswith("_sum") else k):
            (v / (kl_rows if k == "kl_sum" else rows) if k.endswith("_sum") else v) for k, v in s.items()}


# -- names of part arrays, and what the reader does with them --------------------------------
PARTS = ("ids", "values", "counts", "scale", "tail")


def check_array_name(name: Any) -> str:
    """An array name in a manifest: a field (``logits``) or a field's part (``logits.ids``)."""
    if not isinstance(name, str):
        raise InvalidInput(f"array name {name!r} is not a str.")
    base, dot, part = name.partition(".")
    if dot and part not in PARTS:
        raise InvalidInput(f"array name {name!r}: {part!r} is not one of the parts {PARTS}.")
    check_field(base)
    return name


def check_part(codec: str, part: str, dtype: str, where: str) -> PartsCodec:
    """The codec of a part array read from a manifest, checked against the part's dtype."""
    c = manifest_parts_codec(codec, where)
    allowed = c.part_dtypes().get(part)
    if not allowed or dtype not in allowed:
        raise IncompatibleFormat(f"{where}: codec {codec!r} has no part {part!r} stored as {dtype!r}; "
                                 "the manifest is damaged. Delete the version and recompute.")
    return c


def expand_fields(arrays: Mapping[str, Any], fields: Sequence[str]) -> tuple[str, ...]:
    """The arrays to read for ``fields``: an output stored in parts (``logits``) or any one of
    its parts (``logits.ids``) brings all of them, since a part alone cannot be decoded right."""
    by_output: dict[str, list[str]] = {}
    for name, spec in arrays.items():
        by_output.setdefault(getattr(spec, "output", "") or name, []).append(name)
    out: list[str] = []
    for f in fields:
        spec = arrays.get(f)
        group = by_output.get((getattr(spec, "output", "") or f) if spec is not None else f, [f])
        out += [g for g in group if g not in out]
    return tuple(out)


def assemble(arrays: Mapping[str, Any], batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Finish a decoded batch: an int8 output becomes ``int8 * scale`` (float32) under its own
    name and its ``.scale`` part is dropped; a ``topkq`` output's values become normalised
    log-probabilities and its ``.tail`` part is dropped; other sparse parts stay as they are."""
    for name, spec in arrays.items():
        if getattr(spec, "part", None) == "tail" and name in batch and f"{spec.output}.values" in batch:
            values = f"{spec.output}.values"
            batch[values] = _quantised.normalised(batch[values], batch.pop(name))
            continue
        if getattr(spec, "part", None) == "scale" and name in batch and spec.output in batch:
            scale = batch.pop(name).float()
            q = batch[spec.output]
            batch[spec.output] = q.float() * scale.reshape(*scale.shape, *([1] * (q.dim() - scale.dim())))
    return batch


def unpadded(part: str, stored: np.ndarray) -> np.ndarray:
    """The stored entries of one part that are not padding (for the manifest's statistics)."""
    if part == "ids" and stored.dtype.kind == "u":
        kept: np.ndarray = stored[stored != np.iinfo(stored.dtype).max]
        return kept
    if part == "values":
        finite: np.ndarray = stored[np.isfinite(stored)]
        return finite
    if part == "counts":
        return stored[stored > 0]
    return stored.reshape(-1)
