"""bench/procstat.py: a service process's CPU time from /proc, and how busy it was over runs."""

import pathlib
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import procstat  # noqa: E402

# A child that names itself with spaces and parentheses (what /proc/PID/stat shows in its second field), then spins.
SPIN = """
import ctypes, sys, time
ctypes.CDLL(None).prctl(15, b"a) b (c", 0, 0, 0)  # PR_SET_NAME
print("named", flush=True)
end = time.process_time() + float(sys.argv[1])
while time.process_time() < end:
    pass
time.sleep(30)
"""


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="needs /proc")
def test_cpu_time_of_a_process_whose_name_holds_spaces_and_parentheses():
    child = subprocess.Popen([sys.executable, "-c", SPIN, "0.4"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "named"
        assert pathlib.Path(f"/proc/{child.pid}/comm").read_text().strip() == "a) b (c"
        deadline = time.monotonic() + 20
        while (procstat.cpu_ms(child.pid) or 0) < 400 and time.monotonic() < deadline:
            time.sleep(0.05)
        spent = procstat.cpu_ms(child.pid)
        assert 400 <= spent < 5000, spent  # its spin, not a field beside utime/stime
    finally:
        child.kill()
        child.wait()
    assert procstat.cpu_ms(child.pid) is None  # gone: nothing to read
    assert procstat.read({"gone": child.pid}) == {}


def test_busy_is_cpu_time_over_the_runs_wall_time():
    runs = [{"seconds": 2.0, "cpu_ms": {"draft": 1800.0, "verifier": 500.0}},
            {"seconds": 1.0, "cpu_ms": {"draft": 900.0, "verifier": 700.0}},
            {"seconds": 5.0}]  # a run without CPU times (an older result) counts for neither
    assert procstat.busy(runs) == pytest.approx({"draft": 0.9, "verifier": 0.4})
    assert procstat.busy([{"seconds": 1.0}]) == {}
    # each process over the runs that timed it (the n-gram row times its own draft service)
    two = [{"seconds": 1.0, "cpu_ms": {"draft": 500.0, "verifier": 100.0}}, {"seconds": 3.0, "cpu_ms": {"verifier": 300.0}}]
    assert procstat.busy(two) == pytest.approx({"draft": 0.5, "verifier": 0.1})
    assert procstat.used({"draft": 10.0, "verifier": 5.0}, {"draft": 30.0}) == {"draft": 20.0}
