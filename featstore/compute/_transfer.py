"""Host<->device copies that overlap Model A's forward on CUDA, and cost nothing on the CPU.

On CUDA a shard task copies batch ``i``'s outputs device->host on a side stream, into pinned
(page-locked) buffers with ``non_blocking=True``, and records an event; the write thread waits
for that event before it checks and encodes the batch, while the task thread already runs the
forward of batch ``i+1`` on the compute stream. The input batch goes host->device from pinned
memory, so its copy is asynchronous too. On the CPU every function here returns its argument
unchanged: no copy, no pinning, no stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


def pin(x: object) -> object:
    """``x`` (a tensor, or a dict/list/tuple of them) with its CPU tensors in pinned memory, so
    that their copy to a GPU is asynchronous. Needs CUDA; call it only for a CUDA device.

    The shard task calls it on its fetch thread, so the pinning copy overlaps the forward."""
    if isinstance(x, torch.Tensor):
        return x.pin_memory() if x.device.type == "cpu" and not x.is_pinned() else x
    if isinstance(x, Mapping):
        return {k: pin(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(pin(v) for v in x)
    return x


def to_device(x: object, device: torch.device) -> object:
    """``x`` (a tensor, or on CUDA also a dict/list/tuple of them) on ``device``.

    On CUDA the copies are ``non_blocking`` (asynchronous from pinned memory, see :func:`pin`).
    On the CPU a tensor goes through ``.to(device)`` (no copy when it is there already) and
    anything else is passed as it is, exactly as before there was a GPU path.

    >>> t = torch.ones(2)
    >>> to_device(t, torch.device("cpu")) is t
    True
    """
    if device.type != "cuda":
        return x.to(device) if isinstance(x, torch.Tensor) else x
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, Mapping):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    return x


@dataclass(frozen=True)
class HostBatch:
    """One batch's values on the host; call :meth:`wait` before reading them."""

    values: dict[str, torch.Tensor]
    ready: torch.cuda.Event | None = None  # recorded after the copies (None: nothing pending)

    def wait(self) -> dict[str, torch.Tensor]:
        """The values, once every pending device->host copy has landed."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.values


class Offloader:
    """Device->host copies of one task's outputs, on a side stream of the task's device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def to_host(self, values: Mapping[str, torch.Tensor]) -> HostBatch:
        """Start copying ``values`` to pinned host buffers; returns at once on CUDA.

        On the CPU (or for tensors already on the host) the values are passed through as they are.
        """
        if self.stream is None or not any(t.device.type == "cuda" for t in values.values()):
            return HostBatch(dict(values))
        # The outputs are produced on the compute stream: the copies start after them.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        out = {}
        # inference_mode: A's outputs are inference tensors, and record_stream counts as an
        # in-place op on them, which is refused outside inference mode.
        with torch.inference_mode(), torch.cuda.stream(self.stream):
            for name, t in values.items():
                if t.device.type != "cuda":
                    out[name] = t
                    continue
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                # The allocator must not hand t's memory to the next forward before the copy ran.
                t.record_stream(self.stream)
                out[name] = buf
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return HostBatch(out, ready)
