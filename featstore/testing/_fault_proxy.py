"""A loopback HTTP proxy in front of a real S3 server (moto or SeaweedFS) that injects faults.

A real server cannot fail on purpose, so tests point ``endpoint_url`` at this proxy instead. It
runs in the test process but listens on TCP, so every process that talks to "S3" (the driver,
Dask workers, DataLoader workers) goes through it and meets the same faults.

Faults, chosen per request by :class:`Rule`:

- ``"503"``: ``503 SlowDown`` (S3's throttling reply), nothing forwarded.
- ``"500"``: ``500 InternalError``, nothing forwarded.
- ``"reset"``: the request is read, then the connection is reset (TCP RST), nothing forwarded.
- ``"timeout"``: the request is read, then nothing is sent for ``stall`` seconds (longer than
  the client's read timeout), then the connection is dropped; nothing forwarded. A stall the
  client waits out is counted in ``waited_out``: a client whose read timeout works has given up
  before (the proxy then stops waiting when it sees the hang-up, counted in ``abandoned``), so a
  test proves the timeout by what the proxy counts, not by a clock.
- ``"lost_reply"``: the request IS forwarded and applied by the server, then the connection is
  reset before the reply reaches the client (the icechunk#2099 case for conditional writes).
- ``"ignore_condition"``: the request is forwarded without its ``If-None-Match`` header (and
  re-signed, for a server that checks signatures), as a server that ignores conditional creates
  would treat it: a second create of a key overwrites it. Not a failure: no retry follows.

A "request" is identified by (method, path, query, Range): its first ``times`` attempts fail,
the next ones pass, so a client that retries sees a few consecutive failures and then success.
``times=None`` fails it forever (a persistent outage).
"""

from __future__ import annotations

import collections
import http.client
import os
import random
import re
import select
import socket
import socketserver
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from http.server import BaseHTTPRequestHandler

_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
        "upgrade", "expect", "content-length"}
_ERRORS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "SlowDown", "Please reduce your request rate."),
}
KINDS = ("503", "500", "reset", "timeout", "lost_reply", "ignore_condition")
#: The kinds after which the client sees a failure (and retries).
FAILURES = frozenset(KINDS) - {"ignore_condition"}
#: What ``ignore_condition`` removes from a request.
CONDITION_HEADERS = frozenset({"if-none-match"})


def classify(method: str, path: str, query: str) -> str:
    """``PUT``, ``GET`` (an object), ``LIST`` (a bucket listing), ``HEAD``, ``DELETE``, ``POST``."""
    if method == "GET":
        parts = path.strip("/").split("/", 1)
        if len(parts) == 1 or parts[1] == "":
            return "LIST"
    return method


@dataclass
class Rule:
    """Fail requests of ``ops`` whose path (and query) matches ``path`` with fault ``kind``.

    ``kind`` is one fault or a tuple of them, dealt out in turn to the faulted requests. ``rate``
    is the share of distinct requests that are faulted at all (the first ``first`` always are);
    each faulted request fails its first k attempts, k drawn from ``min_times``..``times``, or
    forever when ``times`` is None.
    """

    kind: str | tuple[str, ...]
    ops: tuple[str, ...] = ("PUT", "GET", "LIST", "HEAD")
    path: str = ""
    times: int | None = 2
    min_times: int = 1
    rate: float = 1.0
    first: int = 0
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)
    _left: dict[tuple[object, ...], list[Any]] = field(init=False, repr=False, default_factory=dict)
    _dealt: int = field(init=False, repr=False, default=0)

    def __post_init__(self) -> None:
        self.kinds = (self.kind,) if isinstance(self.kind, str) else tuple(self.kind)
        assert set(self.kinds) <= set(KINDS), self.kinds
        self._rng = random.Random(self.seed)

    def take(self, op: str, ident: tuple[object, ...]) -> str | None:
        """The fault for this attempt of request ``ident``, or None (called under the proxy lock)."""
        if op not in self.ops or (self.path and not re.search(self.path, f"{ident[1]}?{ident[2]}")):
            return None
        if ident not in self._left:
            hit = len(self._left) < self.first or self._rng.random() < self.rate
            n = 0
            if hit:
                n = -1 if self.times is None else self._rng.randint(min(self.min_times, self.times), self.times)
            self._left[ident] = [n, self.kinds[self._dealt % len(self.kinds)]]
            self._dealt += bool(hit)
        left = self._left[ident]
        if left[0] == 0:
            return None
        left[0] -= left[0] > 0
        return str(left[1])


class FaultProxy:
    """Start with ``FaultProxy(moto_url).start()``; ``.url`` is the endpoint to give clients."""

    def __init__(self, upstream: str, stall: float = 3.0) -> None:
        u = urllib.parse.urlsplit(upstream)
        if u.hostname is None:
            raise ValueError(f"upstream {upstream!r} is not a URL with a host (http://host:port)")
        self.upstream: tuple[str, int | None] = (u.hostname, u.port)
        self.stall = stall
        self.rules: list[Rule] = []
        self.lock = threading.Lock()
        self.requests: collections.Counter[str] = collections.Counter()  # by op
        self.faults: collections.Counter[tuple[str, str]] = collections.Counter()  # by (kind, op)
        self.attempts: collections.Counter[tuple[object, ...]] = collections.Counter()  # by request identity
        self.forwarded: collections.Counter[str] = collections.Counter()  # by op, reached the server
        # by (op, path, client): who sent it
        self.clients: collections.Counter[tuple[str, str, str]] = collections.Counter()
        #: stalled attempts, by request identity: the client hung up before the stall ended (its
        #: read timeout), or the stall ran its full length (the client waited it out)
        self.abandoned: collections.Counter[tuple[object, ...]] = collections.Counter()
        self.waited_out: collections.Counter[tuple[object, ...]] = collections.Counter()
        self.retries = 0  # attempts that repeat a request whose previous attempt was faulted
        self._faulted: set[tuple[object, ...]] = set()
        self._owner: dict[tuple[object, ...], Rule] = {}  # request identity -> the one rule that faults it
        self._stop = threading.Event()
        self._server: socketserver.ThreadingTCPServer | None = None

    # -- control ------------------------------------------------------------------------
    def start(self) -> "FaultProxy":
        proxy = self

        class Handler(_Handler):
            owner = proxy

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

            def handle_error(self, request: object, client_address: object) -> None:  # resets are the point: be quiet
                pass

        self._server = Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()
        return self

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def set_rules(self, *rules: Rule) -> None:
        with self.lock:
            self.rules = list(rules)
            self._owner.clear()

    def reset_counts(self) -> None:
        with self.lock:
            for c in (self.requests, self.faults, self.attempts, self.forwarded, self.clients, self.abandoned,
                      self.waited_out):
                c.clear()
            self.retries = 0
            self._faulted.clear()
            self._owner.clear()

    @property
    def n_faults(self) -> int:
        return sum(self.faults.values())

    @property
    def retries_seen(self) -> int:
        """Attempts that repeated a request right after a fault on it (the client's retries)."""
        return self.retries

    def fault_for(self, op: str, ident: tuple[object, ...]) -> str | None:
        with self.lock:
            self.requests[op] += 1
            self.attempts[ident] += 1
            if ident in self._faulted:
                self.retries += 1
                self._faulted.discard(ident)
            # One rule per request: rules never stack their failures on one request, so the
            # consecutive failures of a request stay within the rule's ``times``.
            owner = self._owner.get(ident)
            for rule in (owner,) if owner is not None else self.rules:
                kind = rule.take(op, ident)
                if kind is not None:
                    self._owner[ident] = rule
                    self.faults[(kind, op)] += 1
                    if kind in FAILURES:
                        self._faulted.add(ident)
                    return kind
        return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: FaultProxy

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _reset(self) -> None:
        """Drop the connection with a TCP RST (SO_LINGER 0), never a clean reply."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass

    def _client_hangs_up(self, within: float) -> bool:
        """Send nothing for up to ``within`` seconds; True as soon as the client closes the
        connection (it gave up on the reply), False when the stall ran out (or the proxy stops)."""
        end = time.monotonic() + within
        while not self.owner._stop.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return False
            readable, _, _ = select.select([self.connection], [], [], min(left, 0.05))
            if not readable:
                continue
            try:
                if self.connection.recv(1, socket.MSG_PEEK) == b"":
                    return True  # an orderly close
            except OSError:
                return True  # reset by the client
            self.owner._stop.wait(min(left, 0.05))  # bytes waiting (not a hang-up): do not spin on them
        return False

    def _forward(self, body: bytes, drop: frozenset[str] = frozenset()) -> tuple[int, list[tuple[str, str]], bytes]:
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in _HOP]
        if drop & {k.lower() for k, _ in headers}:
            headers = resigned([(k, v) for k, v in headers if k.lower() not in drop], self.command, self.path)
        conn = http.client.HTTPConnection(*self.owner.upstream, timeout=60)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in headers:
                conn.putheader(k, v)
            if body or self.command in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            resp = conn.getresponse()
            data = resp.read()
            headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP]
            if self.command == "HEAD" and (length := resp.getheader("Content-Length")):
                headers.append(("Content-Length", length))
            return resp.status, headers, data
        finally:
            conn.close()

    def _send(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
        self.send_response_only(status)
        for k, v in headers:
            self.send_header(k, v)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.wfile.flush()

    def _handle(self) -> None:
        body = self._body()
        u = urllib.parse.urlsplit(self.path)
        op = classify(self.command, u.path, u.query)
        query = "&".join(sorted(q for q in u.query.split("&") if not q.startswith("X-Amz-")))
        ident = (self.command, u.path, query, self.headers.get("Range", ""))
        with self.owner.lock:
            self.owner.clients[(op, u.path, client_of(self.headers.get("User-Agent", "")))] += 1
        kind = self.owner.fault_for(op, ident)
        if kind in _ERRORS:
            status, code, msg = _ERRORS[kind]
            xml = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                   f"<Message>{msg}</Message><RequestId>fault</RequestId></Error>").encode()
            self._send(status, [("Content-Type", "application/xml")], xml)
            return
        if kind == "reset":
            self._reset()
            return
        if kind == "timeout":
            hung_up = self._client_hangs_up(self.owner.stall)
            with self.owner.lock:
                (self.owner.abandoned if hung_up else self.owner.waited_out)[ident] += 1
            self._reset()
            return
        status, headers, data = self._forward(body, CONDITION_HEADERS if kind == "ignore_condition" else frozenset())
        with self.owner.lock:
            self.owner.forwarded[op] += 1
        if kind == "lost_reply":
            self._reset()
            return
        self._send(status, headers, data)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle


def resigned(headers: list[tuple[str, str]], method: str, path: str) -> list[tuple[str, str]]:
    """``headers`` signed again (SigV4, the environment's test credentials) after some were
    removed: a server that checks signatures (SeaweedFS) would refuse the client's signature,
    which covers every header it sent. The payload hash the client sent is kept."""
    from botocore.auth import S3SigV4Auth, SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    class KeepPayloadHash(S3SigV4Auth):
        _modify_request_before_signing = SigV4Auth._modify_request_before_signing

    auth = next((v for k, v in headers if k.lower() == "authorization"), None)
    if auth is None:
        return headers  # an unsigned request stays unsigned
    scope = re.search(r"Credential=([^/,]+)/\d{8}/([^/]+)/", auth)
    assert scope and scope.group(1) == os.environ["AWS_ACCESS_KEY_ID"], "signed with other credentials"
    kept = {k: v for k, v in headers if k.lower() not in ("authorization", "x-amz-date")}
    host = next(v for k, v in kept.items() if k.lower() == "host")
    request = AWSRequest(method=method, url=f"http://{host}{path}", headers=kept)
    creds = Credentials(scope.group(1), os.environ["AWS_SECRET_ACCESS_KEY"])
    KeepPayloadHash(creds, "s3", scope.group(2)).add_auth(request)
    return list(request.headers.items())


def client_of(user_agent: str) -> str:
    """``"obstore"`` (the Rust object_store client), ``"botocore"`` (s3fs, boto3) or the agent."""
    if "object_store" in user_agent or "obstore" in user_agent:
        return "obstore"
    return "botocore" if "botocore" in user_agent.lower() else user_agent


def wait_until(cond: Callable[[], object], timeout: float = 30.0, step: float = 0.05) -> bool:
    """Poll ``cond`` until true or ``timeout`` seconds passed (a hang guard, not a timing test)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return bool(cond())
