"""CUDA-only checks of the GPU path (run where a GPU is: `pytest -m gpu tests/compute/test_gpu.py`).

Each test is skipped, with the reason, where CUDA is absent. What is decided without a GPU (the
worker -> device rules, the cluster plan, the CPU fallback of the copies) is in
tests/compute/test_devices.py and tests/compute/test_transfer.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from featstore import ComputeOptions
from featstore.compute._devices import WorkerView, plan_cluster, task_device, visible_gpu_ids
from featstore.compute._transfer import Offloader, pin, to_device

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False here): pinned and "
                              "side-stream copies, per-GPU workers and GPU compute are not checked on this machine"),
]

#: Relative tolerance against a float32 CPU reference (TF32 convolutions and fp16 keep 10 bits).
TOL = {None: 1e-2, "float16": 1e-2, "bfloat16": 3e-2}


class SmallConv(torch.nn.Module):
    """A small CNN on 3x32x32 images: features (after pooling) and logits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
                                        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.ReLU(),
                                        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x):
        f = self.body(x)
        return {"features": f, "logits": self.head(f)}


class Images(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        self.y = torch.arange(n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"input": self.x[i], "target": self.y[i]}


def _dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def test_offloader_copies_into_pinned_host_buffers():
    dev = _dev()
    logits = torch.randn(256, 1000, device=dev)
    feats = torch.randn(256, 2048, device=dev).half()
    target = torch.arange(256)
    batch = Offloader(dev).to_host({"logits": logits, "features": feats, "target": target})
    got = batch.wait()
    assert got["logits"].device.type == "cpu" and got["logits"].is_pinned() and got["features"].is_pinned()
    assert torch.equal(got["logits"], logits.cpu()) and torch.equal(got["features"], feats.cpu())
    assert got["features"].dtype == torch.float16 and got["target"] is target


def test_offloaded_copy_survives_the_next_forward_reusing_the_memory():
    """The output's memory is freed right after the copy is queued; the next batch's kernels on
    the compute stream must not overwrite it before the side stream has read it.

    First the hazard is shown to be real here: a freed block of this size is handed straight to
    the next allocation of the same size (the same address). Then, through the Offloader, the
    next allocation gets another block while the copy is pending (``record_stream``), and every
    copy holds its batch's values."""
    dev = _dev()
    t = torch.full((4096, 1024), 0.0, device=dev)
    freed = t.data_ptr()
    del t
    again = torch.full((4096, 1024), -1.0, device=dev)
    assert again.data_ptr() == freed  # without protection, the next forward would write over it
    del again
    off = Offloader(dev)
    pending, reused = [], []
    for i in range(8):
        t = torch.full((4096, 1024), float(i), device=dev)
        torch.cuda._sleep(1_000_000)  # keep the compute stream busy so the copies lag behind
        pending.append((i, off.to_host({"x": t})))
        ptr = t.data_ptr()
        del t
        junk = torch.full((4096, 1024), -1.0, device=dev)  # would land in t's block, unprotected
        reused.append(junk.data_ptr() == ptr)
        del junk
    for i, batch in pending:
        x = batch.wait()["x"]
        assert float(x.min()) == float(x.max()) == float(i)
    assert not any(reused), reused  # the pending copy kept its block from the next allocation


def test_pinned_input_goes_to_the_device():
    dev = _dev()
    x = pin({"a": torch.randn(8, 3), "b": [torch.arange(4)]})
    assert x["a"].is_pinned() and x["b"][0].is_pinned()
    y = to_device(x, dev)
    torch.cuda.synchronize()
    assert y["a"].device == dev and torch.equal(y["a"].cpu(), x["a"]) and torch.equal(y["b"][0].cpu(), x["b"][0])


def test_task_device_pins_the_thread_to_its_gpu():
    n = torch.cuda.device_count()
    last = n - 1
    with task_device(WorkerView(name=f"gpu-{last}", resources={"GPU": 1}, visible=n)) as dev:
        assert dev == torch.device("cuda", last)
        assert torch.cuda.current_device() == last


@pytest.fixture(scope="module")
def gpu_cluster():
    """The embedded default on this machine: one worker process per GPU."""
    from featstore.compute._cluster import connect

    cluster = connect(None)
    yield cluster
    cluster.close()


def _worker_side(dask_worker) -> dict:
    from featstore.compute._devices import describe

    return {**describe(dask_worker), "uuid": str(torch.cuda.get_device_properties(0).uuid)}


def _machine_gpus() -> list[str]:
    """The uuid of every GPU this process sees."""
    return sorted(str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count()))


def test_embedded_cluster_gives_each_gpu_exactly_one_worker(gpu_cluster):
    """The workers' GPUs (by uuid, as each worker sees its cuda:0) are exactly the machine's GPUs,
    one worker each. With one GPU this shows only that its one worker uses it; that several
    workers get distinct GPUs is shown where there are several."""
    seen = list(gpu_cluster.client.run(_worker_side).values())
    assert all(w["device"] == "cuda:0" for w in seen)
    assert sorted(w["uuid"] for w in seen) == _machine_gpus()


@pytest.mark.parametrize("autocast", [None, "float16", "bfloat16"])
def test_compute_on_gpu_matches_a_cpu_reference(local_store, gpu_cluster, autocast):
    model, data = SmallConv(), Images(640)
    v = local_store.compute("gpu/small", model=model, dataset=data, keep=["target"], batch_size=128,
                            outputs={"features": "float32", "logits": "float32"}, client=gpu_cluster.client,
                            options=ComputeOptions(progress=False, autocast=autocast))
    assert v.manifest.fingerprint_parts["autocast"] == autocast
    got = v[0:len(data)]
    with torch.inference_mode():
        want = model(data.x)
    assert torch.equal(got["target"], data.y)
    for name in ("features", "logits"):
        err = float((got[name].double() - want[name].double()).norm() / want[name].double().norm())
        assert err <= TOL[autocast], (name, autocast, err)


def test_dask_cuda_cluster_when_installed():
    pytest.importorskip("dask_cuda", reason="dask-cuda is not installed, so featstore's LocalCUDACluster path "
                        "(plan kind 'dask-cuda', featstore.compute._cluster.start) is not checked: "
                        "pip install featstore[gpu]")
    from featstore.compute._cluster import start

    ids = visible_gpu_ids(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
    cluster = start(plan_cluster(ids, None, None, dask_cuda=True))
    try:
        seen = list(cluster.client.run(_worker_side).values())
        assert len(seen) == len(ids) and all(w["device"] == "cuda:0" for w in seen)
        assert sorted(w["uuid"] for w in seen) == _machine_gpus()  # one worker per GPU, each its own
    finally:
        cluster.close()
