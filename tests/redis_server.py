"""A private redis-server on a free port, for tests (CI makes sure the binary exists)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest


def required() -> bool:
    return bool(os.environ.get("SPECSPLIT_REQUIRE_SLOW") or os.environ.get("CI"))


def binary() -> str:
    """redis-server's path; fails (CI) or skips (a developer machine without it) when it is missing."""
    path = shutil.which("redis-server")
    if path is None:
        message = "redis-server is not installed (apt-get install redis-server; ./install.sh does it)"
        if required():
            pytest.fail(message + ": required when SPECSPLIT_REQUIRE_SLOW or CI is set")
        pytest.skip(message)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``redis-server --port N``; with ``data_dir`` and ``appendonly`` it persists (AOF) across restarts."""

    def __init__(self, data_dir: str | None = None, appendonly: bool = False, port: int | None = None):
        self.binary = binary()
        self.port = port or free_port()
        self.data_dir = data_dir
        self.appendonly = appendonly
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "yes" if self.appendonly else "no", "--daemonize", "no"]
        if self.data_dir:
            args += ["--dir", self.data_dir]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None
