"""One torchrun rank for tests/test_lightning.py: a dataset built before init_process_group (its
rank comes from torchrun's RANK/WORLD_SIZE) read by persistent workers, and one built after it
(from torch.distributed), 2 epochs each, no set_epoch. Writes the indices per epoch."""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

import torch.distributed as dist
from torch.utils.data import DataLoader

import featstore


def main(store: str, ref: str, out: str) -> None:
    early = featstore.open_store(store).dataset(ref, batch_size=25, seed=3)
    dist.init_process_group("gloo")
    late = featstore.open_store(store).dataset(ref, batch_size=25, seed=3)
    seen: dict[str, list[int]] = defaultdict(list)
    for case, ds, persistent in (("early-persistent", early, True), ("late", late, False)):
        loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent, timeout=120)
        for epoch in range(2):
            for batch in loader:
                seen[f"{epoch}/{case}"] += batch["index"].tolist()
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(seen, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
