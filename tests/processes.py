"""The `specsplit` command in child processes, for tests: one-shot commands and services."""

import os
import signal
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


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (reads /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # (an exited child its new parent has not reaped)
    except FileNotFoundError:
        return False


def signal_while_a_draft_starts(sig: int, draft_args: list[str]) -> tuple[subprocess.Popen, int]:
    """A process that starts a ``launch.DraftProcess`` (``specsplit serve draft DRAFT_ARGS``) and gets ``sig`` 0.2 s
    later, while its child still starts (importing torch takes longer); (that process, its draft child's pid)."""
    script = ("import os, subprocess, sys, threading; from specsplit.launch import DraftProcess\n"
              "popen = subprocess.Popen\n"
              "def started(*args, **kwargs):\n"
              "    proc = popen(*args, **kwargs); print(proc.pid, flush=True)\n"
              f"    threading.Timer(0.2, os.kill, (os.getpid(), {int(sig)})).start()\n"
              "    return proc\n"
              "subprocess.Popen = started\n"
              f"DraftProcess({draft_args!r})")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return parent, int(parent.stdout.readline())
