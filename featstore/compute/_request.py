"""What a compute is asked to compute, declared once: :class:`ComputeRequest` holds every keyword
of ``store.compute`` that decides the version (its default, its type and the checks that need
no dataset), and what runs it adds one field each: :class:`ComputeCall` (``store.compute``: where
the shard tasks run, ``client=``) and :class:`featstore.Teacher` (Model A in the loop: the
device, ``fill``). A new compute option is one field here, then its use.

``store.compute`` and :func:`featstore.compute.compute` take :class:`ComputeCall`'s keywords
through :func:`featstore._keywords.keywords_of`: type checkers (a ``ParamSpec``), ``help()``, ``inspect.signature``
and the API pages (``__signature__``, and the ``Args:`` made from the class's ``Attributes:``)
all see every keyword with its type and default, from this one declaration.

Imports neither torch nor Dask: the store's face imports it to build ``compute``'s signature.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, ClassVar

from featstore._allowed_names import check_field
from featstore._keywords import inherit_attributes
from featstore.codecs import check_output_codec
from featstore.codecs import Tokens
from featstore.compute._options import ComputeOptions
from featstore.errors import InvalidInput
from featstore._user_types import FieldKey, MapDataset, ModelSpec
from featstore.versions import Augment, Views, views_arguments

if TYPE_CHECKING:  # torch and Dask only where a compute runs
    from distributed import Client
    from distributed.deploy import Cluster as DaskCluster

    from featstore.versions import Ref

#: ``client="in-process"``: the shard tasks run in the calling process, one after the other,
#: without Dask (see :class:`ComputeCall`).
IN_PROCESS = "in-process"

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def outputs_asked(outputs: Mapping[str, str] | None) -> dict[str, str]:
    """``outputs`` with every name and codec checked (the codecs' canonical names); None is
    ``{"features": "float32"}``."""
    if outputs is None:
        return {"features": "float32"}
    if not isinstance(outputs, Mapping) or not outputs:
        raise InvalidInput("outputs must be a non-empty dict like {'features': 'float16'}.")
    return {check_field(k): check_output_codec(v) for k, v in outputs.items()}


def normalize_keep(keep: Sequence[FieldKey] | Mapping[str, FieldKey]) -> dict[str, FieldKey]:
    """``["target"]`` -> ``{"target": "target"}``; ``{"label": 1}`` stays; ints get ``field<i>``."""
    if isinstance(keep, str):
        keep = [keep]
    pairs = keep.items() if isinstance(keep, Mapping) else ((k if isinstance(k, str) else f"field{k}", k) for k in keep)
    return {check_field(name): key for name, key in pairs}


def ragged_outputs(tokens: Tokens | None, outputs: Mapping[str, str]) -> tuple[str, ...]:
    """The per-token outputs among ``outputs`` (none without ``tokens``)."""
    if tokens is None:
        return ()
    if not isinstance(tokens, Tokens):
        raise InvalidInput("tokens= takes featstore.Tokens(mask=fn, max_tokens=N), e.g. "
                           "Tokens(mask=lambda x: x['attention_mask'], max_tokens=512).")
    return tokens.ragged_outputs(list(outputs))


def caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by this function's caller's callee name
    the user's line: the first frame outside featstore (and outside the ``__init__`` a
    dataclass generates), however deep the call came in (``store.compute``, ``Teacher(...)``,
    ``dataclasses.replace``)."""
    frame: FrameType | None = sys._getframe(1)  # level 1: the function that warns, 2: our caller, which calls it
    level = 2
    while frame is not None and _ours(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def _ours(filename: str) -> bool:
    """Whether a frame is featstore's, or the ``__init__`` and ``replace`` of a dataclass."""
    return filename in ("<string>", dataclasses.__file__) or os.path.abspath(filename).startswith(_PACKAGE + os.sep)


@dataclass(frozen=True, eq=False)
class ComputeRequest:
    """What a compute computes: Model A, the dataset, what to store and how it is cut into shards.

    ``store.compute(name, **keywords)`` and ``featstore.Teacher(**keywords)`` take these
    keywords (the teacher adds ``device`` and ``fill``, ``store.compute`` adds ``client``);
    together with the feature set's name they decide the version (its fingerprint and id).

    Attributes:
        model: an ``nn.Module`` or a zero-argument factory that builds it on each worker.
        dataset: a map-style dataset; items may be tensors, tuples or dicts.
        input_key: which field of an item goes into A (key, index, callable, or None: the item).
        keep: per-sample fields stored beside A's outputs (``["target"]`` or ``{"label": 1}``).
        outputs: ``{output name: codec}``; A returns one tensor (one name) or a dict of them.
            Codecs: ``float32`` (exact), ``float16`` (a cast), ``bfloat16``; soft labels
            stored sparsely ``topk:K[@T]``, ``topp:P:MIN_K[:CAP][@T]``, ``sample:S[@T]``, and
            ``int8`` (per-sample absmax) for dense outputs: see :mod:`featstore.codecs`
            and :mod:`featstore.kd`. None: ``{"features": "float32"}``.
        batch_size: samples per forward of A.
        samples_per_shard: rows per Zarr shard (one object), kept exactly as given (the inner
            chunk is picked to divide it; a value no sensible chunk divides is refused, naming
            values that work); None picks ~16 MiB shards (64 MiB on an object store).
        options: :class:`~featstore.ComputeOptions` (ids, autocast, compression, collate, ...).
        extends: ``"name@id"`` (or a :class:`~featstore.Version`) of a version over the first
            ``len(parent)`` samples of ``dataset``, computed with the same model and outputs:
            only the new samples are computed (plus the parent's last, partial shard), and the
            new version references the parent's shards without copying them. The dataset's
            digest over the shared range must match the parent's (:class:`DatasetMismatch`).
            Not supported together with views (yet): either side having views raises
            :class:`InvalidInput`.
        views: :class:`~featstore.Views` ``(k, augment, seed)``: K augmented views per sample
            (None: the items as they are, one view). View ``v`` of sample ``i`` is
            ``augment(dataset[i], torch.Generator().manual_seed(s))`` with
            ``s = version.view_seed(i, v)``; A runs on it and every stored array (outputs,
            ``keep`` fields, which may name extra fields ``augment`` returns) is stored per view.
            (``views=K, augment=fn, augment_seed=S`` still work for one release, with a
            ``DeprecationWarning``.)
        augment: ``fn(item, generator) -> item``, all its randomness drawn from ``generator``
            (checked: two replays must agree, else :class:`NondeterministicAugment`). Given
            alone, with ``views_of``: that version's augment (a function cannot be read back
            from a store); for a :class:`~featstore.Teacher` without views: a fresh
            augmentation every epoch.
        augment_seed: deprecated, with ``views=K`` only: the views' seed.
        tokens: :class:`~featstore.Tokens` for per-token outputs of token sequences (a
            language model's logits, ``[B, L, ...]``): only each sample's real tokens (the
            mask's) are stored, as flat token rows plus the per-sample ``token_start`` and
            ``token_length`` arrays, with the output's codec applied per token; batches carry
            them flat with ``"<name>.offsets"`` (see :mod:`featstore.ragged`).
        views_of: ``"name@id"`` (or a :class:`~featstore.Version`) of a version whose views
            this Model A runs on: the same K, seeds and augment (K and the seed are taken from
            it; ``augment`` must be the same function) on the same dataset, in the same shards,
            so the two versions can be read together on the same rows (``store.dataset({"a":
            ..., "b": ...})``). A version without views: the same samples in the same order. A
            different dataset, augment, count or seed is :class:`VersionsMisaligned`, naming
            what differs. The link is part of the fingerprint (``fingerprint_parts["views_of"]``).
    """

    model: ModelSpec
    dataset: MapDataset
    _: KW_ONLY
    input_key: FieldKey = "input"
    keep: Sequence[FieldKey] | Mapping[str, FieldKey] = ()
    outputs: Mapping[str, str] | None = None
    batch_size: int = 256
    samples_per_shard: int | None = None
    options: ComputeOptions | None = None
    extends: Ref | None = None
    views: Views | int | None = None
    augment: Augment | None = None
    augment_seed: int | None = None
    tokens: Tokens | None = None
    views_of: Ref | None = None
    # (K, augment, seed) as given, resolved from Views or the deprecated keywords
    _views: tuple[int | None, Augment | None, int | None] = field(init=False, repr=False, default=(None, None, None))

    #: What the deprecation warning of ``views=K, augment=fn`` names.
    caller: ClassVar[str] = "compute"

    def __init_subclass__(cls, **kwargs: object) -> None:
        """A kind of request (``store.compute``'s call, a teacher) documents every keyword it
        takes: the request's attributes first, then its own (one declaration, one text)."""
        super().__init_subclass__(**kwargs)
        inherit_attributes(cls)

    def __post_init__(self) -> None:
        """The checks that need no dataset and no store (the rest: :func:`~featstore.compute.decide`)."""
        if self.views is None and self.augment_seed is None:  # no views given (augment alone: decide() says)
            resolved: tuple[int | None, Augment | None, int | None] = (None, self.augment, None)
        else:
            resolved = views_arguments(self.views, self.augment, self.augment_seed, self.views_of is not None,
                                       caller=self.caller, stacklevel=caller_stacklevel())
        object.__setattr__(self, "_views", resolved)
        outputs = outputs_asked(self.outputs)
        normalize_keep(self.keep)
        ragged_outputs(self.tokens, outputs)
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise InvalidInput(f"batch_size must be a positive int, got {self.batch_size!r}.")
        if self.options is not None and not isinstance(self.options, ComputeOptions):
            raise InvalidInput(f"options= takes featstore.ComputeOptions(...), got {type(self.options).__name__}.")
        if self.compute_options.autocast not in (None, "float16", "bfloat16"):
            raise InvalidInput("ComputeOptions.autocast must be None, 'float16' or 'bfloat16'.")

    @property
    def compute_options(self) -> ComputeOptions:
        """``options``, or the defaults."""
        return self.options if self.options is not None else ComputeOptions()

    @property
    def view_count(self) -> int | None:
        """K, the views per sample as given (None without views, or taken from ``views_of``)."""
        return self._views[0]

    @property
    def view_augment(self) -> Augment | None:
        """The augment: the views' (with views), else the one given alone (or None)."""
        return self._views[1]

    @property
    def view_seed(self) -> int:
        """The views' seed as given (0 when none is)."""
        return self._views[2] or 0

    @property
    def given_view_seed(self) -> int | None:
        """The views' seed as given (None when none is: with ``views_of``, that version's)."""
        return self._views[2]


@dataclass(frozen=True, eq=False)
class ComputeCall(ComputeRequest):
    """``store.compute``'s keywords: a :class:`ComputeRequest` and where its shard tasks run.

    Attributes:
        client: None (an embedded LocalCluster is started and closed), a ``distributed.Client``,
            a Dask cluster object or a scheduler address (``"tcp://scheduler:8786"``); or
            ``"in-process"``: the shard tasks run in this process one after the other, with no
            Dask cluster and no scheduler (the same task code, the same version, byte for byte;
            the progress bar still shows; no dashboard, and ``ComputeOptions``' ``n_workers``,
            ``processes``, ``shards_per_task`` and ``connect_timeout`` do not apply). For
            tests, notebooks and debugging (a breakpoint in Model A stops in this process).
    """

    client: Client | DaskCluster | str | None = field(default=None, kw_only=True)
