"""Sampled output with the trained-draft modes (random weights) follows the target's p exactly: by rejection sampling,
and by coupled draws (token-identical to the target alone with the same seed)."""

import pytest

from draft_service.ngram import NgramProposer
from draft_service.proposers import CombinedProposer
from specsplit.config import DraftConfig
from specsplit.launch import start_stack
from specsplit.client import Client
from test_lossless_sampling import N, PROMPT, chi_square_ok, exact_pairs, sample_pairs
from tiny import tiny_eagle, tiny_loaded, tiny_medusa


@pytest.fixture(scope="module")
def target():
    return tiny_loaded(seed=0)


def stack_of(target, mode):
    config = DraftConfig(model_top_k=2, model_depth=2)
    if mode == "medusa":
        return start_stack(target, [], medusa=tiny_medusa(target, num_heads=2, top_k=3, max_nodes=6)), "medusa"
    eagle = tiny_eagle(target, config=config)
    return start_stack(target, [eagle if mode == "eagle" else CombinedProposer(eagle, NgramProposer(config))]), "auto"


@pytest.mark.parametrize("mode", ["eagle", "eagle+ngram", "medusa"])
def test_first_tokens_follow_the_target(target, mode):
    """Rejection sampling (the draft's trees of draws from q)."""
    expected = exact_pairs(target)
    stack, draft = stack_of(target, mode)
    with stack:
        counts, drafted = sample_pairs(stack, N, draft=draft, rejection=True)
    assert drafted > 0  # the draft took part
    stat, critical = chi_square_ok(counts, expected, N)
    assert stat < critical, (stat, critical)


@pytest.mark.parametrize("mode", ["eagle", "eagle+ngram", "medusa"])
def test_coupled_tokens_are_the_target_alone_s(target, mode):
    """Coupled draws (the default): the tokens the target decoding alone draws with the same seed."""
    kwargs = dict(prompt_token_ids=PROMPT, max_new_tokens=24, temperature=1.2, top_p=0.9)
    stack, draft = stack_of(target, mode)
    drafted = 0
    with stack:
        client = Client(stack.address)
        for seed in (1, 2, 3):
            alone = [t for c in client.generate(**kwargs, seed=seed, draft="none") for t in c.token_ids]
            chunks = list(client.generate(**kwargs, seed=seed, draft=draft))
            assert [t for c in chunks for t in c.token_ids] == alone, seed
            drafted += sum(c.stats.num_draft_tokens for c in chunks if c.stats)
    assert drafted > 0
