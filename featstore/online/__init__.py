"""Model A in the training loop: the online reader (A run in the consuming process, the same
batches as the stored reader), fill as you train (what it computes becomes the version
``store.compute`` would commit), and the advisor (which of online, compute-then-read and fill
pays here). Builds on the compute and read sides (the one package that uses both).

The names are imported when first used: this package's modules import torch.
"""

import warnings
from typing import TYPE_CHECKING, Any

from featstore._lazy import lazy_exports

if TYPE_CHECKING:  # the names as the type checker sees them (at runtime: imported on first use)
    from featstore.online._advise import (Advice as Advice, advise as advise, bound as bound, Costs as Costs,
                                          MODES as MODES, predict as predict, recommend as recommend, terms as terms,
                                          Workload as Workload)
    from featstore.online._reading import ComputedRows as ComputedRows, online_dataset as online_dataset
    from featstore.online._teacher import plan_teacher as plan_teacher, Planned as Planned, Teacher as Teacher

_NAMES = {
    "Teacher": "_teacher", "Planned": "_teacher", "plan_teacher": "_teacher",
    "ComputedRows": "_reading", "online_dataset": "_reading",
    "Advice": "_advise", "Costs": "_advise", "Workload": "_advise", "advise": "_advise", "MODES": "_advise",
    "bound": "_advise", "predict": "_advise", "recommend": "_advise", "terms": "_advise",
}
__all__ = sorted(_NAMES)
_lazy, __dir__ = lazy_exports(__name__, _NAMES)


def __getattr__(name: str) -> Any:
    if name == "OnlineDataset":  # the online reader's class before there was one reader
        warnings.warn("featstore.online.OnlineDataset is deprecated: the online reader is a FeatureDataset whose "
                      "stream's rows Model A computes (store.dataset(name, teacher=...); ds.online is True).",
                      DeprecationWarning, stacklevel=2)
        from featstore.read import FeatureDataset

        return FeatureDataset
    return _lazy(name)
