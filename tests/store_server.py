"""A real S3-compatible server for the object-storage tests: moto's standalone server (``moto[server]``) in a
subprocess on a free localhost port, spoken to over HTTP through s3fs/aiobotocore exactly as a user's S3
(``AWS_ENDPOINT_URL``, dummy credentials from the environment), and a TCP proxy in front of it that can
answer 503 SlowDown, reset connections or stop answering (the faults of a real store)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(port: int, log) -> subprocess.Popen:
    """moto's server on ``port``, ready to answer (or an AssertionError with its output); its request log goes
    to file ``log`` (a pipe nobody reads would fill and stop the server)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
            return proc
        except OSError:
            assert proc.poll() is None, open(log).read()[-2000:]
            assert time.monotonic() - t0 < 60, "moto server did not start in 60 s"
            time.sleep(0.1)


def s3_env(endpoint: str, cache: str) -> dict:
    """The environment of a process that uses the store: endpoint, dummy credentials, a 10 s retry budget (the
    store's own timeouts stay at their 10 s default: this machine may be loaded)."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "DENSETRAIN_STORE_CACHE": cache,
            "DENSETRAIN_STORE_RETRY_S": "10"}


_SLOWDOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n"
             b"Connection: close\r\n\r\n%s")
_BODY = b"<?xml version='1.0'?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"


class FaultProxy:
    """A TCP proxy on a free port in front of ``target_port``. ``mode``: 'pass' forwards; '503' answers every
    request with 503 SlowDown; 'reset' closes each connection with a TCP reset; 'stall' accepts and never
    answers; 'cut' answers a GET with 200 and a Content-Length of 1 MiB, sends :attr:`cut_bytes` of body and closes
    (a body cut off mid-transfer). ``faulty(mode, seconds)`` switches to a fault for that long, then back to 'pass'."""

    def __init__(self, target_port: int):
        self.target, self.mode, self.until = target_port, "pass", 0.0
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.faults = 0  # connections answered with a fault
        self.queue: list[str] = []
        self.only = b""
        self.cut_bytes = 404  # the body bytes a 'cut' answer sends: a count that reads like a status
        threading.Thread(target=self._serve, daemon=True).start()

    def faulty(self, mode: str, seconds: float, only: bytes = b"") -> None:
        """``mode`` for ``seconds``; ``only``: just for requests whose first bytes are these (b"PUT": uploads)."""
        self.mode, self.until, self.only = mode, time.monotonic() + seconds, only

    def fail_next(self, modes: list[str]) -> None:
        """Answer the next connections with these faults, one each ('503', 'reset'), then pass again."""
        self.queue = list(modes)

    def _current(self) -> str:
        if self.queue:
            return self.queue.pop(0)
        if self.mode != "pass" and time.monotonic() >= self.until:
            self.mode = "pass"
        return self.mode

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            up = socket.create_connection(("127.0.0.1", self.target))
        except OSError:
            conn.close()
            return
        threading.Thread(target=self._pipe, args=(up, conn), daemon=True).start()
        self._requests(conn, up)

    def _requests(self, conn: socket.socket, up: socket.socket) -> None:
        """Client to server, chunk by chunk: the mode is looked at before each chunk, so that a fault also hits
        the client's pooled keep-alive connections, not only new ones."""
        try:
            while data := conn.recv(65536):
                mode = self._current()
                if mode == "pass" or (self.only and not data.startswith(self.only)):
                    up.sendall(data)
                    continue
                self.faults += 1
                if mode == "503":  # a HEAD's answer has no body
                    conn.sendall(_SLOWDOWN % (len(_BODY), b"" if data.startswith(b"HEAD") else _BODY))
                elif mode == "cut":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: "
                                 b"%d\r\n\r\n%s" % (1 << 20, b"\0" * self.cut_bytes))
                elif mode == "reset":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                else:  # stall: answer nothing until the mode changes
                    while self._current() == "stall":
                        time.sleep(0.05)
                break
        except OSError:
            pass
        for s in (conn, up):
            try:
                s.close()
            except OSError:
                pass

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def make_bucket(name: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(name)


def environ_set(env: dict) -> dict:
    """Set ``env`` in os.environ; returns the previous values (None: unset) for :func:`environ_restore`."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    return old


def environ_restore(old: dict) -> None:
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def prepare_to(url: str, prepared, tmp) -> str:
    """conftest's ``prepared`` stdlib sources prepared again, straight to ``url`` (an object store's folder);
    returns ``url``."""
    from densetrain.data.prepare import prepare

    _, make = prepared
    cfg = make(tmp)
    cfg.data.shards_dir = url
    prepare(cfg)
    return url
