"""Model A in the training loop: the online reader (A run in the consuming process, the same
batches as the stored reader), fill as you train (what it computes becomes the version
``store.compute`` would commit), and the advisor (which of online, compute-then-read and fill
pays here). Builds on the compute and read sides (the one package that uses both).

The names are imported when first used: this package's modules import torch.
"""

from typing import TYPE_CHECKING

from featstore._lazy import lazy_exports

if TYPE_CHECKING:  # the names as the type checker sees them (at runtime: imported on first use)
    from featstore.online._advise import (Advice as Advice, advise as advise, bound as bound, Costs as Costs,
                                          MODES as MODES, predict as predict, recommend as recommend, terms as terms,
                                          Workload as Workload)
    from featstore.online._reading import online_dataset as online_dataset, OnlineDataset as OnlineDataset
    from featstore.online._teacher import plan_teacher as plan_teacher, Planned as Planned, Teacher as Teacher

_NAMES = {
    "Teacher": "_teacher", "Planned": "_teacher", "plan_teacher": "_teacher",
    "OnlineDataset": "_reading", "online_dataset": "_reading",
    "Advice": "_advise", "Costs": "_advise", "Workload": "_advise", "advise": "_advise", "MODES": "_advise",
    "bound": "_advise", "predict": "_advise", "recommend": "_advise", "terms": "_advise",
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
