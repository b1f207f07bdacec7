"""The small pieces behind failover: replica choice, restore planning, idle sweeps, per-round seeds."""

import time

import pytest

from orchestrator.placement import RestorePlanner
from orchestrator.replicas import ReplicaSet
from specsplit.errors import Unavailable
from specsplit.sampling import round_seed
from specsplit.sweep import IdleSweeper


class FakeVerifier:
    def __init__(self, address, up=True):
        self.address, self.up = address, up

    def healthy(self, timeout):
        return self.up

    def close(self):
        pass


def test_pick_prefers_healthy_then_least_loaded_and_skips_excluded():
    a, b, c = FakeVerifier("a"), FakeVerifier("b"), FakeVerifier("c", up=False)
    replicas = ReplicaSet([a, b, c], health_interval_s=0)
    replicas.check()
    assert [r.healthy for r in replicas] == [True, True, False]
    first = replicas.pick()
    replicas.placed(first, +1)
    assert replicas.pick().address != first.address  # the other healthy one has fewer sessions
    assert replicas.pick(exclude={"a", "b"}).address == "c"  # down, but the only one left: tried last
    with pytest.raises(Unavailable, match="no verifier replica is reachable"):
        replicas.pick(exclude={"a", "b", "c"})
    replicas.mark_down(replicas.by_address("a"), "test")
    assert replicas.pick().address == "b"
    a.up = False
    c.up = True
    replicas.check()  # health checks bring replicas back and take them out
    assert [r.healthy for r in replicas] == [False, True, True]


def test_close_waits_for_a_health_check_in_flight_before_closing_the_channels():
    """A health check still running when the orchestrator closes ends before its replica's channel is closed, and
    none runs after: a check on a closed channel, or past the interpreter's exit, can crash the process."""
    import threading

    events = []

    class SlowVerifier(FakeVerifier):
        def healthy(self, timeout):
            events.append("check")
            checking.set()
            time.sleep(0.2)
            events.append("checked")
            return True

        def close(self):
            events.append("closed")

    checking = threading.Event()
    replicas = ReplicaSet([SlowVerifier("a")], health_interval_s=0.01, health_timeout_s=1.0)
    assert checking.wait(5)
    replicas.close()
    assert events[-2:] == ["checked", "closed"]
    time.sleep(0.1)
    assert events[-1] == "closed"  # no check after the close


class HangingVerifier(FakeVerifier):
    """Fails its health checks; counts how often its calls in flight were cut short."""

    def __init__(self, address):
        super().__init__(address, up=False)
        self.cuts = 0

    def cut_calls(self):
        self.cuts += 1
        return 1


def test_calls_to_a_replica_failing_its_checks_are_cut_only_when_they_can_move():
    """After cut_after failed checks in a row a replica's calls in flight are cut short once (their sessions move), but
    not while no other replica passes its checks: the only replica, too busy to answer its checks, would otherwise fail
    every session it holds (seen under a load average of 20: UNAVAILABLE 'no verifier replica is reachable')."""
    alone = HangingVerifier("a")
    replicas = ReplicaSet([alone], health_interval_s=0, cut_after=3)
    for _ in range(5):
        replicas.check()
    assert alone.cuts == 0
    hung, other = HangingVerifier("h"), FakeVerifier("o", up=False)
    replicas = ReplicaSet([hung, other], health_interval_s=0, cut_after=3)
    for _ in range(4):
        replicas.check()
    assert hung.cuts == 0  # the other one is down too: nowhere to move
    other.up = True
    for _ in range(3):
        replicas.check()
    assert hung.cuts == 1  # now they can move: cut once, not at every check
    hung.up = True
    replicas.check()
    hung.up = False
    for _ in range(3):
        replicas.check()
    assert hung.cuts == 2  # passed a check, then failed three again


def test_pick_with_reserve_spreads_sessions_that_arrive_together():
    replicas = ReplicaSet([FakeVerifier("a"), FakeVerifier("b")], health_interval_s=0)
    picked = [replicas.pick(reserve=True).address for _ in range(6)]  # none has loaded yet
    assert sorted(picked) == ["a"] * 3 + ["b"] * 3
    assert [r.sessions for r in replicas] == [3, 3]
    replicas.placed(replicas.by_address("a"), -1)  # one load failed: its reservation is undone
    assert replicas.pick().address == "a"


def test_restore_planner_measures_then_picks_the_faster():
    planner = RestorePlanner(min_tokens=32)
    assert planner.prefer_import()  # untried: try it, so it gets measured
    planner.observe("prefill", 1000, 500.0)
    planner.observe("import", 1000, 80.0)
    assert planner.prefer_import()
    for _ in range(10):
        planner.observe("import", 1000, 900.0)  # import got slow (a far-away store)
    assert not planner.prefer_import()
    planner.observe("prefill", 4, 1000.0)  # short restores are all overhead: not evidence
    assert planner.prefill_ms_per_token == 0.5
    assert planner.counts == {"prefill": 2, "import": 11}


def test_restore_planner_tells_when_a_prefill_will_be_done_in_the_verifier():
    planner = RestorePlanner(min_tokens=32)
    assert planner.expected_prefill_ms(8) == 0.0  # short: about as soon as it arrives
    assert planner.expected_prefill_ms(100) is None  # long and nothing measured: cannot tell
    planner.observe("prefill", 200, 700.0, verifier_ms=400.0)  # the call paid the network too
    assert planner.expected_prefill_ms(100) == 200.0 and planner.prefill_ms_per_token == 3.5
    planner.observe("import", 200, 100.0, verifier_ms=50.0)  # an import is no prefill
    assert planner.verifier_prefill_ms_per_token == 2.0


def test_idle_sweeper_releases_only_idle_sessions():
    released = []
    sweeper = IdleSweeper(released.append, idle_s=0.2, interval_s=3600)  # sweep by hand
    sweeper.touch("old")
    time.sleep(0.25)
    sweeper.touch("fresh")
    sweeper.touch("gone")
    sweeper.forget("gone")
    assert sweeper.sweep() == ["old"] and released == ["old"]
    assert sweeper.sweep() == []
    sweeper.close()


def test_an_idle_sweep_during_shutdown_logs_no_traceback(caplog):
    """A sweep after its verifier engine closed (its Release is UNAVAILABLE: shutting down) says so in one line; it
    printed a traceback per session at the end of a CI run."""
    from specsplit.errors import Unavailable

    def shut_down(session_id):
        raise Unavailable("the verifier is shutting down")

    sweeper = IdleSweeper(shut_down, idle_s=0.01, interval_s=3600)
    sweeper.touch("a")
    time.sleep(0.02)
    with caplog.at_level("INFO", logger="specsplit.sweep"):
        assert sweeper.sweep() == ["a"]
    assert not [r for r in caplog.records if r.levelname == "ERROR" or r.exc_info]
    assert "idle session a not released: the verifier is shutting down" in caplog.text
    sweeper.close()


def test_round_seeds_depend_on_seed_and_position_only():
    assert round_seed(7, 100) == round_seed(7, 100)
    seeds = {round_seed(s, n) for s in range(20) for n in range(50)}
    assert len(seeds) == 1000  # no collisions between nearby seeds and positions
    assert all(0 <= x < 2**63 for x in seeds)
    assert not seeds & {round_seed(s, n, stream=1) for s in range(20) for n in range(50)}  # the draft's own
