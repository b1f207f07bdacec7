"""How busy each host's service process was while a configuration ran: CPU time from /proc.

Draft and verifier each have their own core in bench/network.py, so a process's CPU time over a generation's wall
time says which side bounds the pipeline: a draft near 100% busy is the bottleneck (a bigger or smaller tree then
only moves which tokens it drafts, not how fast), a verifier near 100% the other way round.
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
    """{name: share of the runs' wall time its process spent on a CPU} over runs with ``cpu_ms`` ({} without)."""
    total: dict[str, float] = {}
    wall_ms = 0.0
    for run in runs:
        if run.get("cpu_ms"):
            wall_ms += run["seconds"] * 1e3
            for name, ms in run["cpu_ms"].items():
                total[name] = total.get(name, 0.0) + ms
    return {name: ms / wall_ms for name, ms in total.items()} if wall_ms > 0 else {}
