"""Streamed width-adaptive trees, the verification trigger and provisional generation stay lossless.

Greedy output through the real gRPC services (DraftTree stream) equals HF greedy of the target alone,
for every trigger, with and without provisional generation, with a draft equal to the target (everything
accepted: provisional tokens are kept) and an unrelated one (mostly dropped). Every session measures
afresh (share_estimates off), so each one drafts before goodput may settle on target-only rounds.
"""


import pytest

from draft_service.drafter import Drafter
from draft_service.proposers import ModelProposer
from specsplit.client import Client
from specsplit.config import DraftConfig, OrchestratorConfig, VerifierConfig
from specsplit.launch import start_stack
from specsplit.sampling import SamplingParams
from tiny import delay_relay, hf_greedy, hold_each_forward, span_exporter, tiny_loaded

PROMPTS = [
    [258, 72, 101, 108, 108, 111],
    list(range(30, 90)),
    [42],
]


def run(stack, prompt_ids, max_new_tokens):
    chunks = list(Client(stack.address).generate(prompt_token_ids=prompt_ids, max_new_tokens=max_new_tokens))
    tokens = [t for c in chunks for t in c.token_ids]
    return tokens, [c.stats for c in chunks if c.stats is not None]


@pytest.fixture(scope="module")
def target():
    return tiny_loaded(seed=0, layers=2)


@pytest.mark.parametrize("trigger", ["goodput", "edgellm", "fixed"])
@pytest.mark.parametrize("provisional", [0, 8])
def test_draft_equals_target(target, trigger, provisional):
    same = tiny_loaded(seed=0, layers=2)
    config = OrchestratorConfig(trigger=trigger, provisional_max=provisional, fixed_tree_nodes=6, tree_max_nodes=24,
                                share_estimates=False)
    with start_stack(target, [ModelProposer(same, DraftConfig())], orchestrator_config=config) as stack:
        kept = whole = rounds = 0
        for prompt in PROMPTS:
            tokens, stats = run(stack, prompt, 48)
            assert tokens == hf_greedy(target.model, prompt, 48)
            drafted = [s for s in stats if s.num_draft_tokens]
            assert drafted and all(s.drafter == "model" for s in drafted)
            # the whole greedy branch accepted, plus the bonus token (goodput may let the target decode alone
            # between drafted rounds, and verify one-node trees: on this tiny model a draft step costs a target one)
            assert all(s.num_committed >= 2 for s in drafted)
            whole += sum(s.num_accepted == s.tree_depth for s in drafted)
            rounds += len(drafted)
            kept += sum(s.provisional_kept for s in stats)
        assert whole >= 0.8 * rounds  # a side branch may grow deeper than the greedy chain now and then
        if provisional:
            assert kept > 0  # provisional tokens continued the committed path and seeded trees
        else:
            assert kept == 0


@pytest.mark.parametrize("trigger", ["goodput", "edgellm"])
def test_unrelated_draft(target, trigger):
    draft = tiny_loaded(seed=123, layers=1)
    config = OrchestratorConfig(trigger=trigger, provisional_max=8, share_estimates=False)
    with start_stack(target, [ModelProposer(draft, DraftConfig())], orchestrator_config=config) as stack:
        for prompt in PROMPTS:
            tokens, stats = run(stack, prompt, 40)
            assert tokens == hf_greedy(target.model, prompt, 40)
            assert sum(s.num_draft_tokens for s in stats) > 0


@pytest.mark.parametrize("trigger", ["goodput", "fixed"])
@pytest.mark.parametrize("pipeline", [True, False])
def test_pipelined_verification(target, trigger, pipeline, monkeypatch):
    """Kept provisional tokens verified at once as the next tree (pipeline) or seeding a tree the draft grows on.
    Rounds verified at once carry the span attribute specsplit.pipelined. (Each verification is held 20 ms, so the
    draft has provisional tokens to keep: next to the tiny verifier most runs had none, and no round verified at once.)"""
    exporter = span_exporter()
    same = tiny_loaded(seed=0, layers=2)
    # fixed-1: any kept provisional token is a tree big enough to verify at once
    config = OrchestratorConfig(trigger=trigger, fixed_tree_nodes=1, provisional_max=8, pipeline=pipeline,
                                share_estimates=False)
    with start_stack(target, [ModelProposer(same, DraftConfig(grow_width=1))], orchestrator_config=config) as stack:
        hold_each_forward(stack.verifier_engine, monkeypatch)
        for prompt in PROMPTS:
            tokens, _ = run(stack, prompt, 48)
            assert tokens == hf_greedy(target.model, prompt, 48)
    rounds = [s for s in exporter.get_finished_spans() if s.name == "specsplit.orchestrator.round"]
    exporter.shutdown()
    at_once = sum(bool(s.attributes.get("specsplit.pipelined")) for s in rounds)
    if not pipeline:
        assert at_once == 0
    elif trigger == "fixed":
        assert at_once > 0


@pytest.mark.parametrize("provisional", [0, 8])
def test_a_request_s_last_tokens_join_the_last_tree(target, provisional):
    """A tree that, accepted whole, would leave one or two of the request's tokens grows on to take them, rather than
    leave them to a round of their own (a verification and a round trip): with the target as the draft (a chain, all
    accepted) and fixed-4 trees, every request of 6 to 19 tokens ends on a round that commits at least 3, and none has
    a target-only round."""
    same = tiny_loaded(seed=0, layers=2)
    config = OrchestratorConfig(trigger="fixed", fixed_tree_nodes=4, provisional_max=provisional, share_estimates=False)
    with start_stack(target, [ModelProposer(same, DraftConfig(grow_width=1))], orchestrator_config=config) as stack:
        for max_new_tokens in range(6, 20):
            tokens, stats = run(stack, PROMPTS[0], max_new_tokens)
            assert tokens == hf_greedy(target.model, PROMPTS[0], max_new_tokens)
            committed = [s.num_committed for s in stats]
            assert committed[-1] >= 3 and all(s.num_draft_tokens for s in stats), (max_new_tokens, committed)


def test_a_provisional_token_the_bonus_token_confirms_is_not_wasted(target, monkeypatch):
    """With the target as its draft (a chain, always right), provisional drafting's first token is the verifier's bonus
    token: it was drafted right, not wasted (before, every pipelined round reported one wasted draft token). (Verifier
    forwards held 20 ms: provisional tokens always arrive during a verification.)"""
    same = tiny_loaded(seed=0, layers=2)
    config = OrchestratorConfig(trigger="fixed", fixed_tree_nodes=4, provisional_max=8, share_estimates=False)
    with start_stack(target, [ModelProposer(same, DraftConfig(grow_width=1))], orchestrator_config=config) as stack:
        hold_each_forward(stack.verifier_engine, monkeypatch)
        tokens, stats = run(stack, PROMPTS[0], 40)
    assert tokens == hf_greedy(target.model, PROMPTS[0], 40)
    assert sum(s.provisional_kept for s in stats) > 0  # pipelined rounds happened
    assert all(s.num_accepted == s.tree_depth for s in stats)  # each round's whole branch: provisional drafting followed
    # what a round wastes is its tree's other nodes (a side branch now and then), no provisional token
    assert [s.wasted for s in stats] == [s.num_draft_tokens - s.num_accepted for s in stats]


@pytest.mark.parametrize("provisional", [0, 8])
def test_nothing_is_drafted_past_eos(provisional):
    """A branch ends at the target's EOS: the draft grows nothing after it, copies nothing after it and drafts nothing
    provisionally from it (generation ends there). With the target as its draft (a chain, all accepted) and fixed-24
    trees, the tree that takes the EOS ends at it (before: it grew on to 24 nodes) and nothing drafted is wasted."""
    target, same = tiny_loaded(seed=7), tiny_loaded(seed=7)
    prompt = PROMPTS[1]
    eos = hf_greedy(target.model, prompt, 20)[12]  # a token greedy decoding really emits
    for model in (target, same):
        model.model.generation_config.eos_token_id = eos
    expected = hf_greedy(target.model, prompt, 80)
    assert expected[-1] == eos and len(expected) <= 13
    config = OrchestratorConfig(trigger="fixed", fixed_tree_nodes=24, provisional_max=provisional, share_estimates=False)
    with start_stack(target, [ModelProposer(same, DraftConfig(grow_width=1))], orchestrator_config=config) as stack:
        tokens, stats = run(stack, prompt, 80)
    assert tokens == expected
    assert stats[-1].tree_depth == stats[-1].num_accepted == stats[-1].num_committed  # the tree ends at the EOS
    assert sum(s.wasted for s in stats) == 0, [(s.num_draft_tokens, s.num_accepted, s.wasted) for s in stats]


@pytest.mark.parametrize("sampled", [False, True])
def test_a_whole_tree_ends_at_eos_too(sampled):
    """The Propose path's whole trees (sampled sessions' model drafts, lookup drafts) end at the target's EOS like
    grown ones: the draft expands no node whose token is a stop token (before, the orchestrator cut what it drafted
    below one, so the draft's forwards for those nodes were spent for nothing). Seeded draws: the same first level."""
    model = tiny_loaded(seed=0, layers=2)
    sampling = SamplingParams(temperature=1.0, seed=3) if sampled else SamplingParams()
    prompt = PROMPTS[1]

    def tree_for(stop):
        drafter = Drafter(ModelProposer(model, DraftConfig(model_top_k=3, model_depth=5)))
        drafter.start("s", prompt, model.fingerprint, sampling=sampling, stop_token_ids=stop)
        return drafter.propose("s", [], len(prompt), 24)[0]

    free = tree_for(())
    expanded = [p for p in free.parents if p >= 0 and free.parents[p] < 0]  # first-level nodes with children
    stop = (free.token_ids[expanded[0]],)
    ended = tree_for(stop)
    assert stop[0] in ended.token_ids  # the same draws reach it ...
    assert all(p < 0 or ended.token_ids[p] not in stop for p in ended.parents)  # ... and nothing is drafted below it


@pytest.mark.parametrize("trigger", ["fixed", "goodput"])
def test_no_tree_exceeds_the_verifier_s_node_budget(target, trigger):
    """Copied prompt-lookup spans (up to 16 tokens) and last round's kept provisional tokens (a seed as long as the
    draft went) are cut to the round's node budget like grown trees: with a verifier that takes 6 nodes, a draft
    that copies spans, on a prompt that repeats itself, every tree has at most 6 nodes and the output equals HF
    greedy (before, a 16-token span was sent as it was and the verifier refused it: the generation failed)."""
    same = tiny_loaded(seed=0, layers=2)
    proposer = ModelProposer(same, DraftConfig(), name="half+ngram", copies=True)
    config = OrchestratorConfig(trigger=trigger, fixed_tree_nodes=12, provisional_max=16, share_estimates=False)
    prompt = list(range(30, 50)) * 3
    with start_stack(target, [proposer], verifier_config=VerifierConfig(max_tree_nodes=6),
                     orchestrator_config=config) as stack:
        tokens, stats = run(stack, prompt, 40)
        assert tokens == hf_greedy(target.model, prompt, 40)
        assert stats and max(s.num_draft_tokens for s in stats) == 6


def generate_200_ms_away(target, config: OrchestratorConfig, runs: int = 1) -> list:
    """Chunks of a 24-token generation of PROMPTS[0] with the verifier behind the benchmark's delaying TCP relay
    (200 ms round trip) and the target itself as the draft (chains), each service in its own server; with ``runs``
    > 1, a list of such chunk lists, the generations one after another through one orchestrator."""
    from specsplit.launch import start_draft, start_orchestrator, start_verifier

    verifier = start_verifier(target)
    draft = start_draft(ModelProposer(tiny_loaded(seed=0, layers=2), DraftConfig(grow_width=1)))
    try:
        with delay_relay(verifier.address, 200) as relay:
            orchestrator = start_orchestrator(relay.address, [draft.address], target.tokenizer, config=config)
            try:
                done = [list(Client(orchestrator.address).generate(prompt_token_ids=PROMPTS[0], max_new_tokens=24))
                        for _ in range(runs)]
                return done if runs > 1 else done[0]
            finally:
                orchestrator.stop(0)
    finally:
        draft.stop(0)
        verifier.stop(0)


def test_the_draft_grows_the_first_tree_while_the_verifier_prefills(target):
    """A new session's first streamed round opens before the verifier's Prefill: with the verifier 200 ms away (the
    benchmark's delaying TCP relay), the draft's first DraftTree round begins while that Prefill is still on its way,
    and the session's tokens are still the target's own."""
    exporter = span_exporter()
    config = OrchestratorConfig(trigger="fixed", fixed_tree_nodes=4, provisional_max=8, share_estimates=False,
                                early_verify=False)
    chunks = generate_200_ms_away(target, config)
    spans = exporter.get_finished_spans()
    exporter.shutdown()
    assert [t for c in chunks for t in c.token_ids] == hf_greedy(target.model, PROMPTS[0], 24)
    prefill = [s for s in spans if s.name == "specsplit.orchestrator.prefill"]
    grows = sorted((s for s in spans if s.name == "specsplit.draft.grow"), key=lambda s: s.start_time)
    assert len(prefill) == 1 and grows
    assert prefill[0].end_time - prefill[0].start_time >= 200e6  # ns: the Prefill paid the round trip
    assert grows[0].start_time < prefill[0].end_time - 100e6  # the first tree grew while the Prefill travelled
    first = next(c.stats for c in chunks if c.stats is not None)
    assert first.num_draft_tokens == 4  # and it was the round's tree: the trigger read it when the verifier was ready


def test_goodput_verifies_what_the_draft_grew_during_the_prefill(target):
    """What the draft grew while the Prefill travelled is in the first tree when the goodput trigger reads it (it costs
    no wait; the fixed trigger above keeps its 4): with the target as its own draft, all of it is accepted, and the
    tokens are still the target's own."""
    # early_verify off: the first tree waits for the Prefill's answer (as when no prefill time can be told yet)
    config = OrchestratorConfig(trigger="goodput", provisional_max=8, share_estimates=False, early_verify=False)
    chunks = generate_200_ms_away(target, config)
    assert [t for c in chunks for t in c.token_ids] == hf_greedy(target.model, PROMPTS[0], 24)
    first = next(c.stats for c in chunks if c.stats is not None)
    # before any measurement the goodput trigger would verify 1 node; the draft (a few ms a forward) grew its whole
    # budget, 23 nodes (24 tokens, one left for the bonus token), in the ~200 ms the Prefill took
    assert first.num_draft_tokens >= 8 and first.num_accepted == first.num_draft_tokens


@pytest.mark.parametrize("early", [True, False])
def test_once_a_prefill_was_measured_the_first_tree_leaves_before_the_prefill_answers(target, early):
    """A new session's first Verify is sent while its Prefill is still on its way (the orchestrator has measured a
    prefill, so it knows when this one will be done; the verifier runs the Verify right after it): its tokens come
    back a round trip sooner. With early_verify off it waits for the Prefill's answer. The tokens are the target's
    own either way, and the stream still starts with the session's id and prompt."""
    from opentelemetry.trace import SpanKind

    exporter = span_exporter()
    config = OrchestratorConfig(trigger="fixed", fixed_tree_nodes=4, provisional_max=8, early_verify=early)
    runs = generate_200_ms_away(target, config, runs=2)
    spans = exporter.get_finished_spans()
    exporter.shutdown()
    for chunks in runs:
        assert [t for c in chunks for t in c.token_ids] == hf_greedy(target.model, PROMPTS[0], 24)
        assert chunks[0].session_id and list(chunks[0].prompt_token_ids) == PROMPTS[0]
    generations = sorted((s for s in spans if s.name.startswith("specsplit.orchestrator.generate")),
                         key=lambda s: s.start_time)
    assert len(generations) == 2
    second = [s for s in spans if s.context.trace_id == generations[1].context.trace_id]  # the second session
    prefill = [s for s in second if s.name == "specsplit.orchestrator.prefill"]
    verifies = [s for s in second if s.kind == SpanKind.CLIENT and s.name.endswith("/Verify")]
    assert len(prefill) == 1 and verifies
    first_verify = min(verifies, key=lambda s: s.start_time)
    if early:  # sent while the Prefill travelled (100 ms each way), and answered, with no retry
        assert first_verify.start_time < prefill[0].end_time - 100e6
        assert all(s.attributes.get("rpc.grpc.status_code") == 0 for s in verifies)
    else:
        assert first_verify.start_time >= prefill[0].end_time
