"""Greedy output through the real gRPC services equals HF generate(do_sample=False) of the target alone."""

import pytest

from draft_service.ngram import NgramProposer
from draft_service.proposers import ModelProposer
from specsplit.config import DraftConfig, OrchestratorConfig
from specsplit.launch import start_stack
from tiny import EOS_ID, PARITY_PROMPTS, generate_through, hf_greedy, tiny_loaded

PROMPTS = PARITY_PROMPTS


def run(stack, prompt_ids, max_new_tokens, draft="auto"):
    return generate_through(stack, prompt_ids, max_new_tokens, draft)


@pytest.fixture(scope="module")
def target():
    return tiny_loaded(seed=0, layers=2)


def test_unrelated_random_draft(target):
    draft = tiny_loaded(seed=123, layers=1)
    fresh = OrchestratorConfig(share_estimates=False)  # each session drafts before it may settle on plain rounds
    with start_stack(target, [ModelProposer(draft, DraftConfig(model_top_k=2, model_depth=4))],
                     orchestrator_config=fresh) as stack:
        for prompt in PROMPTS:
            tokens, stats, _ = run(stack, prompt, 40)
            assert tokens == hf_greedy(target.model, prompt, 40)
            assert sum(s.num_draft_tokens for s in stats) > 0  # the draft really drafted


def test_draft_equals_target_accepts_everything(target):
    same = tiny_loaded(seed=0, layers=2)  # same weights as the target
    depth = 5
    # The Propose path: top-k trees of model_depth (streamed: test_lossless_streamed). One token a Verify past the tree:
    # on this tiny target a draft forward costs more than a target step, so its rounds would end in decode bursts
    # (orchestrator/burst.py) and the short generation would end before the trees reach full depth.
    budget = OrchestratorConfig(trigger="budget", burst_max=1)
    with start_stack(target, [ModelProposer(same, DraftConfig(model_top_k=2, model_depth=depth))],
                     orchestrator_config=budget) as stack:
        for prompt in PROMPTS:
            tokens, stats, chunks = run(stack, prompt, 48)
            assert tokens == hf_greedy(target.model, prompt, 48)
            drafted = [s for s in stats if s.num_draft_tokens]
            assert drafted
            for s in drafted:
                if chunks[-1].stats is s:
                    continue  # the last round may be cut by max_new_tokens or EOS
                assert s.num_accepted == s.tree_depth  # every draft token on the greedy branch accepted
                assert s.num_committed == s.tree_depth + 1  # tokens per round = depth + 1
            assert max(s.tree_depth for s in drafted) == depth


def test_ngram_draft(target):
    with start_stack(target, [NgramProposer(DraftConfig())]) as stack:
        for prompt in PROMPTS:
            tokens, stats, _ = run(stack, prompt, 64)
            assert tokens == hf_greedy(target.model, prompt, 64)


def test_target_only(target):
    with start_stack(target, []) as stack:
        tokens, stats, _ = run(stack, PROMPTS[0], 20, draft="none")
        assert tokens == hf_greedy(target.model, PROMPTS[0], 20)
        assert all(s.num_draft_tokens == 0 for s in stats)


def test_a_target_without_eos_runs_on_like_hf():
    """A generation config naming no EOS: HF greedy runs past the tokenizer's EOS token, and so does the stack (it
    stopped there, 4 tokens short)."""
    target = tiny_loaded(seed=2, eos=False)
    prompt = [238, 163, 194, 216, 269, 84]
    expected = hf_greedy(target.model, prompt, 30)
    assert EOS_ID in expected[:-1] and len(expected) == 30  # the tokenizer's EOS, mid-output
    with start_stack(target, []) as stack:
        tokens, _, chunks = run(stack, prompt, 30, draft="none")
    assert tokens == expected and chunks[-1].finish_reason == "length"


def test_stops_at_eos_like_hf():
    target = tiny_loaded(seed=7)
    prompt = PROMPTS[1]
    eos = hf_greedy(target.model, prompt, 20)[12]  # a token greedy decoding really emits
    target.model.generation_config.eos_token_id = eos
    expected = hf_greedy(target.model, prompt, 80)
    assert expected[-1] == eos and len(expected) <= 13
    with start_stack(target, [NgramProposer(DraftConfig())]) as stack:
        tokens, _, chunks = run(stack, prompt, 80)
    assert tokens == expected
    assert chunks[-1].finish_reason == "eos"
