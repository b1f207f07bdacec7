"""How busy each host's service process was while a configuration ran: CPU time from /proc.

In bench/network.py the edge and the cloud each have one core (the draft shares the edge's with the orchestrator and
the benchmark's driver, the verifier the cloud's with the delaying relays), so a service process's CPU time over a
generation's wall time says which side bounds the pipeline: a draft near 100% busy is the bottleneck (a bigger or
smaller tree then only changes how its tokens are cut into verifications, not how fast they come), a verifier near
100% the other way round. (The share is the process's, a lower bound on its core's.)
"""

from __future__ import annotations

import os

TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")


def cpu_ms(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` (all its threads) so far, ms; None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after the command name (which may hold spaces)
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) * TICK_MS  # utime, stime (fields 14 and 15 of proc(5))


def read(pids: dict[str, int]) -> dict[str, float]:
    """{name: CPU ms} of each readable process."""
    return {name: ms for name, ms in ((n, cpu_ms(p)) for n, p in pids.items()) if ms is not None}


def used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in after if name in before}


def busy(runs: list[dict]) -> dict[str, float]:
    """{name: share of the wall time of the runs that timed its process, spent on a CPU} ({} without ``cpu_ms``)."""
    cpu: dict[str, float] = {}
    wall: dict[str, float] = {}
    for run in runs:
        for name, ms in (run.get("cpu_ms") or {}).items():
            cpu[name] = cpu.get(name, 0.0) + ms
            wall[name] = wall.get(name, 0.0) + run["seconds"] * 1e3
    return {name: cpu[name] / wall[name] for name in cpu if wall[name] > 0}
