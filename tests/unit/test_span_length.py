"""How much of a copied span to verify: the verification cost fit, the span chances and the length they choose."""

import pytest

from orchestrator.span_length import SpanChances, VerifyCost, span_nodes
from orchestrator.trigger import EdgeLLMThreshold, FixedSize, GoodputThreshold, RoundOutcome
from specsplit.lookup import LOOKUP_MAX


def test_verify_cost_fits_a_fixed_and_a_per_node_part():
    cost = VerifyCost()
    assert cost.fit() is None
    for nodes in (0, 8, 16, 32, 16, 0):
        cost.observe(nodes, 40.0 + 3.0 * nodes)
    fixed, per_node = cost.fit()
    assert fixed == pytest.approx(40.0) and per_node == pytest.approx(3.0)


def test_verify_cost_of_one_size_only_has_no_per_node_part():
    cost = VerifyCost()
    for ms in (100.0, 110.0):
        cost.observe(16, ms)
    fixed, per_node = cost.fit()
    assert per_node == 0.0 and 100.0 < fixed < 110.0


def test_verify_cost_never_falls_with_nodes():
    cost = VerifyCost()
    cost.observe(1, 60.0)
    cost.observe(30, 50.0)  # noise: a bigger call measured faster
    fixed, per_node = cost.fit()
    assert per_node == 0.0 and fixed == pytest.approx(55.0, rel=0.05)


def test_span_chances_split_the_first_token_on_and_off_track():
    chances = SpanChances(decay=1.0, on_track=(0.0, 0.0), after_break=(0.0, 0.0), later=(0.0, 0.0))
    chances.observe(16, 16)  # off track (the start): its first token right, 15 later ones right, none wrong
    assert chances.tracking and chances.after_break == (1.0, 1.0) and chances.later == (15.0, 15.0)
    chances.observe(16, 0)  # on track, wrong at once
    assert not chances.tracking and chances.on_track == (0.0, 1.0)
    chances.observe(10, 4)  # off track: first right, 3 later right, the 5th wrong
    assert chances.after_break == (2.0, 2.0) and chances.later == (18.0, 19.0)
    assert chances.chances() == (1.0, pytest.approx(18 / 19))
    chances.observe(4, 4)
    chances.interrupt()  # a drafted round between: the next span starts off track
    assert not chances.tracking


def test_span_length_is_the_limit_where_nodes_cost_nothing_or_nothing_was_timed():
    assert span_nodes(48, (0.5, 0.9), cost=None) == 48
    assert span_nodes(48, (0.5, 0.9), cost=(100.0, 0.0)) == 48  # a GPU verifier: the whole span


def test_span_length_follows_the_chances_where_nodes_cost():
    cpu = (70.0, 2.2)  # ms per call and per node (a CPU verifier: 1 token 72 ms, 32 tokens 140 ms)
    sure, shaky = span_nodes(48, (0.99, 0.99), cpu), span_nodes(48, (0.5, 0.7), cpu)
    assert sure == 48 and shaky < 16
    # the rate it picks is the best one: the expected committed tokens per ms of every other length is no higher
    p0, p = 0.5, 0.7

    def rate(n):
        return (1 + sum(p0 * p ** k for k in range(n))) / (cpu[0] + cpu[1] * n)

    assert all(rate(shaky) >= rate(n) for n in range(1, 49))


def test_goodput_learns_span_length_from_copied_rounds():
    t = GoodputThreshold()
    assert t.span_nodes(48) == 48  # nothing timed yet
    copied = dict(plain=True, copied=True)
    # a CPU verifier whose calls grow with the nodes, spans that break within a few tokens
    for _ in range(6):
        t.observe(RoundOutcome(32, 2, (0.9,) * 32, 3, 140.0, 0, 0.0, verify_ms=140.0, nodes=32, **copied))
        t.observe(RoundOutcome(0, 0, (), 1, 44.0, 0, 0.0, plain=True, verify_ms=44.0))
    short = t.span_nodes(48)
    assert short < 16
    ms = 44.0 + 3.0 * short  # the same cost law
    for _ in range(20):  # then spans that hold
        t.observe(RoundOutcome(short, short, (0.9,) * short, short + 1, ms, 0, 0.0, verify_ms=ms, nodes=short, **copied))
    assert t.span_nodes(48) > 16


def test_fixed_sizes_copy_their_size_and_edgellm_prompt_lookups_length():
    assert FixedSize(8).span_nodes(48) == 8 and FixedSize(64).span_nodes(48) == 48
    assert EdgeLLMThreshold().span_nodes(48) == LOOKUP_MAX


def test_goodput_times_verifications_but_not_one_that_waited_for_the_prefill_or_decoded_a_burst():
    t = GoodputThreshold()
    t.observe(RoundOutcome(16, 16, (0.9,) * 16, 17, 900.0, 0, 0.0, verify_ms=900.0, nodes=16, after_prefill=True))
    t.observe(RoundOutcome(0, 0, (), 6, 300.0, 0, 0.0, plain=True, verify_ms=300.0))  # a burst of 6 forwards
    assert t.cost.fit() is None
    t.observe(RoundOutcome(16, 16, (0.9,) * 16, 17, 105.0, 0, 0.0, verify_ms=105.0, nodes=16, plain=True, copied=True))
    t.observe(RoundOutcome(0, 0, (), 1, 44.0, 0, 0.0, plain=True, verify_ms=44.0))
    fixed, per_node = t.cost.fit()
    assert fixed == pytest.approx(44.0) and per_node == pytest.approx(61.0 / 16)
