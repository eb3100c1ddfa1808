"""The GPU check of featstore's compute path: ``python -m benchmarks.gpu_check`` (issue 14).

On a machine with CUDA, in one run of a few minutes:

(a) ``store.compute`` of a ResNet-50-shaped Model A (random weights, built from ``torch.nn``;
    :mod:`benchmarks.resnet`), batch 256, 224x224 uint8 images served from a small pool in host
    memory, on the embedded cluster (one worker process per GPU), without and with fp16 autocast;
(b) the same model's pure inference throughput on the same GPU in the same run (input already
    on the GPU; and from pinned host memory), with no featstore and no Dask;
(c) the stored outputs against a float32 CPU reference on the first samples, within a stated
    tolerance per mode;
(d) GPU utilisation sampled (NVML, else ``nvidia-smi``) while each compute runs.

It writes ``docs/gpu_check.json`` and replaces the "GPU check" section of
``docs/benchmarks.md`` (between its two marker lines) with the date, the device and the figures.
Where CUDA is absent it says so and exits 0 without writing anything; ``--allow-cpu`` runs the
same steps on the CPU at a small size, which is how the tests keep this script working.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from .resnet import resnet50, tiny_resnet

#: fp32 runs may use TF32 convolutions (cuDNN's default) and fp16 autocast keeps 10 mantissa
#: bits; both measured ~1e-3 relative L2 error over this network, bf16 ~4e-3 (on the CPU). The
#: bounds leave a margin and still catch a wrong device, layout or row order (errors ~1).
TOLERANCE = {"float32": 1e-2, "float16": 1e-2, "bfloat16": 3e-2}
TARGET = 0.90  # compute samples/s over pure inference samples/s at fp16 autocast (issue 14)
MARK_START = "<!-- gpu-check:start -->"
MARK_END = "<!-- gpu-check:end -->"
_SECTION = re.compile(re.escape(MARK_START) + r".*?" + re.escape(MARK_END) + r"\n?", re.S)


class CheapImages(torch.utils.data.Dataset):
    """``n`` uint8 images ``3 x size x size`` cycled from a seeded pool: nothing to decode, so
    the input pipeline costs one collate and one copy per batch."""

    def __init__(self, n: int, size: int, pool: int = 256, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.n, self.pool = n, torch.randint(0, 256, (min(pool, n), 3, size, size), dtype=torch.uint8, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.pool[i % len(self.pool)]

    def __getitems__(self, idx: list[int]) -> list[torch.Tensor]:
        return [self.pool[i % len(self.pool)] for i in idx]


# ---------------------------------------------------------------------------------------------
# GPU utilisation sampler.
# ---------------------------------------------------------------------------------------------
class UtilSampler:
    """Samples every GPU's utilisation (%) every ``period`` s in a thread while active."""

    def __init__(self, period: float = 0.1) -> None:
        self.period = period
        self.samples: list[list[float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.source = _util_source()

    def __enter__(self) -> "UtilSampler":
        self.samples, self._stop = [], threading.Event()
        if self.source is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        read = self.source[1]
        while not self._stop.wait(self.period):
            try:
                self.samples.append([float(u) for u in read()])
            except Exception:  # noqa: BLE001 - a failed read is a missing sample, not a failed check
                pass

    def summary(self) -> dict[str, Any]:
        """Per GPU (NVML numbering): mean, median, 10th percentile and max of the samples."""
        out: dict[str, Any] = {"source": self.source[0] if self.source else None, "samples": len(self.samples)}
        for gpu in range(min((len(s) for s in self.samples), default=0)):
            s = sorted(row[gpu] for row in self.samples)
            out[f"gpu{gpu}"] = {"mean": round(sum(s) / len(s), 1), "median": s[len(s) // 2],
                                "p10": s[len(s) // 10], "max": s[-1]}
        return out


def _util_source() -> tuple[str, Any] | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        return "nvml", lambda: [pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles]
    except Exception:  # noqa: BLE001 - no NVML binding or library: try the command line
        pass
    if shutil.which("nvidia-smi"):
        cmd = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
        return "nvidia-smi", lambda: subprocess.run(cmd, capture_output=True, text=True,
                                                    timeout=5).stdout.split()
    return None


# ---------------------------------------------------------------------------------------------
# The measurements.
# ---------------------------------------------------------------------------------------------
def _autocast(device: torch.device, mode: str):
    import contextlib

    if mode == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, mode))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pure_inference(model: torch.nn.Module, device: torch.device, batch: int, size: int, mode: str,
                   seconds: float, from_host: bool) -> dict[str, float]:
    """Samples/s of ``model`` alone on ``device``: input already there, or copied each batch
    from pinned host memory (``from_host``)."""
    g = torch.Generator().manual_seed(1)
    host = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=g)
    if device.type == "cuda":
        host = host.pin_memory()
    on_dev = host.to(device)

    def step() -> None:
        x = host.to(device, non_blocking=True) if from_host else on_dev
        with _autocast(device, mode):
            model(x)

    with torch.inference_mode():
        for _ in range(3):
            step()
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        iters = max(3, int(seconds / max(time.perf_counter() - t0, 1e-6)))
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        _sync(device)
        dt = time.perf_counter() - t0
    return {"samples_per_s": round(iters * batch / dt, 1), "batches": iters, "seconds": round(dt, 3)}


def input_pipeline(ds: CheapImages, batch: int, batches: int, pin: bool) -> dict[str, float]:
    """Samples/s of the dataset side alone: fetch, collate (and pin, as the GPU path does)."""
    from torch.utils.data import default_collate

    t0 = time.perf_counter()
    for b in range(batches):
        x = default_collate(ds.__getitems__(list(range(b * batch, (b + 1) * batch))))
        if pin:
            x = x.pin_memory()
    dt = time.perf_counter() - t0
    return {"samples_per_s": round(batches * batch / dt, 1), "batches": batches}


def compare(stored: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float) -> dict[str, Any]:
    """Relative L2 error and max |error| / max |ref| of each stored output against the reference."""
    out: dict[str, Any] = {}
    for name, r in ref.items():
        s, r = stored[name].double(), r.double()
        rel = float((s - r).norm() / r.norm().clamp_min(1e-30))
        peak = float((s - r).abs().max() / r.abs().max().clamp_min(1e-30))
        out[name] = {"rel_l2": rel, "max_rel": peak, "ok": rel <= tol and peak <= 2 * tol}
    out["ok"] = all(v["ok"] for k, v in out.items() if k != "ok")
    out["tolerance"] = tol
    return out


def cpu_reference(model: torch.nn.Module, ds: CheapImages, rows: int) -> dict[str, torch.Tensor]:
    """Model A in float32 on the CPU over the first ``rows`` samples."""
    import copy

    cpu = copy.deepcopy(model).to("cpu").float().eval()
    with torch.inference_mode():
        return {k: v.float() for k, v in cpu(torch.stack([ds[i] for i in range(rows)])).items()}


def run_compute(store: Any, client: Any, model: torch.nn.Module, ds: CheapImages, mode: str,
                batch: int) -> tuple[Any, dict[str, Any]]:
    """``store.compute`` once under ``mode``; returns the version and its figures."""
    from featstore import ComputeOptions

    opts = ComputeOptions(autocast=None if mode == "float32" else mode, progress=False,
                          dataset_id=f"gpu-check-cheap-images-{len(ds)}-{ds.pool.shape[-1]}")
    with UtilSampler() as util:
        t0 = time.perf_counter()
        v = store.compute(f"gpu-check/{mode}", model=model, dataset=ds, input_key=None,
                          outputs={"features": "float16", "logits": "float32"}, batch_size=batch,
                          client=client, options=opts)
        wall = time.perf_counter() - t0
    t = v.manifest.timings
    fig = {"compute_s": t["compute_s"], "setup_s": t["setup_s"], "wall_s": round(wall, 2),
           "samples_per_s": round(len(ds) / t["compute_s"], 1), "utilisation": util.summary(),
           "version": v.id}
    return v, fig


def run_lm(store: Any, client: Any, device: torch.device, sequences: int, tiny: bool, seconds: float) -> dict[str, Any]:
    """The per-token row: a toy causal LM (32,000-token vocabulary, 512 wide) over token
    sequences of 64-512 tokens, stored ``topk:64`` per real token (the codec runs on the GPU,
    before the copy to the host), against the same LM's pure inference over the same batches."""
    from featstore import ComputeOptions, Tokens
    from featstore.ragged import attention_mask
    from featstore.ragged import pad_sequences as pad

    from .tokens import Profile, Sequences, ToyLM

    prof = Profile(sequences=sequences, vocab=1000 if tiny else 32000, dim=16 if tiny else 512,
                   min_len=8 if tiny else 64, max_len=32 if tiny else 512, batch_size=8 if tiny else 32)
    data, model = Sequences(prof), ToyLM(prof)
    tokens = sum(len(s) for s in data.items)
    net = ToyLM(prof).to(device).eval()
    batches = [pad([data[i]["input"] for i in range(b, min(b + prof.batch_size, len(data)))])
               for b in range(0, len(data), prof.batch_size)]
    on_device = [{k: v.to(device) for k, v in x.items()} for x in batches]
    with torch.inference_mode():
        net(on_device[0])
        _sync(device)
        t0, done = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds or done == 0:
            for x in on_device:
                net(x)
            done += tokens
        _sync(device)
        pure = done / (time.perf_counter() - t0)
    del net, on_device
    with UtilSampler() as util:
        v = store.compute("gpu-check/lm", model=model, dataset=data, outputs={"logits": "topk:64"},
                          batch_size=prof.batch_size, client=client,
                          options=ComputeOptions(collate=pad, progress=False, dataset_id=f"gpu-check-lm-{sequences}"),
                          tokens=Tokens(mask=attention_mask, max_tokens=prof.max_len))
    got = v[0:2]
    x = pad([data[i]["input"] for i in range(2)])
    with torch.inference_mode():
        ref = torch.log_softmax(model(x)[x["attention_mask"]].float(), -1).topk(64)
    agree = float((got["logits.ids"][:, 0] == ref.indices[:, 0]).float().mean())
    err = float((got["logits.values"].float() - ref.values).abs().max())
    compute_s = v.manifest.timings["compute_s"]
    return {"sequences": sequences, "tokens": tokens, "vocab": prof.vocab, "dim": prof.dim,
            "compute_tokens_per_s": round(tokens / compute_s, 1), "pure_tokens_per_s": round(pure, 1),
            "ratio": round(tokens / compute_s / pure, 3), "utilisation": util.summary(),
            "top1_agreement_vs_cpu": agree, "max_logprob_error_vs_cpu": err,
            "ok": agree >= 0.99 and err < 0.05}


@dataclass(frozen=True)
class Args:
    n: int
    batch: int
    size: int
    ref_rows: int
    seconds: float
    out: str | None
    modes: tuple[str, ...]
    allow_cpu: bool
    tiny: bool
    lm_sequences: int = 0


def parse(argv: list[str] | None) -> Args:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=256 * 128, help="samples per compute (default 32768)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224, help="image side in pixels")
    p.add_argument("--ref-rows", type=int, default=16, help="samples checked against the CPU reference")
    p.add_argument("--seconds", type=float, default=8.0, help="timed seconds per pure-inference figure")
    p.add_argument("--out", default="docs", help="folder of benchmarks.md and gpu_check.json; '-' writes nothing")
    p.add_argument("--modes", default="float32,float16", help="autocast modes: float32 (none), float16, bfloat16")
    p.add_argument("--allow-cpu", action="store_true", help="run on the CPU where CUDA is absent (tests only)")
    p.add_argument("--tiny", action="store_true", help="a ResNet of one block per stage at 1/8 width (tests only)")
    p.add_argument("--lm-sequences", type=int, default=512,
                   help="token sequences of the per-token LM row (topk:64 over a 32,000 vocabulary); 0 skips it")
    a = p.parse_args(argv)
    modes = tuple(m.strip() for m in a.modes.split(",") if m.strip())
    bad = [m for m in modes if m not in TOLERANCE]
    if bad:
        p.error(f"unknown modes {bad}; choose from {sorted(TOLERANCE)}")
    return Args(a.n, a.batch, a.size, a.ref_rows, a.seconds, None if a.out == "-" else a.out, modes,
                a.allow_cpu, a.tiny, a.lm_sequences)


def environment(device: torch.device) -> dict[str, Any]:
    import featstore

    env = {"date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "host": platform.node(),
           "python": platform.python_version(), "torch": torch.__version__, "featstore": featstore.__version__,
           "cpu_count": os.cpu_count(), "device": str(device)}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(), gpu_count=torch.cuda.device_count(),
                   tf32_conv=torch.backends.cudnn.allow_tf32)
    else:
        env.update(gpu=None, cpu=platform.processor() or platform.machine())
    return env


def measure(args: Args, device: torch.device) -> dict[str, Any]:
    """Every figure of the check, as one JSON-able dict."""
    from featstore import open_store
    from featstore.compute import connect
    from featstore.compute import worker_devices

    res: dict[str, Any] = {"env": environment(device), "n": args.n, "batch": args.batch, "size": args.size,
                           "model": "tiny ResNet (tests only)" if args.tiny else "ResNet-50 shape",
                           "modes": list(args.modes), "compute": {}, "pure": {}, "pure_from_host": {},
                           "reference": {}}
    build = tiny_resnet if args.tiny else resnet50
    model = build()
    ds = CheapImages(args.n, args.size)
    res["input_pipeline"] = input_pipeline(ds, args.batch, min(8, max(1, args.n // args.batch)),
                                           pin=device.type == "cuda")
    ref = cpu_reference(model, ds, min(args.ref_rows, args.n))
    net = build().to(device)
    for mode in args.modes:
        res["pure"][mode] = pure_inference(net, device, args.batch, args.size, mode, args.seconds, False)
        res["pure_from_host"][mode] = pure_inference(net, device, args.batch, args.size, mode,
                                                     args.seconds / 2, True)
    del net
    if device.type == "cuda":
        torch.cuda.empty_cache()
    root = tempfile.mkdtemp(prefix="featstore-gpu-check-")
    cluster = connect(None)  # the embedded default: one worker process per GPU
    try:
        res["workers"] = worker_devices(cluster.client)  # name, device, why, CUDA_VISIBLE_DEVICES
        store = open_store(os.path.join(root, "store"))
        for mode in args.modes:
            v, res["compute"][mode] = run_compute(store, cluster.client, model, ds, mode, args.batch)
            stored = v[0:len(next(iter(ref.values())))]
            res["reference"][mode] = compare(stored, ref, TOLERANCE[mode])
        if args.lm_sequences:
            res["lm"] = run_lm(store, cluster.client, device, args.lm_sequences, args.tiny, args.seconds / 2)
    finally:
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)
    # Pure inference ran on one GPU; the compute on every worker's GPU: compare per GPU.
    res["gpus_used"] = max(1, sum(w["device"].startswith("cuda") for w in res["workers"].values()))
    res["ratios"] = {m: round(res["compute"][m]["samples_per_s"] / res["gpus_used"]
                              / res["pure"][m]["samples_per_s"], 3) for m in args.modes}
    return res


# ---------------------------------------------------------------------------------------------
# The report.
# ---------------------------------------------------------------------------------------------
def _util_text(u: dict[str, Any]) -> str:
    gpus = [k for k in u if k.startswith("gpu")]
    if not gpus:
        return "n/a"
    return "; ".join(f"{k}: mean {u[k]['mean']:.0f}%, median {u[k]['median']:.0f}%, p10 {u[k]['p10']:.0f}%"
                     for k in gpus)


def markdown(res: dict[str, Any]) -> str:
    """The "GPU check" section of docs/benchmarks.md, between its marker lines."""
    e = res["env"]
    dev = (f"{e['gpu']} ({e['gpu_memory_gib']} GiB, CUDA {e['cuda']}, cuDNN {e['cudnn']}, "
           f"TF32 convolutions {'on' if e['tf32_conv'] else 'off'})" if e.get("gpu") else f"CPU ({e['cpu']})")
    lines = [MARK_START, "## GPU check", "",
             f"Generated by `python -m benchmarks.gpu_check` on {e['date']}: {dev}, {e['cpu_count']} CPU cores, "
             f"Python {e['python']}, torch {e['torch']}, featstore {e['featstore']}.",
             "",
             f"Model A: {_model_text(res)} (`benchmarks/resnet.py`, random weights), "
             f"batch {res['batch']}, {res['size']}x{res['size']} uint8 images from a pool in host memory, "
             f"N={res['n']:,} per compute; features stored float16, logits float32; embedded cluster "
             f"(workers: {_workers_text(res.get('workers', {}))}).",
             "",
             "| autocast | compute samples/s | pure inference samples/s (input on GPU / from pinned host) "
             "| compute / pure (per GPU) | GPU utilisation during compute "
             "| max rel. L2 error vs CPU fp32 (tolerance) |",
             "|---|---|---|---|---|---|"]
    for m in res["modes"]:
        c, ref = res["compute"][m], res["reference"][m]
        worst = max(v["rel_l2"] for k, v in ref.items() if isinstance(v, dict))
        lines.append(f"| {'none (fp32)' if m == 'float32' else m} | {c['samples_per_s']:,.0f} "
                     f"| {res['pure'][m]['samples_per_s']:,.0f} / {res['pure_from_host'][m]['samples_per_s']:,.0f} "
                     f"| **{res['ratios'][m]:.2f}** | {_util_text(c['utilisation'])} "
                     f"| {worst:.1e} ({ref['tolerance']:.0e}) {'ok' if ref['ok'] else '**FAILED**'} |")
    if "lm" in res:
        lm = res["lm"]
        lines += ["", f"Per-token outputs: a toy causal LM (vocabulary {lm['vocab']:,}, width {lm['dim']}) over "
                  f"{lm['sequences']} sequences ({lm['tokens']:,} real tokens), stored `topk:64` per token (the codec "
                  f"on the GPU): compute {lm['compute_tokens_per_s']:,.0f} tokens/s vs pure inference "
                  f"{lm['pure_tokens_per_s']:,.0f} tokens/s (**{lm['ratio']:.2f}**), GPU utilisation "
                  f"{_util_text(lm['utilisation'])}; top-1 agreement with the CPU reference "
                  f"{lm['top1_agreement_vs_cpu']:.1%}, max log-prob error {lm['max_logprob_error_vs_cpu']:.3f} "
                  f"{'ok' if lm['ok'] else '**FAILED**'}."]
    lines += ["", *_verdict(res), "", "Raw figures: `docs/gpu_check.json`.", MARK_END]
    return "\n".join(lines) + "\n"


def _model_text(res: dict[str, Any]) -> str:
    return ("a ResNet-50-shaped network (25.6 M parameters, 4.1 GFLOP per 224x224 image)"
            if res["model"] == "ResNet-50 shape" else res["model"])


def _workers_text(workers: dict[str, Any]) -> str:
    return ", ".join(f"{w['name']} -> {w['device']} (CUDA_VISIBLE_DEVICES={w['CUDA_VISIBLE_DEVICES']})"
                     for w in workers.values()) or "n/a"


def _verdict(res: dict[str, Any]) -> list[str]:
    out = []
    if "float16" in res["ratios"]:
        r = res["ratios"]["float16"]
        out.append(f"Target: compute >= {TARGET:.2f}x pure inference at fp16 autocast: "
                   f"{'met' if r >= TARGET else 'missed'} ({r:.2f}).")
    ip = res["input_pipeline"]["samples_per_s"]
    slowest = min(res["pure_from_host"][m]["samples_per_s"] for m in res["modes"])
    out.append(f"Input pipeline alone (fetch, collate, pin; one thread): {ip:,.0f} samples/s"
               + (", below the GPU's rate: it bounds the compute." if ip < slowest else "."))
    out.append("Compute samples/s = N / the manifest's `compute_s` (the shard tasks, after the probe and "
               "the cluster start-up, which are in `setup_s`).")
    return out


def write(res: dict[str, Any], out_dir: str) -> None:
    """docs/gpu_check.json, and the marked section of docs/benchmarks.md (appended if absent)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
        f.write("\n")
    path = os.path.join(out_dir, "benchmarks.md")
    old = open(path).read() if os.path.exists(path) else "# featstore benchmarks\n"
    with open(path, "w") as f:
        f.write(replace_section(old, markdown(res)))


def gpu_section(path: str) -> str | None:
    """The marked GPU-check section of the file at ``path``, if it has one (``python -m
    benchmarks`` rewrites docs/benchmarks.md and keeps this section as it was)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        m = _SECTION.search(f.read())
    return m.group(0) if m else None


def replace_section(text: str, section: str) -> str:
    """``text`` with its marked GPU-check section replaced by ``section`` (appended if absent)."""
    if _SECTION.search(text):
        return _SECTION.sub(lambda _: section, text, count=1)
    return text.rstrip("\n") + "\n\n" + section


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    elif args.allow_cpu:
        device = torch.device("cpu")
    else:
        print("gpu_check: skipped: CUDA is not available on this machine (torch "
              f"{torch.__version__}, built for CUDA {torch.version.cuda}); run it where a GPU is. "
              "Nothing was written.", file=sys.stderr)
        return 0
    t0 = time.perf_counter()
    res = measure(args, device)
    res["total_s"] = round(time.perf_counter() - t0, 1)
    print(markdown(res))
    if args.out:
        write(res, args.out)
        print(f"gpu_check: wrote {args.out}/gpu_check.json and the GPU check section of "
              f"{args.out}/benchmarks.md in {res['total_s']} s", file=sys.stderr)
    failed = [m for m in args.modes if not res["reference"][m]["ok"]] + (
        ["lm"] if "lm" in res and not res["lm"]["ok"] else [])
    if failed:
        print(f"gpu_check: outputs outside tolerance for {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
