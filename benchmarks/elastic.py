"""Mixtures and elastic resume: what they cost beside reading one version.

``python -m benchmarks.elastic --n 50000 --repeats 7`` writes two versions of ``n/2`` samples and
one of ``n`` (a linear Model A's fp16 features, 128 wide), then measures, ``repeats`` times
(medians):

- **Mixture read speed.** One shuffled epoch of ``featstore.mix([(a, 0.5), (b, 0.5)])`` (``n``
  samples) against one epoch of the single version of ``n`` samples, in this process
  (``num_workers=0``, batch 256): samples/s, and the ratio (target >= 0.95). Like with like: all
  three versions have the same shard size (``n / 16`` samples), so both reads take the same shuffle
  window (4 shards), the same number of windows and shards per epoch, the same batch, seed and
  shuffle; both are warmed up by one epoch, then measured in alternating order.
- **The same at a larger epoch** (``--large``, default 1,000,000 samples: shards of ``large / 16``):
  read only. A mixture plans and sets up each window for two versions, a fixed cost per window
  and epoch that a 50,000-sample epoch (a few ms) shows at its largest.
- **With a light Model B.** The same epochs with a training step per batch (an MLP 128 -> 256 ->
  10, Adam, the label ``index % 10``, one torch thread), as the reader rows' light B: what the
  difference costs a training loop whose step is not free.
- **Time to the first batch on resume.** A state saved by a 2-rank job at 10% and at 90% of the
  epoch, loaded into rank 0 of 4 ranks (and of 2): seconds from ``load_state_dict`` to the first
  batch. The resume plans only what the new consumer needs, so 90% should cost no more than 10%.

Results go to ``docs/benchmarks-elastic.json`` and the "Mixtures and elastic resume" section of
``docs/benchmarks.md``, with the load average (``os.getloadavg``) during the run: the machine is
shared, so figures taken under load read slower than they are.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn

import featstore

from .reader import torch_threads
from .sections import write_marked

BEGIN, END = "<!-- elastic:begin -->", "<!-- elastic:end -->"
BATCH = 256


class Vectors(torch.utils.data.Dataset):
    """``n`` seeded random vectors (64 wide)."""

    def __init__(self, n: int, seed: int) -> None:
        self.x = torch.randn(n, 64, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input": self.x[i]}


def write(store: featstore.FeatureStore, name: str, n: int, seed: int, shard: int) -> featstore.Version:
    torch.manual_seed(0)
    return store.compute(name, model=nn.Linear(64, 128), dataset=Vectors(n, seed), outputs={"features": "float16"},
                         batch_size=1024, samples_per_shard=shard, client="in-process",
                         options=featstore.ComputeOptions(progress=False))


def epoch_rate(ds: Any, epoch: int) -> float:
    ds.set_epoch(epoch)
    t0, rows = time.perf_counter(), 0
    for b in ds:
        rows += len(b["index"])
    return rows / (time.perf_counter() - t0)


class LightB:
    """A light Model B: an MLP 128 -> 256 -> 10 with Adam on the label ``index % 10``."""

    def __init__(self) -> None:
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10))
        self.opt = torch.optim.Adam(self.net.parameters(), lr=1e-3)
        self.ce = nn.CrossEntropyLoss()

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        loss = self.ce(self.net(batch["features"].float()), batch["index"] % 10)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


def train_rate(ds: Any, epoch: int, b: LightB) -> float:
    """Samples/s of one epoch with a light-B step per batch (reading included), B on one torch
    thread: on this shared machine two spinning intra-op threads made each step ~100x slower
    under load, which measured the load, not the reader."""
    ds.set_epoch(epoch)
    with torch_threads(1):
        t0, rows = time.perf_counter(), 0
        for batch in ds:
            b.step(batch)
            rows += len(batch["index"])
        return rows / (time.perf_counter() - t0)


def first_batch_s(version: featstore.Version, state: dict[str, Any], world: int) -> float:
    t0 = time.perf_counter()
    ds = version.dataset(batch_size=2 * BATCH // world, seed=1, rank=0, world_size=world)
    ds.load_state_dict(state)
    next(iter(ds))
    return time.perf_counter() - t0


def read_only_at(n: int, repeats: int) -> dict[str, Any]:
    """Read-only epochs of the 0.5/0.5 mixture and of one version at ``n`` samples, alternating."""
    with tempfile.TemporaryDirectory() as root:
        store = featstore.open_store(root)
        shard = max(1, -(-n // 16))
        a, b = write(store, "mix/a", n // 2, 1, shard), write(store, "mix/b", n - n // 2, 2, shard)
        one = write(store, "one", n, 3, shard)
        mixed = featstore.mix([(a, 0.5), (b, 0.5)], batch_size=BATCH, seed=1)
        single = one.dataset(batch_size=BATCH, seed=1)
        for ds in (mixed, single):
            epoch_rate(ds, 0)
        rates: dict[str, list[float]] = {"mix": [], "one": []}
        for r in range(repeats):
            pair = ((mixed, "mix"), (single, "one")) if r % 2 == 0 else ((single, "one"), (mixed, "mix"))
            for ds, key in pair:
                rates[key].append(epoch_rate(ds, r + 1))
    m, o = statistics.median(rates["mix"]), statistics.median(rates["one"])
    return {"n": n, "mixture_samples_per_s": m, "one_version_samples_per_s": o, "ratio": m / o,
            "ratios": sorted(x / y for x, y in zip(rates["mix"], rates["one"], strict=True))}


def run(n: int, repeats: int, large: int = 0) -> dict[str, Any]:
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as root:
        store = featstore.open_store(root)
        shard = max(1, -(-n // 16))  # one shard size for all three: the same windows and shards per epoch
        a, b = write(store, "mix/a", n // 2, 1, shard), write(store, "mix/b", n - n // 2, 2, shard)
        one = write(store, "one", n, 3, shard)
        mixed = featstore.mix([(a, 0.5), (b, 0.5)], batch_size=BATCH, seed=1)
        single = one.dataset(batch_size=BATCH, seed=1)
        model = LightB()
        for ds in (mixed, single):  # warm: page cache, imports, arena slots, B's first steps
            epoch_rate(ds, 0), train_rate(ds, 0, model)
        rates: dict[str, list[float]] = {"mix": [], "one": [], "mix_b": [], "one_b": []}
        for r in range(repeats):  # interleaved and alternating, so the machine's load falls on both alike
            pair = ((mixed, "mix"), (single, "one")) if r % 2 == 0 else ((single, "one"), (mixed, "mix"))
            for ds, key in pair:
                rates[key].append(epoch_rate(ds, r + 1))
            for ds, key in pair:
                rates[key + "_b"].append(train_rate(ds, r + 1, model))
            load.append(os.getloadavg()[0])
        steps = -(-n // (2 * BATCH))
        resume: dict[str, dict[str, float]] = {}
        for at in (0.1, 0.9):
            state = one.dataset(batch_size=BATCH, seed=1, rank=0, world_size=2).state_dict(
                batches_seen=int(at * steps), num_workers=0)
            for world in (2, 4):
                resume.setdefault(f"{int(at * 100)}%", {})[f"{world} ranks"] = statistics.median(
                    first_batch_s(one, state, world) for _ in range(repeats))
        load.append(os.getloadavg()[0])
    larger = read_only_at(large, repeats) if large else None
    load.append(os.getloadavg()[0])
    m, o = statistics.median(rates["mix"]), statistics.median(rates["one"])
    mb, ob = statistics.median(rates["mix_b"]), statistics.median(rates["one_b"])
    return {"n": n, "repeats": repeats, "samples_per_shard": shard, "mixture_samples_per_s": m,
            "one_version_samples_per_s": o, "ratio": m / o,
            "ratios": sorted(x / y for x, y in zip(rates["mix"], rates["one"], strict=True)),
            "light_b": {"mixture_samples_per_s": mb, "one_version_samples_per_s": ob, "ratio": mb / ob,
                        "ratios": sorted(x / y for x, y in zip(rates["mix_b"], rates["one_b"], strict=True))},
            "large": larger, "first_batch_s": resume, "load_average": [round(x, 2) for x in load],
            "started": time.strftime("%Y-%m-%d %H:%M")}


def section(r: dict[str, Any]) -> str:
    rate_rows = "\n".join(
        f"| {what}, samples/s | {x['one_version_samples_per_s']:,.0f} | {x['mixture_samples_per_s']:,.0f} | "
        f"{x['ratio']:.3f} | {min(x['ratios']):.2f}–{max(x['ratios']):.2f} |"
        for what, x in (("read only", r), ("light B", r["light_b"])))
    if r.get("large"):
        x = r["large"]
        rate_rows += (f"\n| read only at {x['n']:,} samples (shards of {-(-x['n'] // 16):,}), samples/s | "
                      f"{x['one_version_samples_per_s']:,.0f} | {x['mixture_samples_per_s']:,.0f} | {x['ratio']:.3f} | "
                      f"{min(x['ratios']):.2f}–{max(x['ratios']):.2f} |")
    rows = "\n".join(f"| resume at {at} of the epoch (saved by 2 ranks) | "
                     + " | ".join(f"{s * 1000:.1f} ms" for s in per.values()) + " |"
                     for at, per in r["first_batch_s"].items())
    large_flag = f" --large {r['large']['n']}" if r.get("large") else " --large 0"
    return f"""{BEGIN}
## Mixtures and elastic resume

`python -m benchmarks.elastic --n {r['n']} --repeats {r['repeats']}{large_flag}` ({r['started']}; medians of
{r['repeats']}; load average {min(r['load_average']):.2f}-{max(r['load_average']):.2f} on this shared
2-core machine). Shuffled epochs in one process, batch {BATCH}, fp16 features 128 wide; every
version has {r['samples_per_shard']:,} samples per shard, so both reads take the same shuffle window,
windows and shards per epoch; both warmed up, measured in alternating order. Light B: an MLP
128→256→10 with Adam, one step per batch, on one torch thread.

| read | one version, {r['n']:,} samples | `featstore.mix` of two versions, 0.5/0.5 | ratio (target ≥ 0.95) \
| ratio per repeat (min–max) |
|---|---|---|---|---|
{rate_rows}

| time to the first batch after `load_state_dict` | rank 0 of 2 | rank 0 of 4 |
|---|---|---|
{rows}

See [elastic.md](elastic.md).
{END}
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=50_000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--large", type=int, default=1_000_000, help="also read only at this many samples (0: not)")
    p.add_argument("--out", default="docs")
    args = p.parse_args()
    r = run(args.n, args.repeats, args.large)
    print(json.dumps(r, indent=1))
    with open(os.path.join(args.out, "benchmarks-elastic.json"), "w") as f:
        json.dump(r, f, indent=1)
    write_marked(os.path.join(args.out, "benchmarks.md"), BEGIN, END, section(r))


if __name__ == "__main__":
    main()
