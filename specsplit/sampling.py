"""Sampling: the target distribution p, the draft's truncated q, and lossless acceptance over trees.

Terms: p is the target's distribution at a tree row (temperature, then top-k, then top-p, renormalised);
q is the distribution a draft token was actually drawn from, sent sparse as (ids, probs). A node with
no q was proposed deterministically (q is one-hot on its token: n-gram lookup, top-k trees).

Two exact ways to verify a sampled session's tree (``SamplingParams.rejection`` picks one):

- Coupled (the default; Daliri, Musco & Suresh, "Coupling without communication and drafter-invariant
  speculative decoding", 2024): the token at sequence position i is argmax_v(log p(v) + g_i(v)), where g_i
  is i.i.d. Gumbel noise drawn from (seed, i) alone (``gumbel``): by the Gumbel-max trick an exact draw
  from p, the same draw the target decoding alone with that seed makes. Draft and verifier draw the same
  g_i, so the draft proposes its own argmax(log q + g_i) and the verifier accepts a node exactly when its
  token is the target's choice: greedy acceptance on perturbed scores. The output does not depend on the
  draft, the tree, the trigger or the network (a seed gives the same tokens however they were drafted),
  and drafted tokens need no q, so sampled sessions stream growing trees and draft provisionally as
  greedy ones do.
- Recursive rejection sampling (SpecInfer / SpecTr): at a node, try its children in order; child x drawn
  from q_x is accepted with probability min(1, p(x) / q_x(x)); after a rejection p becomes the normalised
  residual max(0, p - q_x) and the next child is tried. If every child is rejected, the recovered token
  is drawn from the residual; after an accepted leaf the bonus token is drawn from p. Each step is one
  exact speculative-sampling step against the current residual, so the committed tokens follow p exactly.
  The draft sends each node's q; its tokens depend on the tree, so only the Propose path's whole trees use it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from specsplit.accept import Verdict
from specsplit.errors import InvalidArgument
from specsplit.tree import SparseDist, TokenTree


MIN_TEMPERATURE = 1e-4  # the smallest sampled temperature (one below is as good as greedy, and can overflow)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax); the output is then token-identical to greedy decoding
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1 (or 0): off
    seed: int | None = None  # same seed, same tokens (rejection sampling: and the same draft)
    rejection: bool = False  # sampled: recursive rejection sampling against the draft's q instead of coupled draws

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def rejection_sampled(self) -> bool:
        """Sampled by rejection sampling: draft tokens are draws from q, sent with it, in whole (Propose) trees."""
        return self.rejection and not self.greedy

    @property
    def coupled(self) -> bool:
        """Sampled with coupled draws (module docstring): verified, drafted and streamed like greedy, on ``scores``."""
        return not self.greedy and not self.rejection

    def check_seeded(self) -> None:
        """A service's session (verifier, draft): coupled draws come from the session's seed, which both sides must
        share (the orchestrator sends the request's, or one it drew); without one they would all draw seed 0's."""
        if self.coupled and self.seed is None:
            raise InvalidArgument("sampling by coupled draws needs the session's seed (the orchestrator sends one): "
                                  "set seed, or rejection=true")

    def validate(self) -> None:
        if not self.temperature >= 0.0 or self.temperature != self.temperature:
            raise InvalidArgument(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # (below ~1e-37 the scaled logits overflow float32: NaN draws)
            raise InvalidArgument(f"temperature {self.temperature} is too small to sample at: use 0 (greedy) or at "
                                  f"least {MIN_TEMPERATURE}")
        if self.temperature > 100.0:
            raise InvalidArgument(f"temperature {self.temperature} is too large (at most 100)")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in [0, 1] (0 or 1 = off), got {self.top_p}")


def session_generator(sampling: SamplingParams, stream: int = 0) -> torch.Generator | None:
    """A rejection-sampling session's own RNG (None for greedy or coupled draws): seeded ``seed + stream`` when the
    session has a seed (stream 0: the target's, 1: the draft's), from the OS otherwise."""
    if not sampling.rejection_sampled:
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


TOP_P_CANDIDATES = 1024  # top-p looks for its set among this many likeliest tokens first


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] probabilities from [R, V] logits: temperature, then top-k, then top-p (HF's order)."""
    scores = logits.float() / params.temperature  # [R, V]
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = scores.topk(params.top_k, dim=-1).values[..., -1:]  # [R, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(dim=-1)  # [R, V]
    if 0.0 < params.top_p < 1.0:
        # The kept set is a prefix of the tokens sorted by probability: the TOP_P_CANDIDATES likeliest hold it
        # whenever their mass reaches top_p (a full sort of a 49k vocabulary costs ~10x their topk on a CPU).
        sorted_probs, order = probs.topk(min(TOP_P_CANDIDATES, probs.shape[-1]), dim=-1)  # [R, C]
        if sorted_probs.shape[-1] < probs.shape[-1] and bool((sorted_probs.sum(dim=-1) < params.top_p).any()):
            sorted_probs, order = probs.sort(dim=-1, descending=True)  # [R, V]
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly before each token
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)  # keep the smallest set >= top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


GUMBEL_STREAM = 2  # round_seed's stream for the coupled draws' noise (0, 1: the target's and the draft's generators)
GUMBEL_CACHE = 256  # positions' noise rows kept per device (0.4 MB each for a 49k vocabulary)
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's constants


def _int64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 tensors, bit for bit on any device (products wrap mod 2^64; each right
    shift is masked to a logical one, int64 shifts being arithmetic)."""
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * _int64(_MIX1)
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * _int64(_MIX2)
    return x ^ ((x >> 31) & ((1 << 33) - 1))


@functools.lru_cache(maxsize=GUMBEL_CACHE)
def gumbel(seed: int, position: int, vocab_size: int, device: str = "cpu") -> torch.Tensor:
    """[V] float64 i.i.d. Gumbel(0, 1) noise of token ids 0..V-1 at sequence position ``position`` (the index of the
    token it picks): id v's is splitmix64 of (the 64-bit key of seed and position) + v·golden, so a function of (seed,
    position, id) alone, the same on every device and for any vocabulary width (a draft whose logits are narrower or
    padded wider), from integer arithmetic any machine does alike (numpy on a CPU, faster; torch elsewhere: the same
    bits). Cached (do not modify it): a round's rows past the committed tokens are read again next round, and a tree's
    rows of one depth share a position."""
    key = round_seed(seed, position, stream=GUMBEL_STREAM)
    return _gumbel_numpy(key, vocab_size) if device == "cpu" else _gumbel_torch(key, vocab_size, device)


def _gumbel_numpy(key: int, vocab_size: int) -> torch.Tensor:
    x = np.arange(vocab_size, dtype=np.uint64) * np.uint64(_GOLDEN) + np.uint64(key)  # [V] (uint64 wraps)
    for shift, mul in ((30, _MIX1), (27, _MIX2)):
        x = (x ^ (x >> np.uint64(shift))) * np.uint64(mul)
    x = x ^ (x >> np.uint64(31))  # [V] 64 random bits each
    u = ((x >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53  # [V] uniform in (0, 1), 53 bits
    return torch.from_numpy(-np.log(-np.log(u)))


def _gumbel_torch(key: int, vocab_size: int, device: str) -> torch.Tensor:
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)  # [V]
    bits = _splitmix64(ids * _int64(_GOLDEN) + _int64(key))  # [V] the same bits as _gumbel_numpy's
    u = (((bits >> 11) & ((1 << 53) - 1)).double() + 0.5) * 2.0 ** -53  # [V]
    return -torch.log(-torch.log(u))


def scores(logits: torch.Tensor, params: SamplingParams, positions: list[int],
           vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[R, V'] coupled scores log p(v) + g_i(v) (up to a constant per row) from [R, V'] logits, row r picking the token
    at sequence position ``positions[r]`` (float64, on the logits' device): their argmax is the coupled draw, an exact
    draw from p. ``vocab_ids``: [V'] the target ids of the columns when they are not 0..V'-1 (a draft's own
    vocabulary). Greedy or rejection sampling: the logits as they are."""
    if not params.coupled:
        return logits
    assert params.seed is not None, "coupled draws need the session's seed (SamplingParams.check_seeded)"
    if 0.0 < params.top_p < 1.0:
        log_p = distribution(logits, params).double().log()  # [R, V'] (-inf where top-k/top-p cut)
    else:  # log p up to its normaliser: logits / temperature, top-k's cut at -inf
        log_p = logits.double() / params.temperature  # [R, V']
        if params.top_k and params.top_k < log_p.shape[-1]:
            log_p = log_p.masked_fill(log_p < log_p.topk(params.top_k, dim=-1).values[..., -1:], float("-inf"))
    width = logits.shape[-1] if vocab_ids is None else int(vocab_ids.max()) + 1
    device = str(logits.device)
    noise = {i: gumbel(params.seed, i, width, device) for i in set(positions)}  # position -> [W]
    return log_p + torch.stack([noise[i] if vocab_ids is None else noise[i][vocab_ids] for i in positions])


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
