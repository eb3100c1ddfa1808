"""Augmented views: replayable seeds, the view an epoch reads, and the augmented item: pure.

A version computed with ``views=K, augment=fn`` holds K views per sample. View ``v`` of sample
``i`` is ``fn(dataset[i], torch.Generator().manual_seed(s))`` with ``s = view_seed(seed, i, v)``,
where ``seed`` is the version's ``augment_seed``: Model A ran on exactly that item, and anyone
holding the dataset and ``fn`` can rebuild it bit for bit (the seeds are also stored, as the
``view_seed`` array of each view).

The seed policy (:data:`SEED_POLICY`): splitmix64's finaliser applied three times, mixing in the
version seed, the view and the sample index in turn, then shifted right by one bit so every seed
is a non-negative int64 (what ``torch.Generator.manual_seed`` and plain Zarr readers accept).
Vectorised over indices, so a view's seeds cost one numpy pass.

The reader reads one view per epoch (:func:`epoch_view`): ``"epoch"`` walks a seeded permutation
of the K views per cycle of K epochs, so K epochs see every view of every sample exactly once;
an int pins one view; ``"random"`` draws one per (seed, epoch). One view per epoch means an epoch
reads exactly the bytes a single-view version would.

Nothing here does IO besides calling the user's dataset and augment.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache


from featstore.errors import InvalidInput, NondeterministicAugment
from featstore._user_code import read_item
from featstore._user_types import FieldKey, Item, MapDataset
from featstore._lazy import np, torch  # imported on first use: the quick commands never need them
from featstore.versions._digests import InputCheck


SEED_POLICY = "splitmix64(seed,view,index)>>1/v1"
VIEW_MODES = ("epoch", "random")
#: The per-view array holding every sample's seed, and the batch key naming the epoch's view.
SEED_FIELD = "view_seed"
VIEW_FIELD = "view"
#: A domain constant keeps the reader's per-epoch seeds (a join without views) apart from view seeds.
_EPOCH_DOMAIN = 0x5EED_E90C
#: splitmix64's constants (made np.uint64 where used: numpy is imported lazily).
_GAMMA, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

#: ``fn(item, generator) -> item``: an augmentation whose randomness is drawn from ``generator``.
Augment = Callable[[Item, "torch.Generator"], Item]


@dataclass(frozen=True)
class Views:
    """K augmented views per sample, one option of :meth:`FeatureStore.compute`: view ``v`` of
    sample ``i`` is ``augment(dataset[i], torch.Generator().manual_seed(view_seed(seed, i, v)))``.

    >>> views = Views(k=8, augment=random_crop, seed=0)       # doctest: +SKIP
    >>> store.compute("cnn-a/views", model=model_a, dataset=train_set, views=views)  # doctest: +SKIP

    Args:
        k: the number of views per sample (at least 1).
        augment: ``fn(item, generator) -> item``, drawing its randomness from ``generator`` only
            (checked: an augment that does not is :class:`~featstore.NondeterministicAugment`).
        seed: the views' seed (stored in the manifest; the reader replays the same views).
    """

    k: int
    augment: Augment
    seed: int = 0


def views_arguments(views: Views | int | None, augment: Augment | None, augment_seed: int | None, linked: bool,
                    caller: str, stacklevel: int) -> tuple[int | None, Augment | None, int | None]:
    """``views=Views(k, augment, seed)`` as the driver's three values, where ``views`` or
    ``augment_seed`` is given (``augment=fn`` alone, which names a ``views_of=`` base's augment,
    never comes here); the old keywords (``views=K, augment=fn, augment_seed=S``) still work for
    one release, with a warning. ``linked`` (``views_of=``): the seed left out is the base's (None)."""
    if isinstance(views, Views):
        if augment is not None or augment_seed is not None:
            raise InvalidInput("give augment and its seed inside views=featstore.Views(k=..., augment=fn, seed=...), "
                               "not beside it.")
        return views.k, views.augment, views.seed
    warnings.warn(f"{caller}(views=K, augment=fn, augment_seed=S) is deprecated and goes in the next release: "
                  "pass views=featstore.Views(k=K, augment=fn, seed=S).", DeprecationWarning, stacklevel=stacklevel)
    return views, augment, None if linked and augment_seed is None else (augment_seed or 0)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(_GAMMA)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
        return z ^ (z >> np.uint64(31))


def _u64(value: int) -> np.ndarray:
    return np.array([int(value) & 0xFFFF_FFFF_FFFF_FFFF], dtype=np.uint64)


@lru_cache(maxsize=256)
def _view_base(seed: int, view: int) -> np.uint64:
    """The per-(seed, view) half of the policy, shared by every sample (cached: one per epoch)."""
    mixed: np.uint64 = _mix(_mix(_u64(seed)) ^ _u64(view))[0]
    return mixed


def view_seeds(seed: int, view: int, indices: Sequence[int] | np.ndarray) -> np.ndarray:
    """The seeds of view ``view`` of samples ``indices`` (int64, all non-negative).

    >>> view_seeds(0, 1, [0, 1]).dtype, bool((view_seeds(0, 1, [0, 1]) >= 0).all())
    (dtype('int64'), True)
    """
    idx = np.asarray(indices, dtype=np.int64).astype(np.uint64).reshape(-1)
    return (_mix(_view_base(int(seed), int(view)) ^ idx) >> np.uint64(1)).astype(np.int64)


def view_seed(seed: int, index: int, view: int) -> int:
    """The seed of one (sample, view): ``augment(dataset[index], torch.Generator().manual_seed(it))``
    replays the input Model A saw.

    >>> view_seed(0, 5, 2) == int(view_seeds(0, 2, [5])[0])
    True
    """
    return int(view_seeds(seed, view, [index])[0])


@lru_cache(maxsize=64)
def _epoch_domain(seed: int) -> int:
    return int(_mix(_u64(seed) ^ _u64(_EPOCH_DOMAIN))[0])


def epoch_seeds(seed: int, epoch: int, indices: Sequence[int] | np.ndarray) -> np.ndarray:
    """Fresh per-(epoch, sample) seeds for a reader that augments a version without views."""
    return view_seeds(_epoch_domain(int(seed)), epoch, indices)


def check_view_mode(mode: object, views: int | None) -> str | int | None:
    """Validate a reader's ``view=`` choice against a version's view count (None: no views)."""
    if views is None:
        if mode is not None:
            raise InvalidInput(f"view={mode!r} was given, but this version has no views; compute it "
                               "with views=K and augment=fn, or leave view unset.")
        return None
    if mode is None:
        return "epoch"
    if isinstance(mode, bool) or not (mode in VIEW_MODES or isinstance(mode, (int, np.integer))):
        raise InvalidInput(f"view must be 'epoch', 'random' or an int in [0, {views}), got {mode!r}.")
    if not isinstance(mode, str) and not 0 <= int(mode) < views:
        raise InvalidInput(f"view={mode} is out of range: this version has {views} views (0..{views - 1}).")
    return mode if isinstance(mode, str) else int(mode)


def epoch_view(views: int, mode: str | int, seed: int, epoch: int) -> int:
    """The view every sample of epoch ``epoch`` is read from.

    ``"epoch"``: position ``epoch mod K`` of a permutation of the K views seeded by
    (seed, epoch // K), so each cycle of K epochs reads each view once. ``"random"``: one
    uniform draw per (seed, epoch). An int: that view.

    >>> sorted(epoch_view(4, "epoch", 0, e) for e in range(4, 8))
    [0, 1, 2, 3]
    """
    if not isinstance(mode, str):
        return int(mode)
    if epoch < 0:
        raise InvalidInput(f"epoch must be non-negative, got {epoch}.")
    if mode == "epoch":
        cycle, pos = divmod(epoch, views)
        return int(np.random.default_rng([seed, cycle, 2]).permutation(views)[pos])
    if mode == "random":
        return int(np.random.default_rng([seed, epoch, 3]).integers(views))
    raise InvalidInput(f"view must be 'epoch', 'random' or an int, got {mode!r}.")


def replay(augment: Augment, item: Item, seed: int) -> Item:
    """``augment(item, generator)`` with a fresh generator seeded by ``seed``."""
    return augment(item, torch.Generator().manual_seed(int(seed)))


def replay_rows(augment: Augment, items: Sequence[Item], seeds: Sequence[int] | np.ndarray) -> list[Item]:
    """``[replay(augment, item, seed) for item, seed in zip(items, seeds)]``, bit for bit, with one
    generator re-seeded per row instead of a new one per row: ``manual_seed`` resets a CPU
    generator's whole state (its Mersenne Twister and the cached normal samples), so the row
    draws exactly what a fresh generator with that seed would. The generator is only the row's
    for the duration of its call (the contract: ``augment`` draws from it, it does not keep it).
    """
    gen = torch.Generator()
    seeds = seeds.tolist() if isinstance(seeds, np.ndarray) else [int(s) for s in seeds]
    if len(items) != len(seeds):
        raise InvalidInput(f"{len(items)} items but {len(seeds)} seeds.")
    return [augment(it, gen.manual_seed(s)) for it, s in zip(items, seeds, strict=True)]


class ViewDataset:
    """``dataset`` as view ``view`` sees it: item ``i`` is augmented with its view seed.

    This is what Model A runs on at compute time (and what the reader's join rebuilds): a
    map-style dataset (``__len__``, ``__getitem__``, ``__getitems__``), as torch's DataLoader reads.
    """

    def __init__(self, dataset: MapDataset, augment: Augment, seed: int, view: int) -> None:
        self.dataset, self.augment, self.seed, self.view = dataset, augment, int(seed), int(view)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Item:
        return replay(self.augment, self.dataset[i], view_seed(self.seed, i, self.view))

    def __getitems__(self, indices: Sequence[int]) -> list[Item]:
        getitems = getattr(self.dataset, "__getitems__", None)
        return self.seen(list(getitems(list(indices))) if getitems else [self.dataset[i] for i in indices], indices)

    def seen(self, items: list[Item], indices: Sequence[int]) -> list[Item]:
        """``items`` (the dataset's items ``indices``) as this view sees them."""
        return replay_rows(self.augment, items, view_seeds(self.seed, self.view, indices))


def fresh_view(dataset: MapDataset, augment: Augment, seed: int, epoch: int) -> ViewDataset:
    """``dataset`` as a fresh augmentation (one never stored) draws it in epoch ``epoch``: item
    ``i`` augmented with ``epoch_seeds(seed, epoch, [i])``, the seed the reader's ``source=`` join
    replays for the same rows (a view of the epoch seeds' own domain)."""
    return ViewDataset(dataset, augment, _epoch_domain(int(seed)), epoch)


# -- detecting an augment that does not draw from its generator --------------------------------
def raw_bytes(x: torch.Tensor | np.ndarray) -> bytes:
    """The bytes of a tensor (on any device) or array, in C order: what digests and bit-for-bit
    comparisons read."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().contiguous().reshape(-1)
        return x.view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def _same(a: object, b: object) -> bool:
    """Bit-for-bit equality of two augmented items (NaN equals NaN)."""
    arrays = (torch.Tensor, np.ndarray)
    if isinstance(a, arrays) and isinstance(b, arrays):
        return type(a) is type(b) and (a.dtype, a.shape) == (b.dtype, b.shape) and raw_bytes(a) == raw_bytes(b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def check_replayable(dataset: MapDataset, augment: Augment, seed: int, positions: Sequence[int]) -> Item:
    """Replay ``augment`` twice on each item of ``positions`` (view 0) with the same seed and
    raise :class:`NondeterministicAugment` if the two differ; return the first augmented item.

    Between the two replays the global RNGs (torch, numpy, random) are moved to different
    states, so an augment that draws from them instead of its generator is caught; they are
    restored afterwards.
    """
    import random

    first = None
    states = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        for i in positions:
            item = read_item(dataset, i)
            s = view_seed(seed, i, 0)
            outs = []
            for salt in (1, 2):
                torch.manual_seed(salt)
                np.random.seed(salt)
                random.seed(salt)
                outs.append(replay(augment, item, s))
            if not _same(outs[0], outs[1]):
                raise NondeterministicAugment(
                    f"augment gave two different results for sample {i} with the same seed: it uses "
                    "randomness other than the torch.Generator it is given (torch.rand without "
                    "generator=, numpy.random, random, or an unseeded library transform). Draw every "
                    "random number from the generator, e.g. torch.rand((), generator=gen), so each "
                    "view can be replayed.")
            first = outs[0] if first is None else first
    finally:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])
    return first


# -- the reader's join: the student's own input beside A's outputs -----------------------------
def normalize_fields(fields: Sequence[FieldKey] | Mapping[str, FieldKey] | None) -> dict[str, FieldKey] | None:
    """``["image"]`` -> ``{"image": "image"}``; ``{"x": 0}`` stays; ints become ``field<i>``."""
    if fields is None:
        return None
    if isinstance(fields, str):
        fields = [fields]
    if isinstance(fields, Mapping):
        return dict(fields)
    return {(k if isinstance(k, str) else f"field{k}"): k for k in fields}


def item_fields(item: Item, fields: Mapping[str, FieldKey] | None) -> dict[str, Item]:
    """The fields of one (augmented) source item that go into a batch.

    ``fields=None``: every key of a dict item, ``input`` for a tensor item, ``field<i>`` for
    the members of a tuple item. Otherwise ``{batch name: key, index or callable}``.
    """
    return {k: col[0] for k, col in item_columns([item], fields).items()}


def item_columns(items: Sequence[Item], fields: Mapping[str, FieldKey] | None) -> dict[str, list[Item]]:
    """:func:`item_fields` of every item, by field: ``{batch name: [value per item]}``, built
    column by column (no dict per row). The first item decides the names with ``fields=None``."""
    if not items:
        return {}
    first = items[0]
    if fields is None:
        if isinstance(first, Mapping):
            return {k: [it[k] for it in items] for k in first}
        if isinstance(first, (tuple, list)):
            return {f"field{i}": [it[i] for it in items] for i in range(len(first))}
        return {"input": list(items)}
    out = {}
    for name, key in fields.items():
        try:
            out[name] = [key(it) for it in items] if callable(key) else [it[key] for it in items]
        except (KeyError, IndexError, TypeError):
            raise InvalidInput(f"source items have no field {key!r}; pass source_fields naming "
                               "keys, indices or callables that exist.") from None
    return out


class SourceJoin:
    """Rebuild the student's inputs for a batch: ``source[i]``, augmented with each row's seed,
    each item first checked against the input digest stored for its row (``check``; None for a
    version stored without digests)."""

    def __init__(self, source: MapDataset, augment: Augment | None, fields: Mapping[str, FieldKey] | None,
                 check: InputCheck | None = None) -> None:
        self.source, self.augment, self.fields, self.check = source, augment, fields, check

    def rows(self, indices: np.ndarray, seeds: np.ndarray | None) -> dict[str, torch.Tensor]:
        """The joined fields of ``indices``, collated (one tensor per field); an item that is not
        the one its row was computed from is a :class:`SourceMismatch` naming it."""
        from torch.utils.data import default_collate

        idx = np.asarray(indices, dtype=np.int64).reshape(-1).tolist()
        getitems = getattr(self.source, "__getitems__", None)
        items = list(getitems(idx)) if getitems else [self.source[i] for i in idx]
        if self.check is not None:
            self.check.check(idx, items, "source")
        if self.augment is not None and seeds is not None:
            items = replay_rows(self.augment, items, seeds)
        return {k: torch.as_tensor(default_collate(col)) for k, col in item_columns(items, self.fields).items()}
