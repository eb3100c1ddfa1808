"""A batch of dataset items for Model A, pure: selecting fields of items, collating them
(:func:`collate_batch`: what cannot be batched, by field) and normalising A's outputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

import torch

from featstore.codecs import TopK
from featstore.errors import (FeatstoreError, InvalidInput, MissingInputKey, OutputMismatch)
from featstore._user_code import describe, user_error
from featstore._user_types import Collate, FieldKey, Item


#: A batch's real-token mask travels with its kept fields under this key (never stored).
TOKEN_MASK = "_token_mask"

# ---------------------------------------------------------------------------------------------
# Selecting fields of dataset items and normalising Model A's outputs (pure).
# ---------------------------------------------------------------------------------------------
def select(item: Item, key: FieldKey, what: str) -> Item:
    """Pick ``key`` out of a dataset item (dict key, tuple index, callable, or the item itself)."""
    if key is None:
        return item
    if callable(key):
        try:
            return key(item)
        except FeatstoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's selector raises anything
            raise user_error(exc, f"the {'input_key' if what == 'input' else 'keep'} callable {describe(key)}",
                             "fix it, then rerun.") from exc
    try:
        return item[key]
    except (KeyError, IndexError, TypeError):
        have = (sorted(map(str, item)) if isinstance(item, Mapping)
                else f"a {type(item).__name__} of length {len(item)}" if hasattr(item, "__len__")
                else type(item).__name__)
        raise MissingInputKey(
            f"dataset items have no {what} {key!r} (items are {have}); pass the right "
            f"{'input_key' if what == 'input' else 'keep'} (a key, an index or a callable)."
        ) from None


def collate_batch(items: Sequence[Item], input_key: FieldKey, keep: Mapping[str, FieldKey], collate: Collate | None,
                  start: int) -> tuple[object, dict[str, torch.Tensor]]:
    """Model A's input batch and the kept fields' tensors for dataset items ``start, ...``.

    What cannot be batched is an :class:`InvalidInput` naming the field and the fix (the driver
    calls this on the first item before anything runs, so most such items never reach a task).
    """
    from torch.utils.data import default_collate

    stop = start + len(items)
    try:
        x = (collate or default_collate)([select(it, input_key, "input") for it in items])
    except FeatstoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - default_collate and the user's collate raise anything
        if collate is not None:
            raise user_error(exc, f"ComputeOptions.collate {describe(collate)} on samples [{start}, {stop})",
                             "fix it, then rerun.") from exc
        raise InvalidInput(
            f"collating the input ({describe_field(input_key)}) of samples [{start}, {stop}) failed "
            f"({type(exc).__name__}: {exc}): Model A's inputs must be tensors, numpy arrays or numbers of one "
            "shape. Convert them in the dataset (PIL images: torchvision.transforms.functional.pil_to_tensor), "
            "or pass ComputeOptions(collate=fn) to build the batch (e.g. featstore.ragged.pad_sequences).") from exc
    kept = {}
    for name, key in keep.items():
        values = [select(it, key, "keep field") for it in items]
        try:
            kept[name] = torch.as_tensor(default_collate(values))
        except Exception as exc:  # noqa: BLE001
            raise InvalidInput(
                f"keep field {name!r} of samples [{start}, {stop}) cannot be stored ({type(exc).__name__}: "
                f"{exc}): a kept field must be a number or a tensor of one fixed shape per sample (a "
                f"{type(values[0]).__name__} here). Convert or pad it in the dataset, or leave it out of keep."
            ) from exc
    return x, kept


def describe_field(key: FieldKey) -> str:
    """``input_key`` as messages name it."""
    return "the whole item" if key is None else describe(key) if callable(key) else repr(key)


#: One of Model A's outputs: a tensor, or an engine's top-k rows standing for dense logits.
Output: TypeAlias = torch.Tensor | TopK


def as_outputs(out: object, names: Sequence[str]) -> dict[str, Output]:
    """Model A's return value as ``{output name: tensor or TopK}``."""
    if isinstance(out, (torch.Tensor, TopK)):
        if len(names) != 1:
            raise OutputMismatch(f"Model A returned one tensor but outputs names {list(names)}; "
                                 "return a dict with those keys or name one output.")
        return {names[0]: out}
    if isinstance(out, Mapping):
        # ``outputs`` may name a subset of what A returns (store the logits, not the features);
        # a name A does not return is an error.
        unknown = sorted(set(names) - set(out))
        if unknown:
            raise OutputMismatch(f"outputs names {unknown}, which Model A does not return (it returns "
                                 f"{sorted(map(str, out))}); name a subset of those in `outputs`.")
        bad = [k for k in names if not isinstance(out[k], (torch.Tensor, TopK))]
        if bad:
            raise OutputMismatch(f"Model A's outputs {bad} are not tensors (nor featstore.codecs.TopK).")
        return {k: out[k] for k in names}
    raise OutputMismatch(f"Model A returned a {type(out).__name__}; return a tensor or a dict of tensors.")
