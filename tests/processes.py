"""The `specsplit` command in child processes, for tests: one-shot commands and services."""

import os
import subprocess
import sys
import threading


def cli(*args, timeout=120, **env_vars) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", SPECSPLIT_THREADS="1", **env_vars)
    return subprocess.run([sys.executable, "-m", "specsplit.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def serve(*args, **env_vars) -> tuple[subprocess.Popen, str]:
    """``specsplit serve ARGS`` on a free loopback port; (process, address) once it serves."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", SPECSPLIT_THREADS="1", **env_vars)
    proc = subprocess.Popen([sys.executable, "-m", "specsplit.cli", "serve", *args, "--listen", "127.0.0.1:0"],
                            stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stderr.readline()
    assert "serving on" in line, line + proc.stderr.read()
    proc.log = [line]  # its stderr, read to the end (a chatty child never blocks on a full pipe)
    proc.log_reader = threading.Thread(target=lambda: proc.log.extend(proc.stderr), daemon=True)
    proc.log_reader.start()
    return proc, line.rsplit(" ", 1)[1].strip()
