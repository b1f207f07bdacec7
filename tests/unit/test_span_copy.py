"""A draft that copies prompt-lookup spans keeps the prefix its model agrees with, checking a span in pieces while
the session's spans have mostly been left early (draft_service.rounds.GrowthRound, SpanAgreement)."""

import torch

from draft_service.drafter import GrowthControl
from draft_service.lean import ForwardInterrupted
from draft_service.rounds import GrowthRound, SpanAgreement
from specsplit.growth import GrowthPolicy
from specsplit.lookup import SPAN_PROBE

VOCAB = 64
ROOT_NEXT = 1  # the toy model's next token after the committed text; after token t it is t + 1


def toy_round(span, spans=None, interruptible=False):
    """A GrowthRound whose model always continues t -> t + 1 (mod VOCAB), the lookup always finding ``span``.
    Returns (round, sizes of its forwards). interruptible: a forward whose ``stop()`` is true when it starts raises
    ForwardInterrupted (as a lean forward does between layers); else forwards run whole, as a one-layer drafter's."""
    sizes = []

    def forward(tree, nodes, stop=None):
        sizes.append(len(nodes))
        if interruptible and stop is not None and stop():
            raise ForwardInterrupted
        logits = torch.full((len(nodes), VOCAB), -10.0)  # [F, V]
        for row, node in enumerate(nodes):
            logits[row, ROOT_NEXT if node < 0 else (tree.token_ids[node] + 1) % VOCAB] = 10.0
        return logits

    return GrowthRound(forward, lambda n: None, lookup=lambda path: list(span), spans=spans), sizes


def first_step(round_):
    """The round's first step: the span copied at the root (no seed), as far as the model agreed."""
    return next(round_.run([], 32, GrowthPolicy(), GrowthControl(), 0))


def test_a_span_is_kept_as_far_as_the_model_agrees():
    round_, _ = toy_round([1, 2, 3, 9, 9, 9, 9, 9])
    step = first_step(round_)
    assert step.token_ids == (1, 2, 3)
    assert step.parents == (-1, 0, 1)


def test_a_span_left_early_costs_one_small_forward():
    spans = SpanAgreement()  # a new session: nothing agreed yet
    round_, sizes = toy_round([1, 2, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], spans)
    assert first_step(round_).token_ids == (1, 2)
    assert sizes == [1, SPAN_PROBE]  # the root's row, then the probe: not the 16-token forward
    assert spans.share < 0.5


def test_an_agreed_probe_checks_the_rest_in_one_forward():
    round_, sizes = toy_round(list(range(1, 17)))
    assert first_step(round_).token_ids == tuple(range(1, 17))
    assert sizes == [1, SPAN_PROBE, 16 - SPAN_PROBE]


def test_spans_mostly_agreed_are_checked_whole():
    spans = SpanAgreement()
    for _ in range(3):
        round_, sizes = toy_round(list(range(1, 17)), spans)
        first_step(round_)
    assert spans.whole()
    assert sizes == [1, 16]


def test_probing_keeps_what_a_whole_check_keeps():
    for cut in range(1, 10):  # the model leaves the span after `cut` tokens
        whole = SpanAgreement()
        whole.share = 1.0  # checked whole at once
        span = list(range(1, cut + 1)) + [15] * (9 - cut)
        runs = {name: toy_round(span, spans) for name, spans in (("probe", SpanAgreement()), ("whole", whole))}
        kept = {first_step(round_).token_ids for round_, _ in runs.values()}
        assert kept == {tuple(range(1, cut + 1))}, cut
        assert runs["whole"][1] == [1, 9] and runs["probe"][1][:2] == [1, SPAN_PROBE]


def run_round(span, stop, provisional_max=8):
    """A whole round of the toy model with stop tokens: steps until done, then (all of them sent for verification)
    the provisional steps; returns (growth steps, provisional steps)."""
    round_, _ = toy_round(span)
    control = GrowthControl()
    grown, provisional = [], []
    for step in round_.run([], 32, GrowthPolicy(max_depth=6, stop_token_ids=frozenset(stop)), control,
                           provisional_max):
        if step.done:
            control.verify(len(round_.tree))
        elif step.provisional:
            provisional.append(step)
            if len(provisional) == provisional_max:
                control.close()
        else:
            grown.append(step)
    return grown, provisional


def test_a_copied_span_and_provisional_drafting_end_at_a_stop_token():
    """The target's EOS ends a copied span (kept with it), the tree's growth after it, and provisional drafting: nothing
    past it could be committed."""
    grown, provisional = run_round(list(range(1, 17)), stop={4})
    assert [t for s in grown for t in s.token_ids] == [1, 2, 3, 4] and provisional == []
    grown, provisional = run_round([1, 2], stop={4})  # the model's own token 4 ends growth (1, 2 copied, then 3, 4)
    assert [t for s in grown for t in s.token_ids] == [1, 2, 3, 4] and provisional == []
    grown, provisional = run_round([1, 2], stop=set())  # no stop token: growth goes on, then provisional drafting
    assert len([t for s in grown for t in s.token_ids]) > 4 and len(provisional) > 0


def verdict_round(closes_at, interruptible=False):
    """A round seeded with token 1 (sent for verification before the draft's first forward) whose provisional drafting
    finds a 16-token span (3..18); the verdict comes as the first forward of a size ``closes_at(size)`` accepts starts.
    Returns (provisional tokens, round, sizes of its forwards)."""
    round_, sizes = toy_round(list(range(3, 19)), interruptible=interruptible)
    control = GrowthControl()
    forward = round_.forward

    def verdict_during(tree, nodes, stop=None):
        if closes_at(len(nodes)):
            control.close()
        return forward(tree, nodes, stop)

    round_.forward = verdict_during
    control.verify(1)
    steps = list(round_.run([(1, 0.9)], 32, GrowthPolicy(), control, 16))
    return [t for s in steps if s.provisional for t in s.token_ids], round_, sizes


def test_a_verdict_during_a_span_probe_leaves_the_rest_of_the_span_unrun():
    """Provisional drafting finds a 16-token span; the verdict comes while its probe runs: the round is over, so the
    rest (14 tokens, one long forward that would hold up the next round) is not run, and the probed tokens the model
    agreed with are the round's last provisional step."""
    provisional, round_, sizes = verdict_round(lambda size: size == SPAN_PROBE)
    assert provisional == [2, 3, 4]  # grown before the draft read `verifying`, then the probed span tokens
    assert sizes == [1, 1, SPAN_PROBE]  # not the 14-token forward after the probe
    assert round_.spans.whole()  # the model agreed with every token it checked: the next span is checked whole


def test_a_verdict_during_an_interruptible_probe_ends_the_round_at_once():
    """The same race with a draft whose forwards stop once the verdict is in: the probe ends unfinished, its tokens
    leave the tree, and nothing is drafted after it (the next round has the draft at once)."""
    provisional, round_, sizes = verdict_round(lambda size: size == SPAN_PROBE, interruptible=True)
    assert provisional == [2]
    assert sizes == [1, 1, SPAN_PROBE]  # growth's forward (token 2 from it), token 2's row, the stopped probe
    assert round_.tree.token_ids == [1, 2] and round_.leaf == 1


def test_a_verdict_after_an_agreed_probe_keeps_it_and_stops_the_rest():
    """The verdict comes while the rest of the span (after a probe the model agreed with) runs: that forward stops
    and the probed tokens are the round's last provisional step, as when the verdict came during the probe."""
    provisional, round_, sizes = verdict_round(lambda size: size > SPAN_PROBE, interruptible=True)
    assert provisional == [2, 3, 4]
    assert sizes == [1, 1, SPAN_PROBE, 15 - SPAN_PROBE]  # (the span: the 15 tokens left of provisional_max)
    assert round_.tree.token_ids == [1, 2, 3, 4]


def test_a_growth_forward_is_never_stopped():
    """Verified or ended while a growth forward runs, the draft finishes it: it writes the sent leaf's row, where
    provisional drafting starts (no forward again) or, with none, what the next round would run again after the
    verdict."""
    for end in (False, True):
        round_, sizes = toy_round([], interruptible=True)
        control = GrowthControl()
        forward = round_.forward
        stops = []

        def during_the_second_growth_forward(tree, nodes, stop=None):
            stops.append(stop)
            if len(stops) == 3:  # the root's row, the first growth forward, then this one
                control.verify(len(tree))
                if end:
                    control.close()
            return forward(tree, nodes, stop)

        round_.forward = during_the_second_growth_forward
        steps = []
        for step in round_.run([], 32, GrowthPolicy(), control, 3):
            steps.append(step)
            if len([s for s in steps if s.provisional]) == 3:
                control.close()
        assert [t for s in steps if not s.provisional for t in s.token_ids] == [1, 2]
        assert stops[:3] == [None] * 3
        provisional = [t for s in steps if s.provisional for t in s.token_ids]
        if end:
            assert provisional == [] and len(sizes) == 3
        else:  # token 3 from the finished forward, 4 and 5 one forward each
            assert provisional == [3, 4, 5] and len(sizes) == 5
