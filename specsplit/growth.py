"""Width-adaptive token-tree growth (EdgeLLM/LLMCad): confident branches go deeper, likely alternatives branch.

Pure: the draft model is behind an ``expand`` callback, so the policy is tested with hand-made
distributions. One call of ``expand`` is one draft forward over *all* frontier nodes (the branch
decoder: a tree mask over the draft's KV cache, no per-branch context switch, no re-prefill).

Terms: a node's **confidence** is the product of the draft probabilities along its path from the root
(the branch confidence of the branch ending there). Each step expands the frontier: every frontier
node's most probable child extends its branch, and any other candidate whose own probability is above
``branch_threshold`` opens a new branch. The next frontier is the new nodes, most confident first, at
most ``max_width`` of them and only those within ``min_relative`` of the most confident one: weak
branches stop, confident ones keep going deeper. Nothing is ever added past ``max_nodes``. A branch also
ends at a stop token (``stop_token_ids``: the target's EOS): generation ends there, so nothing drafted after
it could ever be committed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from specsplit.tree import GrowthStep, path_to

# frontier node indices (-1 = the root) -> per frontier node, candidate (token, prob) pairs, most probable first
Expand = Callable[[list[int]], list[list[tuple[int, float]]]]


@dataclass
class GrowthPolicy:
    branch_threshold: float = 0.3  # LLMCad: a candidate above 0.3 opens a new branch
    max_width: int = 4  # frontier nodes per draft forward (one forward expands them all)
    min_relative: float = 0.05  # a branch below 5% of the best branch's confidence stops growing
    max_depth: int = 32  # draft forwards per tree at most
    stop_token_ids: frozenset[int] = frozenset()  # a branch ends at one of these (the target's EOS ids)


@dataclass
class GrowingTree:
    """The tree so far, in the order nodes were added (parents always before children)."""

    token_ids: list[int] = field(default_factory=list)  # [N]
    parents: list[int] = field(default_factory=list)  # [N] -1 = under the root
    draft_probs: list[float] = field(default_factory=list)  # [N] q(token | ancestors)
    confidence: list[float] = field(default_factory=list)  # [N] product of draft_probs along the path

    def __len__(self) -> int:
        return len(self.token_ids)

    def add(self, parent: int, token: int, prob: float) -> int:
        base = 1.0 if parent < 0 else self.confidence[parent]
        self.token_ids.append(token)
        self.parents.append(parent)
        self.draft_probs.append(prob)
        self.confidence.append(base * prob)
        return len(self.token_ids) - 1

    def set_prob(self, node: int, prob: float) -> None:
        """``node``'s draft probability, known only now (a copied token the draft then scored); its confidence is
        recomputed from its parent's (so a chain's nodes are set root down)."""
        parent = self.parents[node]
        self.draft_probs[node] = prob
        self.confidence[node] = (1.0 if parent < 0 else self.confidence[parent]) * prob

    def truncate(self, n: int) -> None:
        """Drop nodes from index n on (nodes streamed after the ones sent for verification)."""
        for values in (self.token_ids, self.parents, self.draft_probs, self.confidence):
            del values[n:]

    def path_to(self, node: int) -> list[int]:
        return path_to(self.parents, node)


def children_to_add(tree: GrowingTree, frontier: list[int], candidates: list[list[tuple[int, float]]],
                    threshold: float, budget: int) -> list[tuple[int, int, float]]:
    """(parent, token, prob) to add: each frontier node's top child, plus others above ``threshold``.

    Under a budget, the most confident candidates win (a branch's top child before its alternatives).
    """
    picked = []  # (confidence, is_top, parent, token, prob)
    for parent, cands in zip(frontier, candidates):
        base = 1.0 if parent < 0 else tree.confidence[parent]
        for rank, (token, prob) in enumerate(cands):
            if rank == 0 or prob > threshold:
                picked.append((base * prob, rank == 0, parent, token, prob))
    picked.sort(key=lambda c: (-c[0], not c[1]))
    return [(parent, token, prob) for _, _, parent, token, prob in picked[: max(budget, 0)]]


def next_frontier(tree: GrowingTree, new_nodes: list[int], policy: GrowthPolicy) -> list[int]:
    """The new nodes worth expanding: most confident first, at most max_width, within min_relative of the best
    (a stop token's too); never a stop token (its branch is complete)."""
    if not new_nodes:
        return []
    best = max(tree.confidence[n] for n in new_nodes)
    ranked = sorted((n for n in new_nodes if tree.token_ids[n] not in policy.stop_token_ids),
                    key=lambda n: -tree.confidence[n])
    return [n for n in ranked[: policy.max_width] if tree.confidence[n] >= policy.min_relative * best]


def grow_tree(expand: Expand, max_nodes: int, policy: GrowthPolicy | None = None,
              tree: GrowingTree | None = None, frontier: list[int] | None = None) -> Iterator[GrowthStep]:
    """Grow a tree one draft forward at a time, yielding what each forward added.

    ``tree``/``frontier``: continue a tree (e.g. one seeded by kept provisional tokens); default: a new
    tree grown from the root. The caller may stop iterating at any moment (the tree so far is valid).
    """
    policy = policy or GrowthPolicy()
    tree = tree if tree is not None else GrowingTree()
    frontier = [n for n in ([-1] if frontier is None else frontier)
                if n < 0 or tree.token_ids[n] not in policy.stop_token_ids]
    for _ in range(policy.max_depth):
        budget = max_nodes - len(tree)
        if budget <= 0 or not frontier:
            return
        candidates = expand(frontier)  # one draft forward over every frontier node
        added = children_to_add(tree, frontier, candidates, policy.branch_threshold, budget)
        if not added:
            return
        first = len(tree)
        new_nodes = [tree.add(parent, token, prob) for parent, token, prob in added]
        yield GrowthStep(first, tuple(tree.token_ids[first:]), tuple(tree.parents[first:]),
                         tuple(tree.draft_probs[first:]))
        frontier = next_frontier(tree, new_nodes, policy)


def best_leaf(tree: GrowingTree, num_nodes: int | None = None) -> int:
    """The leaf of the most confident branch among the deepest ones, within the first ``num_nodes`` nodes.

    Provisional drafting continues from here. The deepest branches are the ones growth kept going
    (weak branches stopped earlier); among them the most confident is the likeliest to be accepted whole.
    """
    n = len(tree) if num_nodes is None else min(num_nodes, len(tree))
    if n == 0:
        return -1
    depth = [0] * n  # [n]
    for i in range(n):
        p = tree.parents[i]
        depth[i] = 1 if p < 0 else depth[p] + 1
    deepest = max(depth)
    return max((i for i in range(n) if depth[i] == deepest), key=lambda i: tree.confidence[i])
