"""How an epoch's samples are split over its consumers: the partitions (see
:func:`~featstore.read.plans.consumer_span`). Apart, and free of numpy, so the reader's options
check a partition without importing the plans' arithmetic."""

from typing import Literal

Partition = Literal["even", "pad", "drop"]
PARTITIONS = ("even", "pad", "drop")
