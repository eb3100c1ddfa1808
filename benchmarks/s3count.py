"""A loopback proxy in front of an S3 server that counts what the server sends back, so that
bytes downloaded are counted the same way for every client (featstore, LitData, Mosaic).

    python -m benchmarks.s3count http://127.0.0.1:PORT   # prints its own endpoint, serves until killed

It runs in a process of its own (its forwarding costs no client's CPU time or GIL) and forwards
each request as it came (signatures stay valid: the Host header is kept). ``GET /__counts__``
answers the totals so far as JSON: object GETs and their body bytes, listings, HEADs, and the
bytes of every reply body; a client reads it before and after an epoch and takes the difference.
"""

from __future__ import annotations

import json
import socketserver
import subprocess
import sys
import threading
import urllib.request
from collections import Counter

COUNTS_PATH = "/__counts__"


def serve(upstream: str) -> None:
    """Serve on a free loopback port in front of ``upstream``; prints ``http://127.0.0.1:PORT``."""
    # The fault proxy's request forwarding (read the body, forward to the server, send the reply)
    # is reused as is: this proxy only adds counting and the /__counts__ path. Imported here so
    # that :func:`counts` needs no featstore (the peers' environment has none).
    from featstore.testing._fault_proxy import FaultProxy, _Handler, classify

    tally: Counter = Counter()
    lock = threading.Lock()

    class Handler(_Handler):
        owner = FaultProxy(upstream)

        def _handle(self) -> None:
            if self.path == COUNTS_PATH:
                with lock:
                    data = json.dumps(dict(tally)).encode()
                self._send(200, [("Content-Type", "application/json")], data)
                return
            status, headers, data = self._forward(self._body())
            op = classify(self.command, self.path.split("?", 1)[0], "")
            with lock:
                tally[f"{op.lower()}s"] += 1
                tally["reply_bytes"] += len(data)
                if op == "GET" and status in (200, 206):
                    tally["get_bytes"] += len(data)
            self._send(status, headers, data)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

    server = Server(("127.0.0.1", 0), Handler)
    print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever(poll_interval=0.05)


def start(upstream: str) -> tuple[subprocess.Popen, str]:
    """The proxy in its own process (stop it with ``proc.kill()``) and its endpoint."""
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.s3count", upstream], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline().strip() if proc.stdout else ""
    if not line.startswith("http"):
        proc.kill()
        raise RuntimeError("the counting proxy did not start")
    return proc, line


def counts(endpoint: str) -> dict[str, int]:
    """The proxy's totals so far (``get_bytes``: body bytes of object GETs)."""
    with urllib.request.urlopen(endpoint + COUNTS_PATH, timeout=30) as r:
        return json.loads(r.read())


if __name__ == "__main__":
    serve(sys.argv[1])
