"""Augment functions for the views tests (importable by Dask worker processes)."""

from __future__ import annotations

import torch


def noisy_flip(item, gen):
    """Add generator noise and maybe reverse the vector; return the flip bit as an extra field."""
    x = item["input"] + 0.25 * torch.randn(item["input"].shape, generator=gen)
    flip = bool(torch.rand((), generator=gen) < 0.5)
    return {"input": x.flip(-1) if flip else x, "target": item["target"], "flip": torch.tensor(flip)}


def global_noise(item, gen):
    """Wrong on purpose: draws from torch's global RNG instead of ``gen``."""
    return {"input": item["input"] + torch.randn(item["input"].shape), "target": item["target"]}


class CountingAugment:
    """noisy_flip that appends a line per call to ``path`` (across processes): the generator's
    seed and the item's input bytes (hex), which tell which (sample, view) the call augmented."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, item, gen):
        with open(self.path, "a") as f:
            f.write(f"{gen.initial_seed()} {item['input'].numpy().tobytes().hex()}\n")
        return noisy_flip(item, gen)
