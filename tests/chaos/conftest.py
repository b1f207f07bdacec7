"""Separate processes for the chaos tests: ``specsplit serve ...`` children that a test may kill -9."""

import os
import signal
import subprocess
import sys

import pytest


class Services:
    """Starts ``python -m specsplit.cli serve SERVICE ...`` children; stops whatever is left at the end."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def spawn(self, service: str, *args: str) -> subprocess.Popen:
        env = dict(os.environ, HF_HUB_OFFLINE="1", SPECSPLIT_THREADS="1")
        proc = subprocess.Popen([sys.executable, "-m", "specsplit.cli", "serve", service, "--listen", "127.0.0.1:0",
                                 *args], stderr=subprocess.PIPE, text=True, env=env)
        self.procs.append(proc)
        return proc

    @staticmethod
    def address(proc: subprocess.Popen) -> str:
        """Wait for the child's "serving on ADDR" line."""
        line = proc.stderr.readline()
        assert "serving on" in line, line + proc.stderr.read()
        # Keep draining stderr so a chatty child never blocks on a full pipe.
        import threading

        threading.Thread(target=proc.stderr.read, daemon=True).start()
        return line.rsplit(" ", 1)[1].strip()

    def start(self, service: str, *args: str) -> tuple[subprocess.Popen, str]:
        proc = self.spawn(service, *args)
        return proc, self.address(proc)

    @staticmethod
    def kill9(proc: subprocess.Popen) -> None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait(timeout=10)


@pytest.fixture
def services():
    s = Services()
    yield s
    s.close()
