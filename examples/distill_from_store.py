"""Compute a frozen Model A's outputs into a local store once, then train Model B from it with
two DataLoader workers.

    python examples/distill_from_store.py [STORE_DIR]

Model A is a small CNN (features + 1000-class logits). Model B is an MLP on A's features with
two heads: one learns the dataset's labels, one distils A's logits.
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

import featstore
from featstore.demo import ModelA, SyntheticImages


def main(root: str = "./example-store") -> None:
    store = featstore.open_store(root)
    data = SyntheticImages(8000)

    # 1. Run A once over the dataset, on an embedded Dask LocalCluster (dashboard link printed).
    version = store.compute(
        "example/cnn-a", model=ModelA(), dataset=data, input_key="input", keep=["target"],
        outputs={"features": "float16", "logits": "float32"}, batch_size=256,
    )
    store.tag(version, "latest-example")
    print(f"stored {version}")

    # 2. Train B from the store: ready batches, sharded across 2 worker processes.
    ds = store.dataset("example/cnn-a@latest-example", batch_size=256, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    body = nn.Sequential(nn.Linear(128, 256), nn.ReLU())
    classify, distill = nn.Linear(256, 10), nn.Linear(256, 1000)  # labels; A's 1000 logits
    params = [*body.parameters(), *classify.parameters(), *distill.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3)
    for epoch in range(3):
        ds.set_epoch(epoch)
        t0, total, correct, seen = time.perf_counter(), 0.0, 0, 0
        for batch in loader:
            h = body(batch["features"].float())
            logits = classify(h)
            loss = F.cross_entropy(logits, batch["target"]) + F.kl_div(
                F.log_softmax(distill(h), 1), F.log_softmax(batch["logits"], 1), log_target=True,
                reduction="batchmean")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(logits)
            correct += int((logits.argmax(1) == batch["target"]).sum())
            seen += len(logits)
        print(f"epoch {epoch}: {seen} samples, loss {total / seen:.3f}, accuracy {correct / seen:.3f}, "
              f"{time.perf_counter() - t0:.2f}s")


if __name__ == "__main__":
    main(*sys.argv[1:])
