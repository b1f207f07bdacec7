"""Provisional generation on the draft: kept tokens seed the next tree (no forward, KV still right),
dropped ones leave no trace, and a verdict arriving in the middle of a provisional forward is safe (a lean
forward stops there, the cache as before it)."""

import dataclasses
import threading

import pytest
import torch
from opentelemetry import trace

from draft_service.drafter import GrowthControl
from draft_service.lean import LeanLlama
from draft_service.proposers import ModelProposer
from specsplit import kvcache
from specsplit.config import DraftConfig
from specsplit.lookup import LOOKUP_PROB
from tiny import hf_greedy, span_exporter, tiny_loaded

PROMPT = [258, 72, 101, 108, 108, 111]


@pytest.fixture(scope="module")
def model():
    return tiny_loaded(seed=0, layers=2)


def chain_proposer(model):
    # branch_threshold 1.0: chains only, so the best branch is the draft's greedy chain (draft == target here)
    proposer = ModelProposer(model, DraftConfig(branch_threshold=1.0))
    proposer.start("s", PROMPT)
    return proposer


def tokens_of(steps):
    return [t for s in steps for t in s.token_ids]


def first_round(proposer, verified, provisional_max):
    """The session's first round: its first ``verified`` nodes verified, then ``provisional_max`` provisional tokens."""
    control = GrowthControl()
    for step in proposer.grow("s", PROMPT, verified, control, provisional_max=provisional_max):
        if step.done:
            control.verify(verified)
        if step.provisional and step.first == verified + provisional_max - 1:
            control.close()


def whole_tree_round(proposer, committed, max_nodes):
    """A round whose whole tree is verified (no provisional tokens)."""
    control = GrowthControl()
    steps = []
    for step in proposer.grow("s", committed, max_nodes, control, provisional_max=0):
        steps.append(step)
        if step.done:
            control.verify(sum(len(s.token_ids) for s in steps))
    return steps


def test_verdict_mid_provisional_forward_then_kept(model):
    greedy = hf_greedy(model.model, PROMPT, 24)
    proposer = chain_proposer(model)
    control = GrowthControl()
    in_forward, release = threading.Event(), threading.Event()
    real_expand = proposer._expand
    calls = []

    def slow_expand(*args, **kw):
        calls.append(args[-1])
        if len(calls) == 6:  # a provisional forward (the root's children come from the catch-up forward)
            in_forward.set()
            release.wait(5)
        return real_expand(*args, **kw)

    proposer._expand = slow_expand
    steps = []

    def drive():
        for step in proposer.grow("s", PROMPT, 8, control, provisional_max=10):
            steps.append(step)
            if not step.provisional and len(tokens_of(steps)) >= 3 and control.verifying is None:
                control.verify(3)  # the orchestrator sends the first 3 nodes for verification

    thread = threading.Thread(target=drive)
    thread.start()
    assert in_forward.wait(5)
    control.close()  # the verdict arrives while the draft is inside a forward
    release.set()
    thread.join(5)
    tree_steps = [s for s in steps if not s.provisional]
    provisional = [s for s in steps if s.provisional]
    assert tokens_of(tree_steps)[:3] == greedy[:3]
    # The forward already running when `verifying` came gives the first provisional token; three more
    # forwards follow, the last one in flight when the verdict arrives: its token is kept too.
    assert [s.first for s in provisional] == [3, 4, 5, 6]  # numbering restarts after the verified nodes
    assert tokens_of(provisional) == greedy[3:7]
    # Each step reports the forward behind it (the orchestrator sizes pipelined trees by them); the first one's
    # row came from the growth forward, so it reports none.
    assert provisional[0].draft_ms == 0 and all(s.draft_ms > 0 for s in provisional[1:])
    # The verifier accepted all 3 and its bonus token is greedy[3]: the next round commits 4 tokens.
    committed = PROMPT + greedy[:4]
    session = proposer._sessions["s"]
    assert session.path_tokens == greedy[:7]
    proposer._expand = real_expand
    steps2 = whole_tree_round(proposer, committed, 4)
    assert steps2[0].seeded == 3 and steps2[0].token_ids == tuple(greedy[4:7])  # seeded, no forward
    assert tokens_of([s for s in steps2 if not s.provisional]) == greedy[4:8]  # and the KV behind it is right


@pytest.mark.parametrize("verdict", ["none", "along", "off"])
def test_a_verdict_mid_way_through_a_lean_forward(model, verdict):
    """With the lean forward (the half draft's), a provisional forward still running when the round ends stops at its
    next layer (its token never drafted, the rows its first layer wrote past the cache's end) unless the verdict's
    committed tokens run along its path ("along": it goes on, and its token seeds the next tree). A close with no
    verdict ("none") or one that leaves the path ("off") stops it. Either way the next round drafts the target's
    greedy tokens."""
    greedy = hf_greedy(model.model, PROMPT, 24)
    proposer = ModelProposer(dataclasses.replace(model, model=LeanLlama(model.model, torch.float32)),
                             DraftConfig(branch_threshold=1.0))
    proposer.start("s", PROMPT)
    control = GrowthControl()
    real_forward = proposer._forward
    provisional_forwards, checks = [], []
    committed = {"none": None, "along": greedy[:4], "off": [greedy[0], (greedy[1] + 1) % 300]}[verdict]

    def forward(*args, stop=None, **kw):
        if control.verifying is not None:
            provisional_forwards.append(args[0].shape[1])
            if len(provisional_forwards) == 3:
                def verdict_after_the_first_layer():
                    checks.append(1)
                    if len(checks) == 2:  # the round ends while the first layer runs
                        control.close() if committed is None else control.conclude(committed)
                    return stop()
                return real_forward(*args, stop=verdict_after_the_first_layer, **kw)
        return real_forward(*args, stop=stop, **kw)

    proposer._forward = forward
    steps = []
    exporter = span_exporter()
    with trace.get_tracer(__name__).start_as_current_span("test.round"):  # (the draft service's grow span)
        for step in proposer.grow("s", PROMPT, 3, control, provisional_max=10):
            steps.append(step)
            if step.done:
                control.verify(3)
    [span] = [s for s in exporter.get_finished_spans() if s.name == "test.round"]
    forwards = [s for s in exporter.get_finished_spans() if s.name == "specsplit.draft.forward"]
    assert all(f.parent.span_id == span.context.span_id for f in forwards)
    phases = [f.attributes["specsplit.draft.phase"] for f in forwards]
    assert phases[-3:] == ["provisional"] * 3 and set(phases[:-3]) == {"grow"}  # (3 nodes: 1-3 growth forwards)
    stopped = [f for f in forwards if f.attributes.get("specsplit.draft.stopped")]
    assert [f.attributes["specsplit.num_tokens"] for f in stopped] == ([] if verdict == "along" else [1])
    assert stopped == [] or stopped == forwards[-1:]  # the third provisional forward; the stop is not an error
    assert all(f.status.is_ok and not f.events for f in forwards)
    drafted = 6 if verdict == "along" else 5  # the third forward's token, or none
    assert tokens_of([s for s in steps if not s.provisional]) == greedy[:3]
    assert tokens_of([s for s in steps if s.provisional]) == greedy[3:drafted]
    assert provisional_forwards == [1, 1, 1] and len(checks) == (len(proposer.model.layers) if verdict == "along" else 2)
    session = proposer._sessions["s"]
    assert session.path_tokens == greedy[:drafted]
    assert kvcache.cache_length(session.cache) == len(session.cached)
    proposer._forward = real_forward
    committed = PROMPT + (committed or greedy[:4])  # "none": 3 accepted + the bonus token, as "along"
    steps2 = whole_tree_round(proposer, committed, 4)
    seeds = {"none": greedy[4:5], "along": greedy[4:6], "off": []}[verdict]
    assert steps2[0].seeded == len(seeds) and (not seeds or steps2[0].token_ids == tuple(seeds))
    assert tokens_of([s for s in steps2 if not s.provisional]) == hf_greedy(model.model, committed, 4)


def test_dropped_when_the_verdict_leaves_the_path(model):
    greedy = hf_greedy(model.model, PROMPT, 24)
    proposer = chain_proposer(model)
    control = GrowthControl()
    steps = []
    for step in proposer.grow("s", PROMPT, 4, control, provisional_max=3):
        steps.append(step)
        if step.done:
            control.verify(4)
        if step.provisional and step.first == 6:
            control.close()
    assert tokens_of([s for s in steps if s.provisional]) == greedy[4:7]
    # A different recovered token at the second position: everything after it is dropped.
    other = (greedy[1] + 1) % 300
    committed = PROMPT + [greedy[0], other]
    expected = hf_greedy(model.model, committed, 4)
    steps2 = whole_tree_round(proposer, committed, 4)
    assert all(s.seeded == 0 for s in steps2)
    assert tokens_of([s for s in steps2 if not s.provisional]) == expected
    session = proposer._sessions["s"]
    assert kvcache.cache_length(session.cache) == len(session.cached)


def test_seeds_past_the_verified_prefix_are_the_first_provisional_tokens(model):
    """A pipelined round: the orchestrator sends only a prefix of the seeds for verification at once; the rest
    of them continue that prefix's end, so they come back as provisional tokens without a forward."""
    greedy = hf_greedy(model.model, PROMPT, 24)
    proposer = chain_proposer(model)
    first_round(proposer, 4, 4)
    assert proposer._sessions["s"].path_tokens == greedy[:8]
    committed = PROMPT + greedy[:5]  # all 4 accepted + the bonus token: greedy[5:8] are seeds next round
    real_expand = proposer._expand
    calls = []
    proposer._expand = lambda *args, **kw: calls.append(args[-1]) or real_expand(*args, **kw)
    control = GrowthControl()
    control.verify(2)  # before the round starts: the orchestrator verifies 2 of the 3 seeds at once
    steps = []
    for step in proposer.grow("s", committed, 8, control, provisional_max=3):
        steps.append(step)
        if len([s for s in steps if s.provisional]) == 3:
            control.close()
    assert steps[0].seeded == 3 and steps[0].token_ids == tuple(greedy[5:8])
    provisional = [s for s in steps if s.provisional]
    assert provisional[0].first == 2 and provisional[0].token_ids == (greedy[7],)  # the third seed, re-sent
    assert tokens_of(provisional) == greedy[7:10]
    assert len(calls) == 2  # forwards only for the two tokens after the seeds
    assert proposer._sessions["s"].path_tokens == greedy[5:10]


def test_growth_past_the_verified_nodes_is_the_first_provisional_tokens(model):
    """A round the orchestrator read late (opened before the verifier's prefill): the draft grew 6 chain nodes, the
    trigger sent 3 for verification; the 3 grown past them continue the verified leaf, so they come back as the
    first provisional tokens with no forward, and the KV behind them is right for the next round."""
    greedy = hf_greedy(model.model, PROMPT, 24)
    proposer = chain_proposer(model)
    real_expand = proposer._expand
    calls = []
    proposer._expand = lambda *args, **kw: calls.append(list(args[-1])) or real_expand(*args, **kw)
    control = GrowthControl()
    steps = []
    for step in proposer.grow("s", PROMPT, 6, control, provisional_max=5):
        steps.append(step)
        if step.done:
            control.verify(3)  # the trigger fired at 3 nodes when the orchestrator read the stream
            grown = len(calls)
        if len([s for s in steps if s.provisional]) == 5:
            control.close()
    provisional = [s for s in steps if s.provisional]
    assert tokens_of([s for s in steps if not s.provisional]) == greedy[:6]
    assert [s.first for s in provisional[:3]] == [3, 4, 5] and tokens_of(provisional) == greedy[3:8]
    assert all(s.draft_ms == 0 for s in provisional[:3])
    assert len(calls) == grown + 2  # forwards only for the two tokens after the grown chain
    assert proposer._sessions["s"].path_tokens == greedy[:8]
    proposer._expand = real_expand
    committed = PROMPT + greedy[:4]  # 3 accepted + the bonus token
    steps2 = whole_tree_round(proposer, committed, 4)
    assert steps2[0].seeded == 4 and steps2[0].token_ids == tuple(greedy[4:8])
    assert tokens_of([s for s in steps2 if not s.provisional]) == greedy[4:8]


def test_a_given_chain_is_run_in_one_forward_and_drafting_goes_on_from_its_end(model):
    """A span the orchestrator copied and verifies (DraftTree's given chain): the kept provisional tokens it starts
    with stay seeds, the rest of it is run in one forward and sent as one step, and provisional drafting goes on from
    its end, its first token from that forward; a chain that leaves the seeds drops them (the KV behind the
    provisional tokens right either way: they are the target's greedy continuation of the chain)."""
    greedy = hf_greedy(model.model, PROMPT, 24)
    proposer = chain_proposer(model)
    first_round(proposer, 4, 3)
    assert proposer._sessions["s"].path_tokens == greedy[:7]
    committed = PROMPT + greedy[:5]  # all 4 accepted + the bonus token: greedy[5:7] are seeds
    real_expand = proposer._expand
    calls = []
    proposer._expand = lambda *args, **kw: calls.append(list(args[-1])) or real_expand(*args, **kw)

    def given_round(given):
        control = GrowthControl()
        control.verify(len(given))  # the orchestrator verifies the chain at once
        steps = []
        for step in proposer.grow("s", committed, len(given), control, provisional_max=3, given=given):
            steps.append(step)
            if len([s for s in steps if s.provisional]) == 3:
                control.close()
        return steps

    steps = given_round(greedy[5:12])
    assert steps[0].seeded == 2 and steps[0].token_ids == tuple(greedy[5:7])
    assert steps[1].first == 2 and steps[1].token_ids == tuple(greedy[7:12]) and not steps[1].provisional
    assert tokens_of([s for s in steps if s.provisional]) == greedy[12:15]
    assert len(calls) == 3  # the chain (with the last seed), then two provisional tokens past its end's
    assert proposer._sessions["s"].path_tokens == greedy[5:15]

    committed = PROMPT + greedy[:12] + greedy[12:14]  # the next round: the chain's and 2 more, accepted
    calls.clear()
    other = [(greedy[14] + 1) % 300, 7, 9]  # a chain that leaves the seed (greedy[14]) at once
    steps = given_round(other)
    assert all(s.seeded == 0 for s in steps) and steps[0].token_ids == tuple(other)
    assert tokens_of([s for s in steps if s.provisional]) == hf_greedy(model.model, committed + other, 3)
    session = proposer._sessions["s"]
    assert kvcache.cache_length(session.cache) == len(session.cached)


def copied_round(proposer, session_id, span, after, provisional_max):
    """A round of 2 verified nodes whose lookup finds ``span`` after the path ``after`` (nothing elsewhere):
    its provisional steps."""
    proposer.start(session_id, PROMPT)
    proposer._lookup = lambda session, token_ids: (lambda path: span if path == after else [])
    control = GrowthControl()
    steps = []
    for step in proposer.grow(session_id, PROMPT, 2, control, provisional_max=provisional_max):
        steps.append(step)
        if step.done:
            control.verify(2)
    return [s for s in steps if s.provisional]


def test_copied_span_is_sent_at_once_then_the_model_drafts_on(model):
    """half+ngram: a prompt-lookup span whose first token the model drafts too is scored in one forward and sent in
    one step, and drafting goes on from its end with the right KV behind it; a span the model disagrees with is not
    copied."""
    greedy = hf_greedy(model.model, PROMPT, 24)
    proposer = ModelProposer(model, DraftConfig(branch_threshold=1.0), copies=True)
    provisional = copied_round(proposer, "s", greedy[2:7], greedy[:2], 9)  # the target's own next 5 tokens
    assert [len(s.token_ids) for s in provisional] == [5, 1, 1, 1, 1]
    assert tokens_of(provisional) == greedy[2:11]  # the model continues HF greedy after the copied span
    # the token after the span came from the forward over the span: no forward of its own, so no time reported
    assert provisional[0].draft_ms > 0 and provisional[1].draft_ms == 0 and all(s.draft_ms > 0 for s in provisional[2:])
    assert LOOKUP_PROB not in provisional[0].draft_probs  # the model's own probabilities of the span's tokens
    assert proposer._sessions["s"].path_tokens == greedy[:11]

    wrong = [(greedy[2] + 1) % 300, *greedy[3:7]]  # a chance match: its first token is not the model's
    provisional = copied_round(proposer, "w", wrong, greedy[:2], 4)
    assert [len(s.token_ids) for s in provisional] == [1, 1, 1, 1] and tokens_of(provisional) == greedy[2:6]


def test_copied_span_starts_the_tree_when_the_model_agrees(model):
    """half+ngram, growth: a lookup span after the committed tokens whose first token the model drafts too is
    the tree's first step (one forward over the span scores it, and gives its leaf's children); the model grows
    on from its end, and the tree stays the target's greedy continuation. A disagreeing span is not used."""
    greedy = hf_greedy(model.model, PROMPT, 24)
    proposer = ModelProposer(model, DraftConfig(branch_threshold=1.0), copies=True)

    def grown(session_id, span, whole=False):
        proposer.start(session_id, PROMPT)
        if whole:  # the session's earlier spans were mostly agreed: a span is checked whole at once
            proposer._sessions[session_id].spans.share = 1.0
        proposer._lookup = lambda session, token_ids: (lambda path: span if path == [] else [])
        forwards = []
        real_expand = proposer._expand
        proposer._expand = lambda *args, **kw: forwards.append(list(args[-1])) or real_expand(*args, **kw)
        control = GrowthControl()
        steps = []
        for step in proposer.grow(session_id, PROMPT, 8, control, provisional_max=0):
            steps.append(step)
            if step.done:
                control.verify(8)
        proposer._expand = real_expand
        return steps, forwards

    steps, forwards = grown("g", greedy[:5])
    assert steps[0].first == 0 and steps[0].token_ids == tuple(greedy[:5]) and steps[0].parents == (-1, 0, 1, 2, 3)
    assert tokens_of(steps) == greedy[:8]
    # the span's nodes, before the span was sent: a new session's spans are probed (SPAN_PROBE tokens), then the rest
    assert forwards[:2] == [[0, 1], [2, 3, 4]]
    assert [2, 3, 4] not in forwards[2:] and [4] not in forwards  # its leaf's row came from that forward
    steps, forwards = grown("h", greedy[:5], whole=True)
    assert forwards[0] == [0, 1, 2, 3, 4] and tokens_of(steps) == greedy[:8]  # one forward over the whole span

    steps, _ = grown("w", [(greedy[0] + 1) % 300, *greedy[1:5]])
    assert len(steps[0].token_ids) == 1 and tokens_of(steps) == greedy[:8]


def test_only_the_part_of_a_span_the_model_drafts_too_is_sent(model):
    """half+ngram: a lookup span whose first tokens the model drafts too but which then leaves its greedy path (a
    chance match on chat) goes out only up to there, so it cannot make the verifier reject what the model itself
    would have drafted right; the model drafts on from the last kept token, its KV intact (the target's greedy
    continuation throughout)."""
    greedy = hf_greedy(model.model, PROMPT, 24)
    proposer = ModelProposer(model, DraftConfig(branch_threshold=1.0), copies=True)
    span = [*greedy[2:5], (greedy[5] + 1) % 300, *greedy[6:9]]  # right for 3 tokens, then off
    provisional = copied_round(proposer, "p", span, greedy[:2], 8)
    assert [len(s.token_ids) for s in provisional] == [3, 1, 1, 1, 1, 1]
    assert tokens_of(provisional) == greedy[2:10]
    assert proposer._sessions["p"].path_tokens == greedy[:10]


def test_nothing_verified_the_draft_drafts_on_from_the_committed_tokens(model):
    """A copied span's round at an edit point (DraftTree with no node budget, ``verifying`` 0): the draft grows
    nothing and drafts provisionally from the committed tokens, one token a forward, copying no span there (the
    verifier checks the orchestrator's); the next round keeps what continues its committed tokens as seeds, with the
    KV behind them right (the target's greedy continuation throughout)."""
    greedy = hf_greedy(model.model, PROMPT, 24)
    proposer = ModelProposer(model, DraftConfig(branch_threshold=1.0), copies=True)
    proposer.start("s", PROMPT)
    proposer._lookup = lambda session, token_ids: (lambda path: list(greedy[len(path):len(path) + 6]))
    control = GrowthControl()
    control.verify(0)  # the orchestrator verifies its own span at once
    steps = []
    for step in proposer.grow("s", PROMPT, 0, control, provisional_max=8):
        steps.append(step)
        if len([s for s in steps if s.provisional]) == 5:
            control.close()
    provisional = [s for s in steps if s.provisional]
    assert [len(s.token_ids) for s in provisional] == [1] * 5 and tokens_of(provisional) == greedy[:5]
    assert provisional[0].parents == (-1,) and provisional[0].draft_ms == 0  # its row came from the catch-up
    assert not tokens_of([s for s in steps if not s.provisional])  # nothing grown

    steps = whole_tree_round(proposer, PROMPT + greedy[:2], 4)  # the span's first token + the bonus: 3 kept
    assert steps[0].seeded == 3 and steps[0].token_ids == tuple(greedy[2:5])
    assert tokens_of([s for s in steps if not s.provisional]) == greedy[2:6]
    session = proposer._sessions["s"]
    assert kvcache.cache_length(session.cache) == len(session.cached)


def test_a_seeded_round_verifying_nothing_drafts_nothing(model):
    """``verifying`` 0 in a round that started from kept provisional tokens (the root's row is not at hand): no
    provisional tokens, and the next round still starts right."""
    greedy = hf_greedy(model.model, PROMPT, 24)
    proposer = chain_proposer(model)
    first_round(proposer, 4, 3)
    control = GrowthControl()
    control.verify(0)
    steps = list(proposer.grow("s", PROMPT + greedy[:5], 4, control, provisional_max=3))
    assert steps[0].seeded == 2 and not [s for s in steps if s.provisional]
    steps = whole_tree_round(proposer, PROMPT + greedy[:5], 4)
    assert tokens_of([s for s in steps if not s.provisional]) == greedy[5:9]
