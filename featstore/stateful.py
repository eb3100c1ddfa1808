"""``StatefulLoader``: torchdata's ``StatefulDataLoader`` that resumes featstore datasets under
another split (``pip install torchdata``).

>>> from featstore import StatefulLoader
>>> loader = StatefulLoader(store.dataset("cnn-a/train", batch_size=64), batch_size=None, num_workers=4)
>>> state = loader.state_dict()                  # mid-epoch, saved in a checkpoint
>>> resumed = StatefulLoader(store.dataset("cnn-a/train", batch_size=64), batch_size=None, num_workers=2)
>>> resumed.load_state_dict(state)               # the rest of the epoch, each sample once

Two differences from the plain ``StatefulDataLoader``:

- **Another number of workers, or ranks.** torchdata saves one state per DataLoader worker and
  asserts, on load, that the worker count is the same. A featstore dataset's worker states carry
  the epoch's global progress, so this loader turns them into the rank-level state
  (the dataset's ``state_from_workers``) and loads that into the dataset: the resumed epoch reads
  every remaining sample once under any number of workers, and on any world size with the same
  global batch (see ``docs/elastic.md``). Worker states of an older featstore, and datasets that
  are not featstore's, are loaded by torchdata as before.
- **The state from before the last batch.** Lightning's data fetcher always holds one batch it
  has fetched and not yet given to the training step (to know which batch is the last), so a
  plain ``StatefulDataLoader`` checkpointed between two steps resumes *after* that batch:
  measured, 50 of 400 samples (one batch per rank) never trained after a mid-epoch
  ``fit(ckpt_path=...)``. Lightning does not fetch ahead from a loader whose length it knows,
  and featstore's readers have one (``len(ds)``: the batches this rank yields), so their state is
  the loader's own. Over a dataset without a length, this loader's
  :meth:`~StatefulLoader.state_dict` is the one from before the batch it yielded last (at an
  epoch's end nothing is held back), as Lightning needs it then.
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Any, Protocol, cast

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError as exc:
    raise ImportError("featstore.StatefulLoader needs torchdata: pip install torchdata") from exc

#: torchdata's keys: the multi-worker snapshot, and each worker's dataset state in it.
_SNAPSHOT, _WORKERS, _DATASET = "_snapshot", "_worker_snapshots", "dataset_state"


class StatefulLoader(StatefulDataLoader):
    """A torchdata ``StatefulDataLoader`` whose featstore states resume under another split, and
    whose state, over a dataset without a length, is the one from before the batch it yielded
    last (see the module docstring).

    Use it wherever you would use ``StatefulDataLoader(dataset, batch_size=None, ...)``;
    :class:`featstore.lightning.FeatureDataModule` does.
    """

    def __iter__(self) -> _Tracked:
        it = super().__iter__()
        self._before_last: dict[str, Any] | None = None
        # a dataset with a length: Lightning fetches nothing ahead, the loader's state is right as it is
        return _Tracked(self, it, hold=not isinstance(self.dataset, Sized))

    def state_dict(self) -> dict[str, Any]:
        held = getattr(self, "_before_last", None)
        # torchdata's state_dict is untyped (torchdata ships no type information)
        return held if held is not None else cast("dict[str, Any]", super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict``; a featstore dataset's state with its epoch's progress resumes
        under this loader's number of workers, whatever it was saved with."""
        rank_state = self._rank_state(state_dict)
        if rank_state is None:
            super().load_state_dict(state_dict)
            return
        self.dataset.load_state_dict(rank_state)
        super().load_state_dict({})  # the loader itself starts afresh: the dataset knows the rest

    def _rank_state(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """The dataset's rank-level state with progress (the dataset makes it of its saved
        states: ``state_from_workers``), or None where torchdata restores it as saved."""
        convert: Callable[[list[dict[str, Any]]], dict[str, Any] | None] | None = getattr(
            self.dataset, "state_from_workers", None)
        if convert is None or not state:
            return None
        if _SNAPSHOT in state:
            workers = state[_SNAPSHOT].get(_WORKERS) or {}
            return convert([w.get(_DATASET) or {} for w in workers.values()])
        own = state.get(_DATASET)
        return convert([own]) if isinstance(own, dict) else None


class _LoaderIterator(Protocol):
    """A DataLoader's iterator: its batches, and how many are left in the epoch."""

    def __next__(self) -> object: ...

    def __len__(self) -> int: ...


class _Tracked:
    """The iterator of a :class:`StatefulLoader`: keeps the state from before each batch (``hold``: over
    a dataset without a length, whose loader Lightning fetches one batch ahead of the step)."""

    def __init__(self, loader: StatefulLoader, it: _LoaderIterator, hold: bool) -> None:
        self.loader, self.it, self.hold = loader, it, hold

    def __iter__(self) -> _Tracked:
        return self

    def __next__(self) -> object:
        if not self.hold:
            return next(self.it)
        before = StatefulDataLoader.state_dict(self.loader)
        try:
            batch = next(self.it)
        except StopIteration:
            self.loader._before_last = None  # the epoch is over: nothing held back
            raise
        self.loader._before_last = before
        return batch

    def __len__(self) -> int:
        return len(self.it)
