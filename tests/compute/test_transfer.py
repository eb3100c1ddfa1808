"""The GPU copy path's CPU fallback: no copy, no pinning, the same tensors; and autocast, which
changes A's outputs, stays part of the fingerprint. (The CUDA side is in tests/compute/test_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from featstore import ComputeOptions
from featstore.compute._transfer import HostBatch, Offloader, to_device

from tests.models import TinyA, VectorData

CPU = torch.device("cpu")


def test_to_device_on_cpu_passes_everything_through():
    t = torch.arange(6.0).reshape(2, 3)
    assert to_device(t, CPU) is t
    d = {"a": t, "b": [t, t]}
    assert to_device(d, CPU) is d  # containers too: the model gets exactly what it got before
    assert to_device(None, CPU) is None


def test_offloader_on_cpu_returns_the_same_tensors_without_waiting():
    values = {"features": torch.randn(4, 8), "target": torch.arange(4)}
    off = Offloader(CPU)
    assert off.stream is None
    batch = off.to_host(values)
    assert isinstance(batch, HostBatch) and batch.ready is None
    got = batch.wait()
    assert got.keys() == values.keys()
    assert all(got[k] is values[k] for k in values)  # no copy on the CPU path


def test_host_batch_waits_for_its_event():
    class Event:
        waited = False

        def synchronize(self):
            Event.waited = True

    t = torch.ones(1)
    assert HostBatch({"x": t}, Event()).wait()["x"] is t and Event.waited


@pytest.mark.parametrize("mode", ["bfloat16"])
def test_autocast_changes_the_version_and_matches_an_autocast_forward(local_store, dask_client, mode):
    data, model = VectorData(96), TinyA()
    kw = dict(model=model, dataset=data, keep=["target"], client=dask_client, batch_size=32,
              outputs={"features": "float32", "logits": "float32"})
    plain = local_store.compute("ac/set", options=ComputeOptions(progress=False), **kw)
    cast = local_store.compute("ac/set", options=ComputeOptions(progress=False, autocast=mode), **kw)
    assert cast.id != plain.id
    assert cast.manifest.fingerprint_parts["autocast"] == mode
    assert plain.manifest.fingerprint_parts["autocast"] is None
    with torch.inference_mode(), torch.autocast("cpu", dtype=getattr(torch, mode)):
        want = model(data.x)
    got = cast[0:len(data)]
    for name in ("features", "logits"):
        # Another process computed these: compare within bf16's resolution, not bit for bit.
        torch.testing.assert_close(got[name], want[name].float(), rtol=2e-2, atol=2e-2)
    assert not torch.equal(got["logits"], plain[0:len(data)]["logits"])  # autocast did change A's outputs
