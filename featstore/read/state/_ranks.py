"""Which DDP rank a reader reads for, found where it is: the rules, in one place.

A :class:`~featstore.FeatureDataset` may be built long before the process group exists (in a
``LightningModule.__init__`` that ``ddp_spawn`` pickles into its ranks, before
``init_process_group`` in a plain script), so it does not fix its rank when it is built. The
training process resolves it (:func:`resolve`) whenever an epoch's iteration starts in it and
whenever it starts DataLoader workers; the workers plan with what it resolved
(:mod:`featstore.read` carries it to them). In order:

1. ``rank=`` / ``world_size=`` given to the dataset;
2. ``torch.distributed``, once its process group is initialised;
3. the ``RANK`` and ``WORLD_SIZE`` environment variables (``torchrun`` sets both before the
   script runs);
4. one process: rank 0 of 1, unless ``WORLD_SIZE`` says more than one: then which rank this
   is cannot be told (Lightning's ``ddp`` launcher sets ``WORLD_SIZE`` and ``LOCAL_RANK`` but
   not ``RANK`` before the group exists), and iterating raises
   :class:`~featstore.DistributedSetupError` instead of reading another rank's samples.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from featstore.errors import DistributedSetupError, InvalidInput

#: Where a placement came from, by code (the code travels to DataLoader workers in shared memory).
SOURCES = ("unresolved", "one process", "RANK/WORLD_SIZE", "torch.distributed", "rank=/world_size=")
UNRESOLVED = 0


@dataclass(frozen=True)
class Placement:
    """A rank and world size, and where they came from (an index into :data:`SOURCES`)."""

    rank: int
    world: int
    source: int

    @property
    def resolved(self) -> bool:
        return self.source != UNRESOLVED

    def check(self) -> "Placement":
        """This placement, or :class:`DistributedSetupError` when it could not be resolved."""
        if not self.resolved:
            raise DistributedSetupError(
                f"WORLD_SIZE={os.environ.get('WORLD_SIZE')} says this is one of several DDP ranks, but "
                "torch.distributed is not initialised and RANK is not set, so the reader cannot tell "
                "which samples are this rank's. Iterate after init_process_group (Lightning does: build "
                "the DataLoader in train_dataloader()), set RANK, or pass rank=/world_size= to the dataset.")
        return self

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world} ({SOURCES[self.source]})"


def resolve(rank: int | None = None, world: int | None = None) -> Placement:
    """This process's placement by the rules above (``rank``/``world``: the dataset's arguments).

    >>> resolve(1, 4)
    Placement(rank=1, world=4, source=4)
    """
    source = 4  # rule 1: both given, nothing to detect
    if rank is None or world is None:
        found = _detected()
        if not found.resolved:
            return found
        rank = found.rank if rank is None else rank
        world = found.world if world is None else world
        source = found.source
    if not 0 <= rank < world:
        raise InvalidInput(f"rank {rank} is out of range for world_size {world}.")
    return Placement(int(rank), int(world), source)


def _detected() -> Placement:
    """The placement torch.distributed or the environment gives (rules 2-4)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return Placement(dist.get_rank(), dist.get_world_size(), 3)
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    try:
        if env_rank is not None and env_world is not None:
            return Placement(int(env_rank), int(env_world), 2)
        if env_world is not None and int(env_world) > 1:
            return Placement(0, 0, UNRESOLVED)
    except ValueError:
        raise InvalidInput(f"RANK={env_rank!r} / WORLD_SIZE={env_world!r} are not integers.") from None
    return Placement(0, 1, 1)
