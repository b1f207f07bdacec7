"""The network benchmark's two hosts: network namespaces joined by a veth pair (``make_namespaces``), and the
processes started in them (``Hosts``), or on this host's loopback where namespaces are unavailable."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
EDGE_NS, CLOUD_NS = "ss-edge", "ss-cloud"
EDGE_IP, CLOUD_IP = "10.77.0.1", "10.77.0.2"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def make_namespaces() -> bool:
    """Two namespaces and a veth pair; False (after cleaning up) where that is not possible."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    delete_namespaces()
    try:
        sh("ip", "netns", "add", EDGE_NS)
        sh("ip", "netns", "add", CLOUD_NS)
        sh("ip", "link", "add", "ss-veth-e", "type", "veth", "peer", "name", "ss-veth-c")
        sh("ip", "link", "set", "ss-veth-e", "netns", EDGE_NS)
        sh("ip", "link", "set", "ss-veth-c", "netns", CLOUD_NS)
        for ns, dev, ip in ((EDGE_NS, "ss-veth-e", EDGE_IP), (CLOUD_NS, "ss-veth-c", CLOUD_IP)):
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        probe = (f"import socket\ntry: socket.create_connection(('{CLOUD_IP}', 9), timeout=3)\n"
                 "except ConnectionRefusedError: pass")  # refused = the cloud host answered
        sh("ip", "netns", "exec", EDGE_NS, sys.executable, "-c", probe)
        return True
    except (subprocess.CalledProcessError, FileNotFoundError) as err:
        print(f"network namespaces unavailable ({err}); falling back to loopback", file=sys.stderr)
        delete_namespaces()
        return False


def delete_namespaces() -> None:
    for ns in (EDGE_NS, CLOUD_NS):
        sh("ip", "netns", "del", ns, check=False)  # deleting a namespace deletes its veth end (and the pair)


class Hosts:
    """Where each process runs: a namespace (ip netns exec) or, in the fallback, this host's loopback."""

    def __init__(self, netns: bool, cpus: dict[str, str], logdir: pathlib.Path):
        """cpus: namespace -> taskset CPU list of its processes ('' = no pinning)."""
        self.netns, self.cpus, self.logdir = netns, cpus, logdir
        self.edge_ip, self.cloud_ip = (EDGE_IP, CLOUD_IP) if netns else ("127.0.0.1", "127.0.0.1")
        self.procs: list[subprocess.Popen] = []

    def prefix(self, ns: str) -> list[str]:
        cpus = self.cpus.get(ns, "")
        pin = ["taskset", "-c", cpus] if cpus and shutil.which("taskset") else []
        return (["ip", "netns", "exec", ns] if self.netns else []) + pin

    def start(self, ns: str, name: str, args: list[str], ready: str, timeout_s: float = 180.0,
              env: dict | None = None) -> subprocess.Popen:
        """env: variables set for this process beside this script's."""
        log = open(self.logdir / f"{name}.log", "w")
        proc = subprocess.Popen(self.prefix(ns) + args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, **(env or {})})
        self.procs.append(proc)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            text = (self.logdir / f"{name}.log").read_text()
            if ready in text:
                return proc
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {text[-2000:]}")
            time.sleep(0.2)
        raise RuntimeError(f"{name} not ready after {timeout_s:.0f} s")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
