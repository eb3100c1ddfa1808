"""Conditional creates on S3 that mean the same on every server, and the check that they work.

featstore's commit rests on one primitive: write an object only if it does not exist yet
(``PUT`` with ``If-None-Match: *``). Servers agree on the status, not on the body: a 412 reply
means "exists" whatever XML comes with it. s3fs turns a 412 into ``FileExistsError`` only when
the body names ``<Condition>If-None-Match</Condition>`` (AWS, moto) and into ``OSError(EINVAL)``
otherwise (SeaweedFS, and others), so :func:`put_if_absent` reads the status of the botocore
error s3fs chains as the cause. A 409 ``ConditionalRequestConflict`` (AWS: a concurrent write to
the same key was in flight) is retried: the next attempt gets a 200 or a 412. Every conditional
create goes through s3fs: obstore (:mod:`featstore.storage._s3_reads`) only reads.

A server that ignores the header (a gateway that drops it, an S3 clone that never implemented it)
would let two writers both "create" a key, and two computes of one version both commit. So the
first create of a process on a store runs :func:`check_honoured` once: it creates a probe key
(a ``.partial`` object under ``_featstore/`` that ``gc`` removes if a kill leaves it), creates it
again, expects "exists", and deletes it. If the second create overwrote the first, the store is
refused with :class:`ConditionalWritesUnsupported` before anything of a version is written.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from typing import TYPE_CHECKING

from featstore.errors import ConditionalWritesUnsupported

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

#: Under the store root: what featstore keeps for itself (no feature-set name starts with '_').
PROBE_FOLDER = "_featstore"
#: Attempts of a conditional PUT that meets 409 ConditionalRequestConflict (a concurrent write).
CONFLICT_ATTEMPTS = 5

#: ``(pid, endpoint, bucket)`` of every store whose server this process found honouring
#: conditional creates (a forked child probes again: its entry would carry another pid). No lock:
#: two threads that race here both probe (with their own keys), and a fork while one thread held
#: a lock would deadlock the child.
_HONOURED: set[tuple[int, str, str]] = set()


def status_of(exc: BaseException) -> tuple[int | None, str]:
    """The HTTP status and S3 error code of the botocore error behind ``exc`` (s3fs chains it
    as ``__cause__``), or ``(None, "")`` when there is none."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return (status if isinstance(status, int) else None), str(response.get("Error", {}).get("Code", ""))
        cur = cur.__cause__ or cur.__context__
    return None, ""


def put_if_absent(fs: AbstractFileSystem, path: str, data: bytes) -> bool:
    """PUT ``data`` at ``path`` with ``If-None-Match: *``; False when the object exists (a 412,
    whatever its body). Other errors propagate for the caller's error mapping."""
    for attempt in range(CONFLICT_ATTEMPTS):
        try:
            fs.pipe_file(path, data, mode="create")
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            status, code = status_of(exc)
            if status == 412 or code == "PreconditionFailed":
                return False
            if (status != 409 and code != "ConditionalRequestConflict") or attempt == CONFLICT_ATTEMPTS - 1:
                raise
            time.sleep(0.05 * 2 ** attempt)
    raise AssertionError("unreachable")


def store_identity(fs: AbstractFileSystem, root: str) -> tuple[str, str]:
    """``(endpoint, bucket)``: what the probe's answer is remembered by."""
    endpoint = getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
    return str(endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "aws"), \
        root.split("/", 1)[0]


def check_honoured(fs: AbstractFileSystem, root: str, url: str) -> None:
    """Once per process and store: raise :class:`ConditionalWritesUnsupported` unless a second
    conditional create of a fresh key is refused as "exists" (see the module docstring)."""
    endpoint, bucket = store_identity(fs, root)
    key = (os.getpid(), endpoint, bucket)
    if key in _HONOURED:
        return
    probe = f"{root}/{PROBE_FOLDER}/conditional-create-{uuid.uuid4().hex}.partial"
    try:
        put_if_absent(fs, probe, b"first")
        honoured = not put_if_absent(fs, probe, b"second")
    finally:
        with contextlib.suppress(Exception):  # noqa: BLE001 - a store that refuses deletes: gc removes it later
            fs.rm(probe)
    if not honoured:
        raise ConditionalWritesUnsupported(
            f"the S3 server behind {url} (endpoint {endpoint}) ignores conditional creates: a PUT with "
            "'If-None-Match: *' overwrote an object that existed (featstore's probe). featstore commits a "
            "version by creating objects only if absent; on this server two computes of one version could "
            "both commit and leave it unreadable, so nothing was written. Use a server that honours "
            "If-None-Match on PUT (AWS S3 and SeaweedFS do; see docs/s3.md, section 'S3-compatible "
            "servers'), check that no proxy or gateway between here and the server drops that header, "
            "or compute into a local store.")
    _HONOURED.add(key)
