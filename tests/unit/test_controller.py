"""The budget controller drafts less when its verifier is busy (it pays a share of batched forwards)."""

import bisect
import random

from orchestrator.controller import BudgetController
from verifier_service.batching import cost_shares

# Measured on the project's 2-core CPU: SmolLM2-135M fp32 forward ms by tokens in the forward.
CPU_FORWARD_MS = {1: 51.0, 2: 54.0, 4: 81.0, 8: 89.0, 16: 100.0, 32: 130.0, 64: 180.0, 128: 290.0}
OVERHEAD_TOKENS = 32


def forward_ms(tokens: int) -> float:
    sizes = sorted(CPU_FORWARD_MS)
    i = min(bisect.bisect_left(sizes, tokens), len(sizes) - 1)
    lo, hi = sizes[max(i - 1, 0)], sizes[i]
    if hi == lo:
        return CPU_FORWARD_MS[hi]
    return CPU_FORWARD_MS[lo] + (CPU_FORWARD_MS[hi] - CPU_FORWARD_MS[lo]) * (tokens - lo) / (hi - lo)


def share_ms(k: int, sessions: int) -> float:
    """What a k-node tree costs in a forward shared with sessions - 1 others verifying one token each."""
    lengths = [k + 1] + [1] * (sessions - 1)
    return cost_shares(lengths, OVERHEAD_TOKENS, forward_ms(sum(lengths)))[0]


def mean_budget(sessions: int, accept: float, rounds: int = 600) -> float:
    rng = random.Random(0)
    controller = BudgetController(max_nodes=64)
    budgets = []
    for _ in range(rounds):
        k = controller.choose(64)
        if rng.random() < 0.2:
            k = 0  # an n-gram drafter finds nothing now and then
        accepted = 0
        while accepted < k and rng.random() < accept:
            accepted += 1
        controller.observe(k, accepted, k, share_ms(k, sessions), None)
        budgets.append(k)
    tail = budgets[rounds // 2:]
    return sum(tail) / len(tail)


def test_shares_are_the_whole_forward_when_alone():
    assert share_ms(8, 1) == forward_ms(9)


def test_trees_shrink_when_the_verifier_is_busy():
    alone, busy = mean_budget(1, accept=0.8), mean_budget(16, accept=0.8)
    assert alone >= 6
    assert busy <= alone / 2


def test_a_useless_drafter_is_hardly_used_under_load():
    assert mean_budget(16, accept=0.05) < 0.5
