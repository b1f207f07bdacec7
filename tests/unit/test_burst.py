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


def test_a_drafted_round_ends_in_a_burst_only_where_a_target_token_is_cheaper_than_its_tokens():
    sizer = measured(50, 20)  # across a network: bursts of 16
    assert sizer.steps_after_tree(0.0, 100) == 0  # no drafted round measured yet
    sizer.observe_drafted(round_ms=80, decoded=0)  # draft + round trip + queue + forward: 80 ms a round
    assert sizer.steps_after_tree(0.1, 100) == 15  # 20 ms * 1.1 < 80 ms: the burst after the tree
    assert sizer.steps_after_tree(3.0, 100) == 0  # 20 ms * 4 = 80 ms: the draft pays as much as a burst
    assert sizer.steps_after_tree(0.1, 5) == 4  # never past the tokens left
    assert measured(50, 20, fixed=True).steps_after_tree(0.0, 100) == 0  # one token a round, whatever it costs
    assert measured(2, 50).steps_after_tree(0.0, 100) == 0  # next to the verifier a burst is one token: none after
    # a round with its burst: the decoded tokens' steps are taken out of the round's time
    sizer = measured(50, 20, ema=1.0)
    sizer.observe_drafted(round_ms=80 + 15 * 20, decoded=15)
    assert sizer.drafted_ms == 80


def test_a_drafted_rounds_burst_measures_the_step():
    sizer = BurstSizer(ema=1.0)
    sizer.observe(call_ms=130, verify_ms=100, committed=6, plain=False, decoded=4)  # tree + 4 steps: 5 ticks
    assert (sizer.outside_ms, sizer.step_ms) == (30, 20)


def test_the_verifiers_work_not_its_idling_measures_a_step():
    """A batching verifier's verify_ms holds its idling (ticks waiting for other sessions' round trips): a round's
    cost, which a longer burst pays once. With busy_ms (the model working meanwhile) the idling counts as outside."""
    sizer = BurstSizer(ema=1.0)
    sizer.observe(call_ms=100, verify_ms=95, committed=4, plain=True, busy_ms=48)  # 4 ticks of 12 ms, 47 ms idle
    assert (sizer.outside_ms, sizer.step_ms) == (52, 12)
    assert sizer.tokens(100) == 16  # ceil(52 * 0.95 / (0.05 * 12)) = 83, capped; by verify_ms alone it would be 1
    old = BurstSizer(ema=1.0)
    old.observe(call_ms=100, verify_ms=95, committed=4, plain=True)  # an older verifier says no busy_ms
    assert (old.outside_ms, old.step_ms, old.tokens(100)) == (5, 95 / 4, 4)
