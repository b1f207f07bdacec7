"""α rules of the verification trigger: EdgeLLM's baseline and the goodput controller."""

import math

import pytest

from orchestrator.pipeline_size import Stretches

from orchestrator.trigger import (FINISH_NODES, EdgeLLMThreshold, FixedSize, GoodputThreshold, RoundOutcome, fit_gamma,
                                  leaves_stub, make_trigger, tree_confidence)


def balance_point_only(trigger: GoodputThreshold) -> GoodputThreshold:
    """Pipelined trees of the balance point's size alone (the tests of pipeline_nodes; Stretches has its own)."""
    trigger.stretches = Stretches(choices=(1.0,))
    return trigger


def outcome(n_all, n_ok, committed=None, round_ms=100.0, steps=4, draft_ms=40.0, confidences=None):
    conf = tuple(0.8 ** (i + 1) for i in range(n_all)) if confidences is None else tuple(confidences)
    return RoundOutcome(n_all, n_ok, conf, n_ok + 1 if committed is None else committed, round_ms, steps, draft_ms)


def test_edgellm_all_correct_halves_alpha():
    t = EdgeLLMThreshold()
    assert t.alpha == 0.01
    t.observe(outcome(5, 5))
    assert t.alpha == pytest.approx(0.005)
    t.observe(outcome(3, 3))
    assert t.alpha == pytest.approx(0.0025)


def test_edgellm_errors_set_alpha_to_wrong_fraction():
    t = EdgeLLMThreshold()
    t.observe(outcome(8, 6))
    assert t.alpha == pytest.approx(0.25)
    t.observe(outcome(4, 0))
    assert t.alpha == pytest.approx(1.0)
    t.observe(outcome(0, 0))  # nothing drafted: no evidence
    assert t.alpha == pytest.approx(1.0)


def test_trigger_fires_below_alpha():
    t = EdgeLLMThreshold(alpha=0.2)
    assert not t.should_verify(0.3, 5)
    assert t.should_verify(0.1, 5)
    assert FixedSize(8).should_verify(1.0, 8) and not FixedSize(8).should_verify(0.0, 7)


def test_tree_confidence_is_max_over_live_branches():
    conf = [0.9, 0.4, 0.81, 0.2]
    assert tree_confidence(conf, [2, 3]) == 0.81
    assert tree_confidence(conf, []) == 1.0


def test_goodput_alpha_is_rate_times_step_to_the_inverse_gamma():
    t = GoodputThreshold(ema=1.0)
    conf = [0.5, 0.25, 0.125, 0.0625]
    t.observe(outcome(4, 2, committed=3, round_ms=150.0, steps=4, draft_ms=40.0, confidences=conf))
    assert sum(c ** t.gamma for c in conf) == pytest.approx(2.0, rel=1e-6)
    assert t.alpha == pytest.approx((3 / 150.0 * 10.0) ** (1 / t.gamma))


def test_fit_gamma():
    assert fit_gamma([0.5, 0.25], 2, (0.02, 8.0)) == 0.02  # all accepted: better than any γ in range predicts
    assert fit_gamma([0.5, 0.25], 0, (0.02, 8.0)) == 8.0
    assert fit_gamma([0.5, 0.25], 0.75, (0.02, 8.0)) == pytest.approx(1.0, abs=1e-6)


def test_goodput_drafts_deeper_on_a_slower_network():
    fast, slow = GoodputThreshold(), GoodputThreshold()
    for _ in range(10):
        fast.observe(outcome(6, 4, round_ms=120.0))
        slow.observe(outcome(6, 4, round_ms=320.0))  # same tokens, 200 ms more round trip
    assert slow.alpha < fast.alpha  # lower α: T must fall further before verifying


def test_goodput_trusts_a_draft_that_beats_its_confidence():
    good, bad = GoodputThreshold(), GoodputThreshold()
    for _ in range(10):
        good.observe(outcome(6, 6))
        bad.observe(outcome(6, 1))
    assert good.gamma < 1 < bad.gamma and good.alpha < bad.alpha


def test_goodput_gamma_is_averaged_geometrically():
    """A draft far better than its probabilities (all accepted: γ at its floor) keeps a small γ after one rejected
    round; an arithmetic mean would jump to ~2.4 and price its next trees as a weak draft's."""
    t = GoodputThreshold()
    for _ in range(20):
        t.observe(outcome(4, 4, confidences=[0.6, 0.3, 0.2, 0.1]))
    before = t.gamma
    assert before == pytest.approx(0.02, rel=0.01)
    t.observe(outcome(3, 0, confidences=[0.5, 0.2, 0.1]))  # one round that fits γ = 8
    assert t.gamma == pytest.approx(before ** 0.7 * 8 ** 0.3, rel=1e-6) and t.gamma < 0.2


def test_goodput_not_pipelined_drafts_provisionally_only_behind_a_branch_likely_accepted_whole():
    right, wrong = GoodputThreshold(), GoodputThreshold()
    assert right.provisional_worth(0.5) and wrong.provisional_worth(0.5)  # nothing measured yet: try it
    for _ in range(10):
        right.observe(outcome(4, 4, confidences=[0.6, 0.5, 0.4, 0.3]))  # always right, under-confident
        wrong.observe(outcome(2, 0, confidences=[0.7, 0.5]))  # the first token already wrong
    assert right.provisional_worth(0.3)
    assert not wrong.provisional_worth(0.7)
    assert FixedSize(4).provisional_worth(0.01) and EdgeLLMThreshold().provisional_worth(0.01)


def test_goodput_pipelined_drafts_provisionally_whenever_the_branch_pays_for_the_forward_it_may_hold_up():
    """While pipelined, an accepted branch's provisional forwards are the next tree (pipeline_nodes of them) and a
    rejected one holds the next round up by half a forward: drafting on pays from a chance of 1 / (2n + 1)."""
    t = make_trigger("goodput", pipeline=True)
    for _ in range(10):  # a calibrated draft (gamma ~1) that makes 5 tokens per verification
        t.observe(RoundOutcome(2, 1, (0.8, 0.4), 2, 100.0, 2, 36.0, pipelined_next=True, verify_ms=90.0))
    assert t.pipeline_nodes() == 5 and 0.5 < t.gamma < 2
    low = 0.15 ** (1 / t.gamma)  # a chance of 0.15: not likely accepted whole, yet above 1/11
    assert not t.likely_whole(low) and t.provisional_worth(low)
    assert t.should_verify(low, 2)  # (the tree still goes at once: growing it on is not worth a wait)
    assert not t.provisional_worth(0.05 ** (1 / t.gamma))  # below 1/11: the draft stops
    for _ in range(10):  # provisional drafting stopped following the committed path: only likely branches
        t.observe(RoundOutcome(2, 1, (0.8, 0.4), 2, 100.0, 2, 36.0, pipelined_next=False, verify_ms=90.0))
    assert not t.provisional_worth(low) and t.provisional_worth(0.5 ** (1 / t.gamma))


def test_goodput_pipelined_while_provisional_drafting_follows_the_committed_path():
    t = balance_point_only(make_trigger("goodput", pipeline=True))
    assert t.should_verify(0.99, 1)  # before anything is measured: verify, and let the draft go on meanwhile
    # 3 draft forwards of 20 ms under each 60 ms verification: pipelined trees of at least 3 nodes
    kept = RoundOutcome(3, 3, (0.5, 0.3, 0.2), 4, 80.0, 0, 0.0, pipelined_next=True, verify_ms=60.0,
                        provisional_steps=3, provisional_ms=60.0)
    dropped = RoundOutcome(3, 1, (0.5, 0.3, 0.2), 2, 80.0, 3, 60.0, pipelined_next=False)
    for _ in range(4):
        t.observe(dropped)
    assert not t.should_verify(0.99, 1) and t.should_verify(t.alpha / 2, 1)  # provisional tokens lost: α rules
    for _ in range(4):
        t.observe(kept)
    assert t.pipeline_nodes() == 3
    assert not t.should_verify(t.alpha / 2, 1)  # below the pipelined size: grown on, though T < α
    assert t.should_verify(0.99, 3)  # at it: verified, however confident (the draft goes on meanwhile)
    assert not make_trigger("goodput", pipeline=False).should_verify(0.99, 1)  # no pipelining: α from the start


def test_goodput_pipelined_trees_hold_what_the_draft_makes_during_one_verification():
    t = balance_point_only(make_trigger("goodput", pipeline=True))
    assert t.pipeline_nodes() == 1  # nothing measured yet
    for _ in range(10):  # verification calls of 90 ms, draft forwards of 18 ms: 5 tokens a verification
        t.observe(RoundOutcome(5, 5, (0.5,) * 5, 6, 100.0, 5, 90.0, pipelined_next=True, verify_ms=90.0))
    assert t.pipeline_nodes() == 5
    assert not t.should_verify(0.99, 3) and t.should_verify(0.99, 5)
    for _ in range(10):  # a farther verifier (the network's round trip in the call): deeper pipelined trees
        t.observe(RoundOutcome(5, 5, (0.5,) * 5, 6, 100.0, 5, 90.0, pipelined_next=True, verify_ms=190.0))
    assert t.pipeline_nodes() == 11
    assert not t.should_verify(0.99, 9) and t.should_verify(0.99, 11)
    # a round with no kept tokens (the verifier waits for all of its tree): verified at half the pipelined size
    assert not t.should_verify(0.99, 5, fresh=True) and t.should_verify(0.99, 6, fresh=True)
    assert not t.should_verify(0.99, 6)


def test_goodput_pipelined_tree_goes_short_of_its_size_when_waiting_for_the_rest_does_not_pay():
    """A round accepted whole commits its nodes + 1: waiting k draft forwards (the verifier idle) for the nodes still
    missing pays only if the bigger round's rate beats going now; kept tokens the draft has not run on yet cost its
    catch-up forward besides (bench/results/network_zen3_triggers: trees of 7 from 5-6 kept tokens, waiting ~100 ms)."""
    t = make_trigger("goodput", pipeline=True)
    for _ in range(10):  # verification calls of 280 ms, draft forwards of 45 ms: 6.2 forwards a verification
        t.observe(RoundOutcome(7, 7, (0.9,) * 7, 8, 400.0, 0, 0.0, pipelined_next=True, verify_ms=280.0,
                               provisional_steps=6, provisional_ms=270.0))
    assert t.pipeline_nodes() == 7
    assert t.should_verify(0.99, 6)  # 7 tokens now, or 8 after 45 ms more: now
    assert not t.should_verify(0.99, 5)  # 6 tokens now, or 8 after 90 ms more: wait
    assert t.should_verify(0.99, 5, kept=True) and t.should_verify(0.99, 4, kept=True)  # a forward more to wait
    assert not t.should_verify(0.99, 3, kept=True)  # 4 tokens now, or 8 after 225 ms more: wait
    assert not t.should_verify(0.99, 3, fresh=True) and t.should_verify(0.99, 4, fresh=True)  # fresh: half the size
    fixed, edgellm = FixedSize(7), EdgeLLMThreshold(alpha=0.5)
    assert not fixed.should_verify(0.99, 6, kept=True) and not edgellm.should_verify(0.99, 1, kept=True)


def test_goodput_pipelined_trees_sized_by_forwards_under_a_verification():
    """Pipelined rounds are seeded by kept tokens, so they may time no growth forward at all: the draft's forwards
    during the verification size the trees (and where draft and verifier share cores, those are the slower ones)."""
    t = make_trigger("goodput", pipeline=True)
    seeded = RoundOutcome(3, 3, (0.9,) * 3, 4, 200.0, 0, 0.0, pipelined_next=True, verify_ms=200.0,
                          provisional_steps=3, provisional_ms=150.0)  # 50 ms a forward under a 200 ms verification
    for _ in range(10):
        t.observe(seeded)
    assert t.step_ms == 0 and t.pipeline_nodes() == 4
    grown = RoundOutcome(3, 3, (0.9,) * 3, 4, 200.0, 2, 40.0, pipelined_next=True, verify_ms=200.0,
                         provisional_steps=3, provisional_ms=150.0)  # growth forwards of 20 ms (cores to itself)
    for _ in range(10):
        t.observe(grown)
    assert t.step_ms == pytest.approx(20.0) and t.pipeline_nodes() == 4


def test_goodput_pipelined_tree_sent_early_when_its_branch_will_likely_be_rejected():
    t = make_trigger("goodput", pipeline=True)
    for _ in range(10):  # a calibrated draft (gamma ~1) that makes 5 tokens per verification
        t.observe(RoundOutcome(2, 1, (0.8, 0.4), 2, 100.0, 2, 36.0, pipelined_next=True, verify_ms=90.0))
    assert t.pipeline_nodes() == 5 and 0.5 < t.gamma < 2
    assert not t.should_verify(0.9, 2)  # a likely branch: grown to the pipelined size
    assert t.should_verify(0.05, 2)  # an unlikely one: verified now, not drafted on


def test_only_goodput_verifies_steps_already_grown_and_only_likely_ones_while_pipelined():
    assert not FixedSize(4).verifies_grown(1.0) and not EdgeLLMThreshold().verifies_grown(1.0)
    assert make_trigger("goodput", pipeline=True).verifies_grown(0.01)  # no outcome yet: assumed likely
    assert not make_trigger("goodput", pipeline=False).verifies_grown(1.0)  # not pipelined: the α rule decides
    t = make_trigger("goodput", pipeline=True)
    for _ in range(10):  # a calibrated draft (gamma ~1), pipelined
        t.observe(RoundOutcome(2, 1, (0.8, 0.4), 2, 100.0, 2, 36.0, pipelined_next=True, verify_ms=90.0))
    assert t.verifies_grown(0.9) and not t.verifies_grown(0.05)
    for _ in range(10):  # provisional drafting stopped following the committed path: not pipelined any more
        t.observe(RoundOutcome(2, 1, (0.8, 0.4), 2, 100.0, 2, 36.0, pipelined_next=False, verify_ms=90.0))
    assert not t.verifies_grown(0.9)


def test_make_trigger():
    assert isinstance(make_trigger("edgellm"), EdgeLLMThreshold)
    assert make_trigger("fixed", 12).size == 12
    with pytest.raises(ValueError):
        make_trigger("nope")


def rounds_taken(trigger, drafted: RoundOutcome, plain: RoundOutcome, n: int) -> list[bool]:
    """Which rounds the trigger drafted (True) or left to the target alone, each answered with the given outcome."""
    taken = []
    for _ in range(n):
        taken.append(trigger.wants_draft())
        trigger.observe(drafted if taken[-1] else plain)
    return taken


def test_goodput_lets_the_target_decode_alone_when_drafting_does_not_pay():
    plain = RoundOutcome(0, 0, (), 1, 40.0, 0, 0.0, plain=True)  # 0.025 tokens/ms
    weak = outcome(4, 0, committed=1, round_ms=60.0)  # 0.017 tokens/ms: drafting loses
    taken = rounds_taken(GoodputThreshold(), weak, plain, 60)
    assert taken[:5] == [True, True, True, True, False]  # drafting measured first, then one target-only probe
    # target alone, then a drafted probe after probe_every rounds: two rounds, as the first one after target-only
    # rounds (the draft catching up on the tokens it skipped) is not measured
    assert taken[5:23] == [False] * 16 + [True, True]
    # each probe that confirms the choice doubles the gap: probes at rounds 21, 55, 121, 187 (gap 64 at most)
    taken = rounds_taken(GoodputThreshold(), weak, plain, 200)
    assert [i for i, t in enumerate(taken) if t][4:] == [21, 22, 55, 56, 121, 122, 187, 188]

    good = outcome(4, 3, committed=4, round_ms=80.0)  # 0.05 tokens/ms: drafting wins
    taken = rounds_taken(GoodputThreshold(), good, plain, 60)
    assert taken[:5] == [True, True, True, True, False]
    # the warm-up probe confirms drafting; drafting runs 2x target-only, so the probe due 32 measured rounds later
    # (round 38; round 5, the first drafted one after the probe, is not measured) is skipped, and so are the next
    # ones, the gap doubling (rounds 102, 230, 486), until it reaches probe_max_decisive: then one runs every 512
    taken = rounds_taken(GoodputThreshold(), good, plain, 2000)
    assert [i for i, t in enumerate(taken) if not t] == [4, 998, 1512]


def test_goodput_runs_probes_whose_outcome_is_not_clear():
    """Drafting only 1.2x faster than target-only rounds: no probe is skipped (the gap still doubles)."""
    plain = RoundOutcome(0, 0, (), 1, 40.0, 0, 0.0, plain=True)  # 0.025 tokens/ms
    close = outcome(4, 2, committed=3, round_ms=100.0)  # 0.03 tokens/ms
    taken = rounds_taken(GoodputThreshold(), close, plain, 120)
    assert [i for i, t in enumerate(taken) if not t] == [4, 38, 104]


def test_goodput_probes_as_at_first_once_a_probe_flips_the_choice():
    t = GoodputThreshold()
    plain = RoundOutcome(0, 0, (), 1, 40.0, 0, 0.0, plain=True)
    for drafted in [outcome(4, 3, committed=4, round_ms=80.0)] * 21:  # drafting wins; probes at 4 and 21
        t.observe(drafted if t.wants_draft() else plain)
    assert t.probe_gap == 32
    t.drafted = (1.0, 100.0)  # the draft got much slower meanwhile: the next plain probe flips the choice
    t.since_probe = t.probe_gap
    assert not t.wants_draft()
    t.observe(plain)
    assert not t.drafting and t.probe_gap == t.probe_every


def test_edgellm_and_fixed_always_draft():
    assert EdgeLLMThreshold().wants_draft() and FixedSize(4).wants_draft()


def test_goodput_compares_tokens_over_time_not_single_rounds():
    """Drafted rounds alternately rejected (1 token) and accepted (3) in 100 ms: 0.02 tokens/ms over time,
    beating target-only rounds (1 token in 60 ms, 0.017), though every rejected round alone is slower."""
    plain = RoundOutcome(0, 0, (), 1, 60.0, 0, 0.0, plain=True)
    t = GoodputThreshold()
    taken = []
    for _ in range(80):
        taken.append(t.wants_draft())
        drafted = sum(taken)
        t.observe((outcome(3, 0, committed=1) if drafted % 2 else outcome(3, 2, committed=3)) if taken[-1] else plain)
    assert [i for i, t in enumerate(taken) if not t] == [4, 38]  # only the probes, the gap doubling


def test_goodput_sets_alpha_from_the_first_draft_step_it_sees():
    """Rounds without draft forwards (pipelined, copied spans) measure no step time; the first step measured
    mid-round sets α at once instead of leaving the starting guess to grow the tree to the node budget."""
    t = GoodputThreshold()
    t.observe(RoundOutcome(16, 16, (0.9,) * 16, 17, 400.0, 0, 0.0))  # 17 tokens in 400 ms, no draft forward
    assert t.step_ms == 0 and t.alpha == 0.01
    t.note_step(100.0)  # a draft forward as dear as ~4 committed tokens: verify at once
    assert t.step_ms == 100.0 and t.alpha == 1.0 and t.should_verify(0.9, 1)
    t.note_step(5.0)  # later steps go through observe's average, not here
    assert t.step_ms == 100.0


def test_goodput_does_not_measure_the_draft_catching_up():
    """The first drafted round of a session, and the first after target-only rounds, carry the draft's catch-up
    (its prompt's prefill, the tokens it skipped): not measured, so a draft that pays is not judged by it."""
    t = GoodputThreshold()
    t.new_session()
    t.observe(outcome(4, 4, committed=5, round_ms=2000.0))  # waited for the draft's prefill
    assert t.drafted == (0.0, 0.0) and t.rate == 0
    t.observe(outcome(4, 4, committed=5, round_ms=100.0))
    assert t.drafted == (5.0, 100.0)
    t.observe(RoundOutcome(0, 0, (), 1, 40.0, 0, 0.0, plain=True))
    t.observe(outcome(4, 4, committed=5, round_ms=900.0))  # caught up on the target-only round's token first
    assert t.drafted == (5.0, 100.0)


def test_a_tree_that_would_leave_a_stub_of_the_request_grows_on():
    remaining = 12  # tokens the request still wants: a tree of at most 11 nodes (the bonus token is the 12th)
    assert leaves_stub(11 - FINISH_NODES, 11, remaining) and leaves_stub(10, 11, remaining)
    assert not leaves_stub(11 - FINISH_NODES - 1, 11, remaining)  # enough left for a round of its own
    assert not leaves_stub(11, 11, remaining)  # the tree takes the rest already
    assert not leaves_stub(10, 11, remaining=40)  # the node budget bounds the tree, not the request's end


def test_stretches_try_each_then_keep_the_fastest_and_probe_the_others_in_turn():
    stretches = Stretches(choices=(1.0, 1.5, 2.0), probe_every=4)
    ms_per_token = {1.0: 20.0, 1.5: 16.0, 2.0: 18.0}  # 1.5x the balance point is the fastest here
    used = []
    for _ in range(30):
        nodes = stretches.size(10)
        used.append(stretches.now)
        assert nodes == math.ceil(10 * stretches.now)
        stretches.observe(nodes + 1, (nodes + 1) * ms_per_token[stretches.now])
    assert used[:3] == [1.0, 1.5, 2.0]  # each tried once
    later = used[3:]
    assert later.count(1.5) >= 0.7 * len(later)  # then the fastest
    assert {1.0, 2.0} <= set(later)  # and the others now and then, each in turn
    before = (dict(stretches.scores), stretches.level)
    stretches.observe(5, 1.0)  # an outcome of a round it did not size: nothing measured
    assert (stretches.scores, stretches.level) == before
    stretches.size(10)
    stretches.discard()  # a copied span's round: not measured
    stretches.observe(100, 1.0)
    assert (stretches.scores, stretches.level) == before


def test_stretches_judge_each_stretch_against_the_text_of_its_time():
    """The session's text changes every stretch's rate at once (a chat answer, then a code edit whose pipelined rounds
    commit twice the tokens a millisecond): the stretch probed when it changes does not take the lead for it, the
    fastest on the same text keeps it."""
    stretches = Stretches(choices=(1.0, 1.5, 2.0), probe_every=4)
    ms_per_token = {1.0: 16.0, 1.5: 18.0, 2.0: 20.0}  # the balance point is the fastest on any text
    used, pace = [], 1.0
    for i in range(60):
        nodes = stretches.size(10)
        if i > 3 and stretches.now == 2.0 and pace == 1.0:
            pace = 0.5  # the code edit starts on a probe of the slowest stretch
            shift = i
        used.append(stretches.now)
        stretches.observe(nodes + 1, (nodes + 1) * ms_per_token[stretches.now] * pace)
    later = used[shift + 8:]  # (a few rounds on: until the level has the new text's pace, the change lifts them)
    assert later.count(1.0) >= 0.7 * len(later)
    assert stretches.score(1.0) > stretches.score(1.5) > stretches.score(2.0)


def test_stretches_charge_a_rejection_the_fresh_round_after_it():
    """Twice the balance point commits faster a round (21 tokens in 300 ms against 11 in 170), but every such tree is
    rejected and the fresh round after it, the verifier waiting for the draft, commits 4 tokens in 200 ms: 50
    tokens/s in all against the balance point's 65. The fresh rounds count against the stretch whose rejection made
    them, so the balance point leads."""
    stretches = Stretches(choices=(1.0, 2.0), probe_every=4)
    used, fresh = [], False
    for _ in range(60):
        if fresh:  # (a fresh round is not sized: GoodputThreshold.should_verify sizes it at half the balance point)
            stretches.observe(4, 200.0)
            fresh = False
            continue
        stretches.size(10)
        used.append(stretches.now)
        fresh = stretches.now == 2.0
        stretches.observe(21, 300.0, pipelined_next=False) if fresh else stretches.observe(11, 170.0)
    assert used[2:].count(1.0) >= 0.7 * len(used[2:])
    assert stretches.score(1.0) > stretches.score(2.0)
    stretches.size(10)
    stretches.observe(21, 300.0, pipelined_next=False)
    stretches.discard()  # the round after it was a copied span: neither it nor the next is measured
    before = (dict(stretches.scores), stretches.level)
    stretches.observe(4, 200.0)
    assert (stretches.scores, stretches.level) == before


def test_goodput_pipelined_tree_grows_to_its_stretch_past_where_waiting_stops_paying():
    """Past the balance point the measured rates decide: a stretched pipelined tree waits for its nodes even where
    _waiting_pays's model would send it (verifier idle meanwhile), unless its branch is unlikely to be taken whole."""
    t = make_trigger("goodput", pipeline=True)
    for _ in range(10):  # verification calls of 280 ms, draft forwards of 45 ms: 6.2 forwards a verification
        t.observe(RoundOutcome(7, 7, (0.9,) * 7, 8, 400.0, 0, 0.0, pipelined_next=True, verify_ms=280.0,
                               provisional_steps=6, provisional_ms=270.0))
    assert t.pipeline_nodes() == 7
    t.stretches.now = 2.0
    assert not t.should_verify(0.99, 6) and not t.should_verify(0.99, 13)  # (balance only: 6 went at once)
    assert t.should_verify(0.99, 14)
    assert t.should_verify(0.1 ** (1 / t.gamma), 8)  # a branch with a chance of 0.1 goes now
    assert not t.should_verify(0.99, 3, fresh=True) and t.should_verify(0.99, 4, fresh=True)  # fresh: balance / 2
    t.observe(RoundOutcome(14, 14, (0.9,) * 14, 15, 700.0, 0, 0.0, pipelined_next=True, verify_ms=300.0))
    assert t.stretches.scores[2.0] == (15, 15) and t.stretches.level == (15, 700.0)  # measured for the stretch
    # that sized it (the first measured round: at par with the level, which it starts)
    t.should_verify(0.99, 14)
    t.new_session()  # the next session's trigger starts from this one: its first round is not a pipelined one
    t.observe(RoundOutcome(3, 3, (0.9,) * 3, 4, 2000.0, 0, 0.0, pipelined_next=True, after_prefill=True))
    assert t.stretches.scores == {2.0: (15, 15)}
