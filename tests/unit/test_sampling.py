"""Lossless speculative sampling: committed tokens follow the target distribution exactly."""

import itertools

import pytest
import torch

from specsplit.accept import accept_greedy
from specsplit.sampling import (GUMBEL_STREAM, TOP_P_CANDIDATES, SamplingParams, _gumbel_torch, accept_sampled,
                                distribution, gumbel, round_seed, scores, session_generator)
from specsplit.tree import SparseDist, TokenTree

V = 5


def markov(seed: int, sharp: float = 1.0) -> torch.Tensor:
    """[V, V] row-stochastic: next-token distribution given the last token."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, V, generator=g) * sharp).softmax(dim=-1).double()


P = markov(0, 1.5)  # the target
Q = markov(1, 1.0)  # an unrelated draft


def exact_pair(target: torch.Tensor, root: int) -> torch.Tensor:
    """[V, V] exact P(t1, t2) under the target from `root`."""
    return target[root][:, None] * target


# -- tree proposals: each returns (tree, node_q), drawing from the draft exactly as a proposer would ----------
def chain(g, root, depth=3):
    tokens, qs, parents, last = [], [], [], root
    for d in range(depth):
        q = Q[last].float()
        x = int(torch.multinomial(q, 1, generator=g))
        tokens.append(x), qs.append(SparseDist.from_probs(q)), parents.append(d - 1)
        last = x
    return TokenTree(tuple(tokens), tuple(parents), node_q=tuple(qs))


def iid_tree(g, root, k=2, depth=2):
    tokens, parents, qs = [], [], []
    frontier = [(-1, root)]
    for _ in range(depth):
        nxt = []
        for parent, last in frontier:
            q = Q[last].float()
            for x in torch.multinomial(q, k, replacement=True, generator=g).tolist():
                nxt.append((len(tokens), x))
                tokens.append(x), parents.append(parent), qs.append(SparseDist.from_probs(q))
        frontier = nxt
    return TokenTree(tuple(tokens), tuple(parents), node_q=tuple(qs))


def topk_tree(g, root):
    """Deterministic: the draft's top-2 children of the root, top-1 child under each (q one-hot)."""
    first = Q[root].topk(2).indices.tolist()
    tokens, parents = list(first), [-1, -1]
    for i, x in enumerate(first):
        tokens.append(int(Q[x].argmax())), parents.append(i)
    return TokenTree(tuple(tokens), tuple(parents))


def ngram_chain(g, root):
    return TokenTree.chain([1, 2, 3])


def run_pairs(target, proposal, n, seed=0, root=0):
    """Generate two tokens per trial through rounds of propose -> accept; count (t1, t2)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V, dtype=torch.float64)
    for _ in range(n):
        out, last = [], root
        while len(out) < 2:
            tree = proposal(g, last)
            rows = [last] + [tree.token_ids[i] for i in range(len(tree))]
            p = target[rows].float()  # [N+1, V] the Markov target after each row's token
            verdict = accept_sampled(tree, p, tree.node_q, g)
            out.extend(verdict.committed_token_ids)
            last = out[-1]
        counts[out[0], out[1]] += 1
    return counts / n


def tv(a, b):
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.parametrize("proposal", [chain, iid_tree, topk_tree, ngram_chain])
def test_output_distribution_converges_to_target(proposal):
    exact = exact_pair(P, 0)
    small = tv(run_pairs(P, proposal, 300, seed=1), exact)
    large = tv(run_pairs(P, proposal, 6000, seed=2), exact)
    random_dist = torch.rand(V, V, generator=torch.Generator().manual_seed(3)).double()
    random_dist /= random_dist.sum()
    assert large < 0.05, large
    assert large < small  # shrinking with samples
    assert tv(run_pairs(P, proposal, 6000, seed=2), random_dist) > 4 * large  # far from other distributions


def test_draft_equal_to_target_accepts_everything():
    global Q
    saved, Q = Q, P
    try:
        g = torch.Generator().manual_seed(0)
        accepted = 0
        for _ in range(300):
            tree = chain(g, 0, depth=3)
            rows = [0] + list(tree.token_ids)
            verdict = accept_sampled(tree, P[rows].float(), tree.node_q, g)
            accepted += len(verdict.accepted_nodes)
        assert accepted == 900  # p == q: min(1, p/q) = 1 for every token
    finally:
        Q = saved


def test_masked_tokens_are_never_emitted():
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.1, -1.0]])
    params = SamplingParams(temperature=0.7, top_k=3, top_p=0.8)
    p = distribution(logits, params)[0]
    allowed = set(p.nonzero().flatten().tolist())
    assert allowed and allowed <= {0, 1, 2}
    target = p.double().expand(V, V).clone()  # same distribution after every token
    g = torch.Generator().manual_seed(0)
    for _ in range(2000):
        tree = chain(g, 0, depth=2)  # the draft proposes any token, masked ones included
        rows = [0] + list(tree.token_ids)
        verdict = accept_sampled(tree, target[rows].float(), tree.node_q, g)
        assert set(verdict.committed_token_ids) <= allowed


def test_distribution_top_k_top_p_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert torch.allclose(distribution(logits, SamplingParams(temperature=1.0)), logits.softmax(-1))
    assert torch.allclose(distribution(logits, SamplingParams(temperature=0.5)), (logits / 0.5).softmax(-1))
    top2 = distribution(logits, SamplingParams(temperature=1.0, top_k=2))
    assert top2[0, 2:].sum() == 0 and torch.isclose(top2.sum(), torch.tensor(1.0))
    # top-p keeps the smallest prefix whose mass reaches p: here the first token alone has 0.64
    top_p = distribution(logits, SamplingParams(temperature=1.0, top_p=0.6))
    assert top_p[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    top_p = distribution(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert (top_p[0] > 0).tolist() == [True, True, False, False]


def test_one_hot_target_is_greedy():
    """At the greedy limit (p one-hot at the argmax) sampling acceptance is greedy acceptance."""
    g = torch.Generator().manual_seed(0)
    tree = TokenTree((5 % V, 1, 2, 3), (-1, -1, 1, 2))
    for argmax in itertools.product(range(V), repeat=len(tree) + 1):
        p = torch.nn.functional.one_hot(torch.tensor(argmax), V).float()
        assert accept_sampled(tree, p, (), g) == accept_greedy(tree, list(argmax))


def test_deterministic_when_seeded():
    def once():
        g = torch.Generator().manual_seed(42)
        return [accept_sampled(chain(g, 0), P[[0, 1, 2, 3]].float(), chain(g, 0).node_q, g).committed_token_ids
                for _ in range(50)]

    assert once() == once()


def test_q_used_is_the_q_sampled_from():
    """A draft that samples from a truncated q but claims the full distribution is biased; the exact q is not."""
    def truncated(g, root):
        q = distribution(torch.log(Q[root]).float()[None], SamplingParams(temperature=1.0, top_k=2))[0]
        x = int(torch.multinomial(q, 1, generator=g))
        return TokenTree((x,), (-1,), node_q=(SparseDist.from_probs(q),))

    def mislabelled(g, root):
        tree = truncated(g, root)
        return TokenTree(tree.token_ids, tree.parents, node_q=(SparseDist.from_probs(Q[root].float()),))

    exact = exact_pair(P, 0)
    honest = tv(run_pairs(P, truncated, 6000, seed=5), exact)
    wrong = tv(run_pairs(P, mislabelled, 6000, seed=5), exact)
    assert honest < 0.05 and wrong > 2 * honest


def test_the_largest_seed_a_request_may_carry_seeds_every_stream():
    """--seed takes 0 .. 2^64 - 1; rejection sampling's draft stream (seed + 1) wraps instead of overflowing torch's
    seed, and coupled draws key their noise with it."""
    top = SamplingParams(temperature=0.7, seed=(1 << 64) - 1, rejection=True)
    target, draft = session_generator(top, stream=0), session_generator(top, stream=1)
    assert draft.initial_seed() == 0 and target.initial_seed() == (1 << 64) - 1
    coupled = SamplingParams(temperature=0.7, seed=(1 << 64) - 1)
    assert session_generator(coupled) is None and torch.isfinite(scores(torch.randn(2, 8), coupled, [3, 4])).all()


# -- coupled draws: argmax(log p + Gumbel noise of (seed, position)) ---------------------------------------------------
COUPLED = SamplingParams(temperature=0.9, top_k=4, seed=0)


def test_coupled_draws_follow_the_target():
    """Over seeds, the argmax of the coupled scores is distributed as p (top-k cut included); a coupled draw of a
    different p, the same seeds, is not."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])  # [1, 6]
    p = distribution(logits, COUPLED)[0].double()  # [6], 0 at the two cut tokens
    n = 6000
    counts = torch.zeros(6, dtype=torch.float64)
    shifted = torch.zeros(6, dtype=torch.float64)
    for seed in range(n):
        params = SamplingParams(COUPLED.temperature, COUPLED.top_k, seed=seed)
        counts[int(scores(logits, params, [17]).argmax())] += 1
        shifted[int(scores(logits.flip(-1), params, [17]).argmax())] += 1
    assert counts[4] == counts[5] == 0  # cut by top-k: never drawn
    assert tv(counts / n, p) < 0.02
    assert tv(shifted / n, p) > 0.2


def test_coupled_noise_depends_on_seed_and_position_alone():
    """The same (seed, position) gives the same noise at any vocabulary width (a draft narrower or padded wider than
    the target), on a draft's own vocabulary subset too, and from the torch code a GPU runs (the same bits: only the
    logarithms may round differently); another position or seed, other noise."""
    wide = gumbel(5, 40, 10000)  # [10000]
    assert torch.equal(gumbel(5, 40, 4097), wide[:4097])
    # within a few ulps: torch's vectorised log differs from numpy's by up to 2.6e-15 relative on an AVX-512 Zen 4
    assert torch.allclose(_gumbel_torch(round_seed(5, 40, GUMBEL_STREAM), 10000, "cpu"), wide, rtol=1e-14, atol=1e-15)
    assert not torch.equal(gumbel(5, 41, 10000), wide) and not torch.equal(gumbel(6, 40, 10000), wide)
    ids = torch.tensor([3, 9999, 4096, 7])  # [V'] a draft's vocabulary as target ids
    logits = torch.randn(2, 4)  # [2, V']
    params = SamplingParams(temperature=1.0, seed=5)
    got = scores(logits, params, [40, 40], vocab_ids=ids) - logits.double() / params.temperature  # [2, V']
    assert torch.allclose(got, wide[ids].expand(2, -1))


def test_coupled_scores_are_logits_for_greedy_and_rejection_sampling():
    logits = torch.randn(3, 8)
    assert scores(logits, SamplingParams(), [0, 1, 2]) is logits
    assert scores(logits, SamplingParams(temperature=1.0, rejection=True), [0, 1, 2]) is logits


def test_top_p_over_a_wide_vocabulary_is_the_full_sort_s():
    """Top-p looks among the likeliest TOP_P_CANDIDATES tokens first: the same distribution as sorting them all, for a
    peaked row (the set lies among them) and a flat one (it does not: everything is sorted)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.stack([torch.randn(5000, generator=g) * 4, torch.randn(5000, generator=g) * 0.1])  # [2, 5000]
    params = SamplingParams(temperature=0.8, top_p=0.9)
    probs = (logits / params.temperature).softmax(dim=-1)  # [2, 5000]
    ranked, order = probs.sort(dim=-1, descending=True)
    keep = (ranked.cumsum(dim=-1) - ranked) < params.top_p  # [2, 5000] the smallest set holding 0.9, in rank order
    want = torch.zeros_like(probs).scatter(-1, order, ranked * keep)
    want = want / want.sum(dim=-1, keepdim=True)
    got = distribution(logits, params)
    assert (got[0] > 0).sum() < TOP_P_CANDIDATES < (got[1] > 0).sum()  # both paths taken
    assert torch.allclose(got, want, atol=1e-7)
