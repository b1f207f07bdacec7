"""Sampled output with the trained-draft modes (random weights) follows the target's p exactly."""

import pytest

from draft_service.ngram import NgramProposer
from draft_service.proposers import CombinedProposer
from specsplit.config import DraftConfig
from specsplit.launch import start_stack
from test_lossless_sampling import N, chi_square_ok, exact_pairs, sample_pairs
from tiny import tiny_eagle, tiny_loaded, tiny_medusa


@pytest.fixture(scope="module")
def target():
    return tiny_loaded(seed=0)


@pytest.mark.parametrize("mode", ["eagle", "eagle+ngram", "medusa"])
def test_first_tokens_follow_the_target(target, mode):
    config = DraftConfig(model_top_k=2, model_depth=2)
    if mode == "medusa":
        proposers, medusa, draft = [], tiny_medusa(target, num_heads=2, top_k=3, max_nodes=6), "medusa"
    else:
        eagle = tiny_eagle(target, config=config)
        proposers = [eagle if mode == "eagle" else CombinedProposer(eagle, NgramProposer(config))]
        medusa, draft = None, "auto"
    expected = exact_pairs(target)
    with start_stack(target, proposers, medusa=medusa) as stack:
        counts, drafted = sample_pairs(stack, N, draft=draft)
    assert drafted > 0  # the draft took part
    stat, critical = chi_square_ok(counts, expected, N)
    assert stat < critical, (stat, critical)
