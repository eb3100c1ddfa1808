"""Where a reader is: its placement (rank, world size), the epochs and resume points it shares
with its DataLoader workers (:class:`EpochState`), and the one typed resume state every saver
writes and every loader reads (:class:`ReaderState`).

The names are imported when first used: this package's modules import torch.
"""

from typing import TYPE_CHECKING

from featstore._lazy import lazy_exports

if TYPE_CHECKING:  # the names as the type checker sees them (at runtime: imported on first use)
    from featstore.read.state._epoch_state import (EpochState as EpochState, Iteration as Iteration)
    from featstore.read.state._ranks import (Placement as Placement, resolve as resolve)
    from featstore.read.state._state import (Member as Member, OrderOptions as OrderOptions, ReaderState as ReaderState,
                                             StreamIdentity as StreamIdentity, WorkerPosition as WorkerPosition,
                                             check_workers as check_workers)
    from featstore.read.state._worker_share import (in_worker as in_worker)

_NAMES = {"EpochState": "_epoch_state", "Iteration": "_epoch_state", "Placement": "_ranks", "resolve": "_ranks",
    "Member": "_state", "OrderOptions": "_state", "ReaderState": "_state", "StreamIdentity": "_state",
    "WorkerPosition": "_state", "check_workers": "_state", "in_worker": "_worker_share"}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
