"""End to end on tiny random models: sampled output through the gRPC pipeline follows the target's p, by coupled
draws (the default: also token-identical to the target decoding alone with the same seed, whatever the draft) and by
rejection sampling."""

import math

import pytest
import torch

from draft_service.ngram import NgramProposer
from draft_service.proposers import ModelProposer
from specsplit.client import Client
from specsplit.config import DraftConfig, OrchestratorConfig
from specsplit.launch import start_stack
from specsplit.sampling import SamplingParams, distribution
from tiny import hold_each_forward, tiny_loaded

PROMPT = [258, 1, 2, 3, 4, 5, 1, 2, 3]
PARAMS = SamplingParams(temperature=6.0, top_k=24, top_p=0.95)
N = 1200


@pytest.fixture(scope="module")
def target():
    return tiny_loaded(seed=0)


def exact_pairs(target) -> dict[tuple[int, int], float]:
    """P(t1, t2) of the target alone under PARAMS, by enumeration."""
    with torch.no_grad():
        p1 = distribution(target.model(torch.tensor([PROMPT])).logits[0, -1:], PARAMS)[0]
        pairs = {}
        for t1 in p1.nonzero().flatten().tolist():
            p2 = distribution(target.model(torch.tensor([PROMPT + [t1]])).logits[0, -1:], PARAMS)[0]
            for t2 in p2.nonzero().flatten().tolist():
                pairs[(t1, t2)] = float(p1[t1] * p2[t2])
    return pairs


def chi_square_ok(counts: dict, expected: dict, n: int) -> tuple[float, float]:
    """Chi-square statistic over bins with expected count >= 5 (the rest pooled) and a 0.1% critical value."""
    bins, pooled_obs, pooled_exp = [], 0, 0.0
    for key, prob in expected.items():
        if prob * n >= 5:
            bins.append((counts.get(key, 0), prob * n))
        else:
            pooled_obs += counts.get(key, 0)
            pooled_exp += prob * n
    pooled_obs += sum(c for k, c in counts.items() if k not in expected)  # impossible outcomes count too
    bins.append((pooled_obs, max(pooled_exp, 1e-9)))
    stat = sum((o - e) ** 2 / e for o, e in bins)
    k = len(bins) - 1
    critical = k * (1 - 2 / (9 * k) + 3.09 * math.sqrt(2 / (9 * k))) ** 3  # Wilson-Hilferty, alpha = 0.001
    return stat, critical


def sample_pairs(stack, n, draft="auto", rejection=False):
    counts: dict[tuple[int, int], int] = {}
    client = Client(stack.address)
    drafted = 0
    for seed in range(n):
        chunks = list(client.generate(prompt_token_ids=PROMPT, max_new_tokens=2, temperature=PARAMS.temperature,
                                      top_k=PARAMS.top_k, top_p=PARAMS.top_p, seed=seed, draft=draft,
                                      rejection_sampling=rejection))
        tokens = [t for c in chunks for t in c.token_ids]
        drafted += sum(c.stats.num_draft_tokens for c in chunks if c.stats)
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    return counts, drafted


PROPOSERS = {
    "unrelated": lambda: ModelProposer(tiny_loaded(seed=99, layers=1), DraftConfig(model_top_k=2, model_depth=2)),
    "same": lambda: ModelProposer(tiny_loaded(seed=0), DraftConfig(model_top_k=2, model_depth=2)),
    "ngram": lambda: NgramProposer(DraftConfig()),
}


@pytest.mark.parametrize("rejection", [False, True], ids=["coupled", "rejection"])
@pytest.mark.parametrize("drafter", ["unrelated", "same", "ngram"])
def test_first_tokens_follow_the_target(target, drafter, rejection):
    expected = exact_pairs(target)
    with start_stack(target, [PROPOSERS[drafter]()]) as stack:
        counts, drafted = sample_pairs(stack, N, rejection=rejection)
    assert drafted > 0  # the draft took part
    stat, critical = chi_square_ok(counts, expected, N)
    assert stat < critical, (stat, critical)


def test_chi_square_rejects_a_wrong_distribution(target):
    """The check above has teeth: samples from a different temperature fail it."""
    expected = exact_pairs(target)
    g = torch.Generator().manual_seed(0)
    wrong = SamplingParams(temperature=3.0, top_k=24, top_p=0.95)
    counts: dict = {}
    with torch.no_grad():
        p1 = distribution(target.model(torch.tensor([PROMPT])).logits[0, -1:], wrong)[0]
        for _ in range(N):
            t1 = int(torch.multinomial(p1, 1, generator=g))
            p2 = distribution(target.model(torch.tensor([PROMPT + [t1]])).logits[0, -1:], wrong)[0]
            t2 = int(torch.multinomial(p2, 1, generator=g))
            counts[(t1, t2)] = counts.get((t1, t2), 0) + 1
    stat, critical = chi_square_ok(counts, expected, N)
    assert stat > critical


@pytest.mark.parametrize("rejection", [False, True], ids=["coupled", "rejection"])
def test_seeded_requests_are_reproducible(target, rejection):
    with start_stack(target, [ModelProposer(tiny_loaded(seed=99, layers=1))]) as stack:
        client = Client(stack.address)

        def once(seed):
            return [t for c in client.generate(prompt_token_ids=PROMPT, max_new_tokens=24, temperature=1.5,
                                               seed=seed, rejection_sampling=rejection) for t in c.token_ids]

        assert once(7) == once(7)
        assert once(7) != once(8)


def test_coupled_tokens_are_the_target_alone_s_whatever_the_draft(target, monkeypatch):
    """Coupled draws: a seed gives the tokens the target decoding alone draws with it (draft none), with an unrelated
    draft, the target itself as the draft, or n-gram lookup; the model drafts stream growing trees and keep provisional
    tokens (the pipelined path greedy sessions take). The target as its own draft makes the target's own choices:
    each round the verifier accepts the draft's first-choice chain to its end, so the draft's noise is the target's.
    (For that one, fixed-4 trees and verifier forwards held 20 ms: provisional tokens then always arrive during a
    verification; with the default trigger and a verifier as fast as the draft, a run now and then kept none.)"""
    kwargs = dict(prompt_token_ids=PROMPT, max_new_tokens=40, temperature=1.2, top_p=0.9)
    pipelined = OrchestratorConfig(trigger="fixed", fixed_tree_nodes=4, share_estimates=False)
    for seed in (1, 2, 3):
        with start_stack(target, []) as alone:
            reference = [t for c in Client(alone.address).generate(**kwargs, seed=seed, draft="none")
                         for t in c.token_ids]
        for drafter in PROPOSERS:
            same = drafter == "same"
            with start_stack(target, [PROPOSERS[drafter]()], orchestrator_config=pipelined if same else None) as stack:
                if same:
                    hold_each_forward(stack.verifier_engine, monkeypatch)
                chunks = list(Client(stack.address).generate(**kwargs, seed=seed))
            rounds = [c.stats for c in chunks if c.stats]
            assert [t for c in chunks for t in c.token_ids] == reference, (seed, drafter)
            assert sum(r.num_draft_tokens for r in rounds) > 0, (seed, drafter)
            if drafter == "same":
                assert sum(r.provisional_kept for r in rounds) > 0, seed
                assert all(r.num_accepted == r.tree_depth for r in rounds if r.num_draft_tokens), (seed, rounds)
