"""How many draft tokens to ask for each round: the expected committed tokens per second.

Each round costs ``verify(k) + draft(k) + overhead`` and commits ``1 + E[accepted | k]`` tokens.
Acceptance is modelled as a per-token probability ``a`` (decayed counts with a prior, so a drafter
that went quiet is probed again later); verify cost is measured per tree size, starting from a prior
shape (CPU fp32 ratios measured on SmolLM2-135M) scaled by the measured cost of a 1-token round.
A budget of 0 means "decode with the target alone this round".
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Tree size -> verify cost relative to a 1-token forward (CPU fp32, 200-token cache).
PRIOR_COST_RATIO = {0: 1.0, 1: 1.12, 2: 1.25, 4: 1.57, 8: 1.87, 16: 2.02, 32: 2.4, 64: 3.6}
SIZES = sorted(PRIOR_COST_RATIO)


@dataclass
class BudgetController:
    max_nodes: int = 64
    prior_accept: float = 0.5  # per-token acceptance before any evidence
    prior_weight: float = 2.0  # how many draft tokens of evidence the prior is worth
    decay: float = 0.97  # per round; old evidence fades, a silent drafter gets probed again
    ema: float = 0.3  # weight of a new cost measurement
    accepted: float = 0.0  # decayed accepted draft tokens
    trials: float = 0.0  # decayed draft tokens that had a chance to be accepted
    verify_ms: dict[int, float] = field(default_factory=dict)  # size bucket -> measured ms
    draft_ms: float = 0.0  # measured draft cost of a non-empty proposal
    overhead_ms: float = 0.5  # a round's fixed cost beyond the verify forward (RPCs, bookkeeping)
    # Seeded requests must give the same tokens run after run: budgets then follow acceptance alone
    # (prior cost shape, no wall-clock measurements), so the same trees are drafted every time.
    deterministic: bool = False

    @property
    def accept_rate(self) -> float:
        return (self.accepted + self.prior_accept * self.prior_weight) / (self.trials + self.prior_weight)

    def expected_accepted(self, k: int) -> float:
        """E[accepted] for a chain of k draft tokens: sum of a^i."""
        a = self.accept_rate
        return sum(a**i for i in range(1, k + 1))

    def verify_cost(self, k: int) -> float:
        """Estimated verify ms for a tree of k nodes: measured where we have it, else prior-shaped."""
        bucket = _bucket(k)
        if bucket in self.verify_ms:
            return self.verify_ms[bucket]
        base = self.verify_ms.get(0)
        if base is None:
            measured = next(iter(self.verify_ms.items()), None)
            base = measured[1] / PRIOR_COST_RATIO[measured[0]] if measured else 1.0
        return base * PRIOR_COST_RATIO[bucket]

    def choose(self, limit: int) -> int:
        """The budget k in [0, min(limit, max_nodes)] maximising expected committed tokens per ms."""
        best_k, best_rate = 0, 0.0
        for k in [0, *(s for s in SIZES[1:] if s <= min(limit, self.max_nodes))]:
            cost = self.verify_cost(k) + self.overhead_ms + (self.draft_ms if k else 0.0)
            rate = (1.0 + self.expected_accepted(k)) / cost
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def observe(self, num_draft_tokens: int, accepted_depth: int, tree_depth: int, verify_ms: float,
                draft_ms: float | None) -> None:
        """Record one round: the tree's size and depth, how deep acceptance went, what it cost."""
        self.accepted *= self.decay
        self.trials *= self.decay
        if tree_depth > 0:
            self.accepted += accepted_depth
            self.trials += min(accepted_depth + 1, tree_depth)
        if self.deterministic:
            return
        bucket = _bucket(num_draft_tokens)
        old = self.verify_ms.get(bucket)
        self.verify_ms[bucket] = verify_ms if old is None else (1 - self.ema) * old + self.ema * verify_ms
        if draft_ms is not None and num_draft_tokens:
            self.draft_ms = (1 - self.ema) * self.draft_ms + self.ema * draft_ms


def _bucket(k: int) -> int:
    """The prior-table size nearest at or above k."""
    return SIZES[min(bisect.bisect_left(SIZES, k), len(SIZES) - 1)]
