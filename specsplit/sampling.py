"""Sampling: the target distribution p, the draft's truncated q, and lossless acceptance over trees.

Terms: p is the target's distribution at a tree row (temperature, then top-k, then top-p, renormalised);
q is the distribution a draft token was actually drawn from, sent sparse as (ids, probs). A node with
no q was proposed deterministically (q is one-hot on its token: n-gram lookup, top-k trees).

Recursive rejection sampling (SpecInfer / SpecTr): at a node, try its children in order; child x drawn
from q_x is accepted with probability min(1, p(x) / q_x(x)); after a rejection p becomes the normalised
residual max(0, p - q_x) and the next child is tried. If every child is rejected, the recovered token
is drawn from the residual; after an accepted leaf the bonus token is drawn from p. Each step is one
exact speculative-sampling step against the current residual, so the committed tokens follow p exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsplit.accept import Verdict
from specsplit.errors import InvalidArgument
from specsplit.tree import SparseDist, TokenTree


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax); the output is then token-identical to greedy decoding
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1 (or 0): off
    seed: int | None = None  # same seed, same draft, same tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not self.temperature >= 0.0 or self.temperature != self.temperature:
            raise InvalidArgument(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature > 100.0:
            raise InvalidArgument(f"temperature {self.temperature} is too large (at most 100)")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in [0, 1] (0 or 1 = off), got {self.top_p}")


def session_generator(sampling: SamplingParams, stream: int = 0) -> torch.Generator | None:
    """A sampling session's own RNG (None for greedy): seeded ``seed + stream`` when the session has a seed
    (stream 0: the target's, 1: the draft's), from the OS otherwise."""
    if sampling.greedy:
        return None
    generator = torch.Generator()
    # (mod 2^64: a request's seed may be 2^64 - 1, the largest torch takes)
    generator.manual_seed((sampling.seed + stream) % (1 << 64)) if sampling.seed is not None else generator.seed()
    return generator


def round_seed(seed: int, committed_length: int, stream: int = 0) -> int:
    """The RNG seed of the round that starts at ``committed_length`` tokens (splitmix64 of all three).

    stream: 0 for the target's draws, 1 for the draft's (independent of any session's target draws).

    Drawing each round's randomness from (seed, position) instead of one long-lived generator lets a
    session move to another replica, or resume after a restart, and continue with the same draws.
    """
    mask = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + (committed_length + 1) * 0xD1B54A32D192ED03 + stream * 0x8CB92BA72F3D8DD7) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) >> 1  # 63 bits


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] probabilities from [R, V] logits: temperature, then top-k, then top-p (HF's order)."""
    scores = logits.float() / params.temperature  # [R, V]
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = scores.topk(params.top_k, dim=-1).values[..., -1:]  # [R, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(dim=-1)  # [R, V]
    if 0.0 < params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # [R, V]
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly before each token
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)  # keep the smallest set >= top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a [V] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


def accept_sampled(tree: TokenTree, p: torch.Tensor, node_q: tuple[SparseDist | None, ...],
                   generator: torch.Generator, max_commit: int = 0) -> Verdict:
    """Recursive rejection sampling over the tree.

    p: [N+1, V] target distribution after each row (row 0 = root, row i+1 = node i).
    node_q: [N] the distribution each node's token was drawn from (None: one-hot on the token).
    """
    assert p.shape[0] == len(tree) + 1, (p.shape, len(tree))
    assert len(node_q) in (0, len(tree))
    vocab = p.shape[-1]
    children = tree.child_lists
    accepted: list[int] = []
    node, row = -1, 0
    while True:
        residual = p[row].double()  # [V]
        if max_commit > 0 and len(accepted) + 1 >= max_commit:
            break
        chosen = None
        for child in children.get(node, ()):
            x = tree.token_ids[child]
            q = node_q[child] if node_q else None
            if q is None:
                q_x = 1.0
            else:
                q_dense = q.dense(vocab, residual.device).double()  # [V]
                q_x = float(q_dense[x])
            if q_x > 0.0 and float(torch.rand((), generator=generator, dtype=torch.float64)) * q_x < float(residual[x]):
                chosen = child  # u < p(x) / q(x), written without the division
                break
            # Rejected: p <- norm(max(0, p - q)).
            if q is None:
                update = residual.clone()
                update[x] = 0.0
            else:
                update = (residual - q_dense).clamp_min(0.0)
            total = float(update.sum())
            if total > 0.0:
                residual = update / total
        if chosen is None:
            break
        accepted.append(chosen)
        node, row = chosen, chosen + 1
    return Verdict.along(tree, accepted, sample(residual.float(), generator))
