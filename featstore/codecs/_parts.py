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

import numpy as np

from featstore.codecs._dense import OUTPUT_CODECS, finite_rows
from featstore.errors import IncompatibleFormat, InvalidInput, NonFiniteOutput
from featstore._allowed_names import check_field
from featstore._lazy import lazy_module

torch = lazy_module("torch")  # imported on first use: the quick commands never need it

PAD_ID = -1
#: Seed of ``sample:S``'s draws (with the sample index): fixed, so a recompute draws the same ids.
SAMPLE_SEED = 0x5EED
#: float16 keeps log-probabilities down to -65504; anything below is probability 0 anyway.
_FP16_MIN = float(np.finfo(np.float16).min)
HIST_BINS = 10
#: Rows of each encoded batch whose KL to the teacher the manifest's codec error records (all
#: of an image batch; a sample of a language model's per-token rows).
KL_ROWS = 256


@dataclass(frozen=True)
class PartSpec:
    """One stored part of an encoded output: its array-name suffix, numpy dtype and row shape."""

    part: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PartsCodec:
    """A codec that stores an output as several arrays.

    ``kind``: ``topk``, ``topp``, ``sample`` or ``int8``; ``k``: K, S, or top-p's cap;
    ``min_k``/``p``: top-p's floor and mass; ``temperature``: of the stored distribution.
    """

    kind: str
    k: int = 0
    p: float = 0.0
    min_k: int = 0
    temperature: float = 1.0

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
        return "int8"

    @property
    def sparse(self) -> bool:
        return self.kind != "int8"

    @property
    def rule(self) -> str:
        return {"topk": "uniform_tail", "topp": "uniform_tail", "sample": "counts"}.get(self.kind, "absmax")

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
                "pad": {"id": "iinfo(dtype).max on disk, -1 in batches", "value": "-inf", "count": 0}}

    # -- encode ---------------------------------------------------------------------------
    def encode(self, values: torch.Tensor, first_sample: int,
               output: str = "output") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Encode one batch (samples ``first_sample, ...``): the stored parts (by part name) and
        the codec's error statistics (merge with :func:`merge_error`)."""
        x = values.detach().to("cpu", torch.float32)
        finite = finite_rows(x)
        _check_finite(self, finite, first_sample, output)  # before any codec-specific check
        if not self.sparse:
            return _encode_int8(x)
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
        if self.kind == "topk":
            vals, ids = torch.topk(logp, self.k, dim=-1)
            counts = None
        elif self.kind == "topp":
            vals, ids = _top_p(logp, self.p, self.min_k, self.k)
            counts = None
        else:
            per = int(np.prod(x.shape[1:-1], dtype=np.int64))
            row_ids = np.arange(first_sample * per, (first_sample + x.shape[0]) * per, dtype=np.int64)
            ids, counts = _sample(logp, self.k, row_ids)
            vals = torch.where(ids >= 0, torch.gather(logp, 1, ids.clamp(min=0)), -math.inf)
        lead = (x.shape[0], *x.shape[1:-1], self.k)
        out = {"ids": ids.reshape(lead), "values": _fp16_logp(vals, ids).reshape(lead),
               "finite": finite_rows(x) if finite is None else finite,
               "classes": torch.tensor(classes), **_sparse_diagnostics(logp, ids, vals, self.rule)}
        if counts is not None:
            out["counts"] = counts.reshape(lead)
        return out

    def finish(self, tensors: Mapping[str, torch.Tensor], first_sample: int,
               output: str = "output") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The host half of :meth:`encode`: :meth:`encode_tensors`' tensors (on any device) as
        the stored parts and the codec's error statistics; raises :class:`NonFiniteOutput`."""
        t = {k: v.cpu() for k, v in tensors.items()}
        _check_finite(self, t["finite"], first_sample, output)
        lead = tuple(t["ids"].shape)
        specs = {s.part: s for s in self.parts((*lead[1:-1], int(t["classes"])), output)}
        out = {"ids": _store_ids(t["ids"], specs["ids"].dtype), "values": t["values"].numpy()}
        if "counts" in t:
            out["counts"] = t["counts"].numpy().astype(specs["counts"].dtype)
        return out, _sparse_error(t, self.rule)

    # -- decode ---------------------------------------------------------------------------
    def decode_part(self, part: str, stored: np.ndarray) -> torch.Tensor:
        """One stored part as the tensor a batch carries (ids int64 with -1 padding)."""
        if part == "ids":
            ids = torch.from_numpy(np.ascontiguousarray(stored).astype(np.int64))
            return ids.masked_fill_(ids == int(np.iinfo(stored.dtype).max), PAD_ID)
        if part == "counts":
            return torch.from_numpy(np.ascontiguousarray(stored).astype(np.int64))
        return torch.from_numpy(np.ascontiguousarray(stored))


def _fp16_logp(vals: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Kept log-probabilities as float16 (below -65504 is probability 0 anyway), padding -inf."""
    return torch.where(ids >= 0, vals.clamp(min=_FP16_MIN), -math.inf).to(torch.float16)


def ids_dtype(classes: int, output: str = "output") -> str:
    """The narrowest unsigned dtype whose largest value (the padding sentinel) is not a class id."""
    if classes < 2**16:
        return "uint16"
    if classes < 2**32:
        return "uint32"
    raise InvalidInput(f"{output!r} has {classes} classes; class ids must fit uint32.")


def _store_ids(ids: torch.Tensor, dtype: str) -> np.ndarray:
    sentinel = np.iinfo(dtype).max
    out = ids.numpy()
    if out.size and int(out.max()) >= sentinel:  # parts() chose the dtype: this is a bug guard
        raise InvalidInput(f"class id {int(out.max())} does not fit {dtype}; report this as a bug.")
    return np.where(out < 0, sentinel, out).astype(dtype)


def _top_p(logp: torch.Tensor, p: float, min_k: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest prefix of each row's classes (by probability) reaching mass ``p``, at least
    ``min_k`` and at most ``cap`` long; slots past it padded with id -1 and value -inf."""
    vals, ids = torch.topk(logp, cap, dim=-1)
    mass = torch.cumsum(vals.exp(), dim=-1)
    # entries needed: 1 + the number of prefixes whose mass is still below p
    need = 1 + (mass < p).sum(dim=-1)
    keep = need.clamp(min=min_k, max=cap)
    slot = torch.arange(cap).expand_as(vals)
    pad = slot >= keep[:, None]
    return vals.masked_fill(pad, -math.inf), ids.masked_fill(pad, PAD_ID)


def _sample(logp: torch.Tensor, s: int, row_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``s`` draws per row from ``exp(logp)``, seeded by each row's global id: unique ids (sorted,
    padded with -1) and their counts."""
    u = torch.from_numpy(_uniforms(row_ids, s)).to(logp.device)
    cdf = torch.cumsum(logp.double().exp(), dim=-1)
    cdf = cdf / cdf[:, -1:]
    drawn = torch.searchsorted(cdf, u, right=True).clamp(max=logp.shape[-1] - 1)
    drawn, _ = torch.sort(drawn, dim=-1)
    new = torch.ones_like(drawn, dtype=torch.bool)
    new[:, 1:] = drawn[:, 1:] != drawn[:, :-1]
    pos = torch.cumsum(new, dim=-1) - 1
    ids = torch.full_like(drawn, PAD_ID).scatter_(1, pos, drawn)
    counts = torch.zeros_like(drawn).scatter_add_(1, pos, torch.ones_like(drawn))
    return ids, counts


def _uniforms(row_ids: np.ndarray, s: int) -> np.ndarray:
    """``s`` uniforms in [0, 1) per row, a pure function of (SAMPLE_SEED, row id, draw): a
    splitmix64 hash of a counter, so a sample draws the same ids in any batch, task or order."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
        z = (row_ids.astype(np.uint64)[:, None] * np.uint64(s) + np.arange(s, dtype=np.uint64)[None, :]
             + np.uint64(SAMPLE_SEED) * np.uint64(0x9E3779B97F4A7C15))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


def _encode_int8(x: torch.Tensor) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    flat = x.reshape(x.shape[0], -1)
    scale = flat.abs().amax(dim=1) / 127.0 if flat.shape[1] else torch.zeros(x.shape[0])
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(flat / safe[:, None]).clamp(-127, 127).to(torch.int8)
    err = (q.float() * scale[:, None] - flat).abs()
    stats = {"rows": int(x.shape[0]), "max_abs_error_max": float(err.max()) if err.numel() else 0.0,
             "rel_error_max": float((err.amax(dim=1) / safe).max() / 127.0) if err.numel() else 0.0}
    return {"": q.reshape(x.shape).numpy(), "scale": scale.numpy()}, stats


def _check_finite(codec: "PartsCodec", finite: torch.Tensor, first_sample: int, output: str) -> None:
    bad = ~finite
    if bool(bad.any()):
        rows = (torch.nonzero(bad).reshape(-1) + first_sample).tolist()
        raise NonFiniteOutput(
            f"Model A produced NaN/Inf in {output!r} for {len(rows)} samples (first: {rows[:10]}), or values "
            f"beyond float32's range (~3.4e38, in which {codec.name} computes); {codec.name} cannot rank or "
            "quantise them (allow_nonfinite does not apply). Fix the model or data, or store this output as "
            "'float32'.")


#: The per-row diagnostics a sparse codec's device half hands its host half (besides the parts).
DIAGNOSTICS = ("finite", "classes", "mass", "kept", "stored_mass", "kl")


def _sparse_diagnostics(logp: torch.Tensor, ids: torch.Tensor, vals: torch.Tensor,
                        rule: str) -> dict[str, torch.Tensor]:
    """Per row: the teacher mass kept, the entries kept, the stored (float16) mass kept, and for
    top-k/top-p the KL of the reconstruction to the teacher on the first :data:`KL_ROWS` rows."""
    kept = ids >= 0
    stored = _fp16_logp(vals, ids).float()
    out = {"mass": torch.exp(torch.gather(logp, 1, ids.clamp(min=0))).masked_fill(~kept, 0).sum(dim=-1),
           "kept": kept.sum(dim=-1), "stored_mass": stored.exp().sum(dim=-1)}
    if rule != "counts":  # a sample's rows are unbiased on average, not close one by one: no per-row KL
        # on the first KL_ROWS rows of each batch: the KL needs two more passes over every class
        # of a row, which for a language model's per-token rows would cost more than the codec
        n = min(len(logp), KL_ROWS)
        out["kl"] = _uniform_tail_kl(logp[:n], torch.gather(logp[:n], 1, ids[:n].clamp(min=0)), stored[:n], kept[:n])
    return out


def _sparse_error(d: Mapping[str, torch.Tensor], rule: str) -> dict[str, Any]:
    """Per-batch error statistics from the per-row diagnostics: mass kept, entries kept, KL."""
    mass, n_kept = d["mass"], d["kept"]
    if not len(mass):  # a batch of token sequences without a single real token
        return {"rows": 0}
    hist = np.histogram(mass.numpy(), bins=HIST_BINS, range=(0.0, 1.0))[0]
    out = {"rows": int(len(mass)), "mass_min": float(mass.min()), "mass_sum": float(mass.sum()),
           "mass_hist": hist.tolist(), "kept_sum": int(n_kept.sum()), "kept_max": int(n_kept.max()),
           "stored_mass_sum": float(d["stored_mass"].sum())}
    if "kl" in d:
        kl = d["kl"]
        out.update(kl_sum=float(kl.sum()), kl_max=float(kl.max()), kl_rows=int(len(kl)))
    return out


def _uniform_tail_kl(logp: torch.Tensor, true_kept: torch.Tensor, stored: torch.Tensor,
                     kept: torch.Tensor) -> torch.Tensor:
    """Per row, KL(teacher || its uniform-tail reconstruction from the stored float16 values),
    in closed form (no dense reconstruction): kept classes compare true and stored log-probs,
    the rest of the mass is compared with the uniform tail."""
    p_true = true_kept.exp().masked_fill(~kept, 0)
    kept_term = (p_true * (true_kept - stored).masked_fill(~kept, 0)).sum(-1)
    rest_plogp = (logp.exp() * logp).sum(-1) - (p_true * true_kept.masked_fill(~kept, 0)).sum(-1)
    rest_mass = (1.0 - p_true.sum(-1)).clamp(min=0)
    tail = (1.0 - stored.exp().sum(-1)).clamp(min=0) / (logp.shape[-1] - kept.sum(-1)).clamp(min=1)
    return (kept_term + rest_plogp - rest_mass * torch.log(tail.clamp(min=1e-30))).clamp(min=0)


RULES = ("uniform_tail", "renormalize", "counts")


def sparse_weights(ids: torch.Tensor, logp: torch.Tensor, counts: torch.Tensor | None, classes: int,
                   rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The one home of the reconstruction rules: for sparse rows ``[rows, slots]`` (ids -1 in
    unused slots), the teacher probability of each slot (0 in unused ones) and the probability
    of each class that was not kept, ``[rows]``.

    ``uniform_tail``: the kept probabilities as stored, the missing mass ``1 - sum`` spread evenly
    over the other classes; ``renormalize``: the kept probabilities scaled to sum to 1, no tail;
    ``counts`` (sample): ``counts / sum(counts)`` on the drawn ids, no tail (unbiased on average).
    """
    kept = ids >= 0
    none = torch.zeros(ids.shape[0])
    if rule == "counts":
        if counts is None:
            raise InvalidInput("the 'counts' rule needs the counts of a sample:S output.")
        w = counts.float() * kept
        return w / w.sum(dim=-1, keepdim=True).clamp(min=1), none
    if rule not in RULES:
        raise InvalidInput(f"unknown reconstruction rule {rule!r}; use one of {RULES}.")
    p = logp.float().exp().masked_fill(~kept, 0)
    if rule == "renormalize":
        return p / p.sum(dim=-1, keepdim=True).clamp(min=1e-30), none
    return p, (1.0 - p.sum(dim=-1)).clamp(min=0) / (classes - kept.sum(dim=-1)).clamp(min=1)


def reconstruct(ids: torch.Tensor, logp: torch.Tensor, counts: torch.Tensor | None, classes: int,
                rule: str) -> torch.Tensor:
    """The dense distribution ``[rows, classes]`` (float32) ``rule`` rebuilds from sparse rows
    (see :func:`sparse_weights`)."""
    w, tail = sparse_weights(ids, logp, counts, classes, rule)
    kept = ids >= 0
    dense = tail[:, None].repeat(1, classes)
    rows = torch.arange(ids.shape[0])[:, None].expand_as(ids)
    dense[rows[kept], ids[kept]] = w[kept]
    return dense


# -- parsing and the registry -----------------------------------------------------------------
_NUM = r"(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)"
_PATTERNS = {
    "topk": re.compile(rf"topk:(\d+)(?:@{_NUM})?"),
    "topp": re.compile(rf"topp:{_NUM}:(\d+)(?::(\d+))?(?:@{_NUM})?"),
    "sample": re.compile(rf"sample:(\d+)(?:@{_NUM})?"),
}
DEFAULT_TOPP_CAP = 100


def is_parts_codec(name: str) -> bool:
    """Whether ``name`` (a user's or a manifest's codec name) is one of this module's codecs."""
    return isinstance(name, str) and (name == "int8" or name.split(":", 1)[0] in _PATTERNS)


#: Every output codec ``compute(outputs=...)`` accepts, as messages and the command line's help list them.
CODEC_CHOICES = ("float32 (exact for float32 outputs), float16, bfloat16, int8 (per-sample absmax), and sparse "
                 "soft labels topk:K[@T], topp:P:MIN_K[:CAP][@T], sample:S[@T]")


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
    """Parse ``topk:K[@T]``, ``topp:P:MIN_K[:CAP][@T]``, ``sample:S[@T]`` or ``int8``.

    >>> parts_codec("topk:20@2").name, parts_codec("topp:0.95:5").name
    ('topk:20@2', 'topp:0.95:5:100@1')
    """
    if name == "int8":
        return PartsCodec("int8")
    kind = name.split(":", 1)[0]
    m = _PATTERNS[kind].fullmatch(name) if kind in _PATTERNS else None
    if m is None:
        raise InvalidInput(f"cannot parse codec {name!r}; write 'topk:K', 'topk:K@T', "
                           "'topp:P:MIN_K[:CAP][@T]', 'sample:S[@T]' or 'int8'.")
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
PARTS = ("ids", "values", "counts", "scale")
_PART_DTYPE_OK = {"ids": ("uint16", "uint32"), "values": ("float16",), "counts": ("uint8", "uint16"),
                  "scale": ("float32",), "": ("int8",)}


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
    allowed = _PART_DTYPE_OK.get(part) if c.sparse != (part in ("", "scale")) else None
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
    name and its ``.scale`` part is dropped; sparse parts stay as they are."""
    for name, spec in arrays.items():
        if getattr(spec, "part", None) == "scale" and name in batch and spec.output in batch:
            scale = batch.pop(name).float()
            q = batch[spec.output]
            batch[spec.output] = q.float() * scale.reshape(*scale.shape, *([1] * (q.dim() - scale.dim())))
    return batch


def unpadded(part: str, stored: np.ndarray) -> np.ndarray:
    """The stored entries of one part that are not padding (for the manifest's statistics)."""
    if part == "ids" and stored.dtype.kind == "u":
        return stored[stored != np.iinfo(stored.dtype).max]
    if part == "values":
        return stored[np.isfinite(stored)]
    if part == "counts":
        return stored[stored > 0]
    return stored.reshape(-1)
