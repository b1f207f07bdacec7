"""Decode-burst sizing: one token a request next to the verifier, longer bursts as the round trip grows."""

from orchestrator.burst import BurstSizer


def measured(outside_ms: float, step_ms: float, **kw) -> BurstSizer:
    sizer = BurstSizer(**kw)
    for _ in range(20):
        sizer.observe(call_ms=outside_ms + 16 * step_ms, verify_ms=16 * step_ms, committed=16, plain=True)
    return sizer


def test_unmeasured_sessions_ask_for_one_token():
    assert BurstSizer().tokens(100) == 1


def test_burst_grows_with_the_round_trip_until_its_cap():
    assert measured(2, 50).tokens(100) == 1  # next to the verifier
    assert measured(50, 50, overhead=0.1).tokens(100) == 9  # 50 / (50 + 9 * 50) = 10%
    assert measured(50, 80).tokens(100) == 12  # 5% (the default): 50 / (50 + 12 * 80) < 5%
    assert measured(100, 50).tokens(100) == 16  # capped
    assert measured(100, 50, max_tokens=4).tokens(100) == 4
    assert measured(50, 50, overhead=0.25).tokens(100) == 3


def test_burst_never_passes_the_tokens_left_and_fixed_is_one():
    assert measured(100, 50).tokens(3) == 3
    assert measured(100, 50, fixed=True).tokens(100) == 1


def test_drafted_rounds_keep_the_round_trip_fresh_and_stand_in_for_a_step():
    sizer = BurstSizer()
    sizer.observe(call_ms=160, verify_ms=100, committed=4, plain=False)  # a tree: 100 ms, 60 ms outside
    assert (sizer.outside_ms, sizer.step_ms) == (60, 100)
    assert sizer.tokens(100) == 12  # ceil(60 * 0.95 / 5)
    sizer.observe(call_ms=110, verify_ms=100, committed=2, plain=True)  # a burst: 50 ms a token
    assert sizer.step_ms == 100 * 0.7 + 50 * 0.3
    sizer.observe(call_ms=200, verify_ms=100, committed=3, plain=False)  # drafted rounds no longer set the step
    assert sizer.step_ms == 100 * 0.7 + 50 * 0.3
