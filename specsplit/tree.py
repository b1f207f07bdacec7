"""The draft token tree and the buffers that let the target check it in one forward.

A tree holds drafted tokens only. Its implicit root is the session's last committed
token (the "pending" token whose KV entry is not yet cached): node i hangs under
``parents[i]``, with -1 meaning "under the root". ``parents[i] < i`` for every node,
so ancestors always come first and a chain is simply ``parents = [-1, 0, 1, ...]``.

For the target forward the root is prepended, giving ``N + 1`` query rows:
row 0 is the root, row ``i + 1`` is node i.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from specsplit.errors import InvalidArgument, ResourceExhausted


@dataclass(frozen=True)
class SparseDist:
    """A draft distribution over a few token ids (the support it actually sampled from)."""

    token_ids: tuple[int, ...]  # [S]
    probs: tuple[float, ...]  # [S], sums to 1

    @classmethod
    def from_probs(cls, probs: torch.Tensor) -> "SparseDist":
        """From a dense [V] distribution (zeros dropped)."""
        ids = probs.nonzero().flatten()  # [S]
        return cls(tuple(ids.tolist()), tuple(probs[ids].tolist()))

    def validate(self, where: str, token: int, vocab_size: int) -> None:
        if len(self.token_ids) != len(self.probs) or not self.token_ids:
            raise InvalidArgument(f"malformed tree: {where}'s draft distribution has {len(self.token_ids)} ids and "
                                  f"{len(self.probs)} probabilities; they must match and not be empty")
        if any(not 0 <= t < vocab_size for t in self.token_ids):
            raise InvalidArgument(f"malformed tree: {where}'s draft distribution names a token outside the "
                                  f"vocabulary [0, {vocab_size})")
        if any(not 0.0 <= q <= 1.0 for q in self.probs) or abs(sum(self.probs) - 1.0) > 1e-3:
            raise InvalidArgument(f"malformed tree: {where}'s draft probabilities must be in [0, 1] and sum to 1 "
                                  f"(sum is {sum(self.probs):.6f})")
        if token not in self.token_ids or self.probs[self.token_ids.index(token)] <= 0.0:
            raise InvalidArgument(f"malformed tree: {where}'s token {token} has zero probability under the "
                                  "distribution it was supposedly drawn from")

    def dense(self, vocab_size: int, device=None) -> torch.Tensor:
        q = torch.zeros(vocab_size, device=device)  # [V]
        q[list(self.token_ids)] = torch.tensor(self.probs, device=device)
        return q


@dataclass(frozen=True)
class TokenTree:
    token_ids: tuple[int, ...]  # [N] drafted token of each node
    parents: tuple[int, ...]  # [N] parent node index, -1 for children of the root
    draft_probs: tuple[float, ...] = field(default=())  # [N] q(token | ancestors); () = unknown
    node_q: tuple[SparseDist | None, ...] = field(default=())  # [N] what each token was drawn from; None/() = one-hot

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
        object.__setattr__(self, "draft_probs", tuple(float(q) for q in self.draft_probs))
        object.__setattr__(self, "node_q", tuple(self.node_q))

    @classmethod
    def empty(cls) -> "TokenTree":
        return cls((), (), ())

    @classmethod
    def chain(cls, token_ids: list[int] | tuple[int, ...], draft_probs=None) -> "TokenTree":
        n = len(token_ids)
        probs = tuple(draft_probs) if draft_probs is not None else (1.0,) * n
        return cls(tuple(token_ids), tuple(range(-1, n - 1)), probs)

    @classmethod
    def from_paths(cls, paths: list[list[int]]) -> "TokenTree":
        """Merge token paths (each starting under the root) into one tree, sharing prefixes."""
        token_ids: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, ...], int] = {}
        for path in paths:
            parent = -1
            for depth in range(len(path)):
                key = tuple(path[: depth + 1])
                if key not in index:
                    index[key] = len(token_ids)
                    token_ids.append(path[depth])
                    parents.append(parent)
                parent = index[key]
        return cls(tuple(token_ids), tuple(parents), (1.0,) * len(token_ids))

    def truncated(self, max_nodes: int) -> "TokenTree":
        """The first ``max_nodes`` nodes: still a tree, since parents come before their children."""
        if len(self) <= max_nodes:
            return self
        return TokenTree(self.token_ids[:max_nodes], self.parents[:max_nodes], self.draft_probs[:max_nodes],
                         self.node_q[:max_nodes])

    def __len__(self) -> int:
        return len(self.token_ids)

    def validate(self, vocab_size: int, max_nodes: int) -> None:
        """Raise InvalidArgument / ResourceExhausted with a message a person can act on."""
        n = len(self.token_ids)
        if len(self.parents) != n or (self.draft_probs and len(self.draft_probs) != n):
            raise InvalidArgument(
                f"malformed tree: token_ids has {n} entries, parents {len(self.parents)}, "
                f"draft_probs {len(self.draft_probs)}; they must have the same length "
                "(draft_probs may also be empty)"
            )
        if n > max_nodes:
            raise ResourceExhausted(f"tree has {n} nodes; this verifier accepts at most {max_nodes}")
        for i, (token, parent) in enumerate(zip(self.token_ids, self.parents)):
            if not -1 <= parent < i:
                raise InvalidArgument(
                    f"malformed tree: node {i} has parent {parent}; a parent index must be -1 "
                    "(the root) or smaller than the node's own index"
                )
            if not 0 <= token < vocab_size:
                raise InvalidArgument(
                    f"malformed tree: node {i} has token id {token}, outside the vocabulary [0, {vocab_size})"
                )
        for i, q in enumerate(self.draft_probs):
            if not 0.0 <= q <= 1.0:
                raise InvalidArgument(f"malformed tree: node {i} has draft probability {q}, outside [0, 1]")
        if self.node_q and len(self.node_q) != n:
            raise InvalidArgument(f"malformed tree: {len(self.node_q)} draft distributions for {n} nodes")
        for i, q in enumerate(self.node_q):
            if q is not None:
                q.validate(f"node {i}", self.token_ids[i], vocab_size)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """[N] depth of each node; children of the root have depth 1."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return tuple(depths)

    @cached_property
    def child_lists(self) -> dict[int, list[int]]:
        """Children of every node that has any (-1: the root's), in index order."""
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(self.parents):
            children.setdefault(parent, []).append(node)
        return children

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def children(self, node: int) -> list[int]:
        """Children of ``node`` (-1: the root) in index order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        return path_to(self.parents, node)

    def branch_below(self, node: int) -> list[int]:
        return branch_below(self.parents, node)

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def ended_at(self, stop_token_ids) -> "TokenTree":
        """The tree without the nodes below a stop token (the target's EOS): generation ends at one, so nothing
        after it could be committed. Node order is kept; parents are renumbered."""
        kept: dict[int, int] = {-1: -1}  # old node -> new node
        for node, parent in enumerate(self.parents):
            if parent in kept and (parent < 0 or self.token_ids[parent] not in stop_token_ids):
                kept[node] = len(kept) - 1
        if len(kept) - 1 == len(self):
            return self
        nodes = [n for n in kept if n >= 0]  # [K] old indices, in order
        return TokenTree(tuple(self.token_ids[n] for n in nodes), tuple(kept[self.parents[n]] for n in nodes),
                         tuple(self.draft_probs[n] for n in nodes) if self.draft_probs else (),
                         tuple(self.node_q[n] for n in nodes) if self.node_q else ())


def until_stop(token_ids, stop_token_ids) -> list[int]:
    """``token_ids`` up to and including the first stop token (the target's EOS): nothing after it is committed."""
    tokens = list(token_ids)
    end = next((i + 1 for i, t in enumerate(tokens) if t in stop_token_ids), len(tokens))
    return tokens[:end]


def branch_below(parents, node: int) -> list[int]:
    """The deepest branch through ``node`` (the first deepest in index order): node indices from the root's child down
    to the deepest node under ``node``, itself included (after a verification: the branch acceptance followed, ``node``
    its last accepted node)."""
    below = [n for n in range(len(parents)) if node in path_to(parents, n)]
    return path_to(parents, max(below, key=lambda n: len(path_to(parents, n))))


def path_to(parents, node: int) -> list[int]:
    """parents: [N] each node's parent (-1: the root) -> node indices from the root's child down to ``node``."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def union_trees(first: TokenTree, second: TokenTree, max_nodes: int, merge: bool = True) -> TokenTree:
    """``first`` then ``second``'s nodes (parents before children) under one root, at most ``max_nodes``.

    merge: a node of ``second`` equal to an existing node (same parent, same token) is that node. A node
    that does not fit, or whose parent did not, is dropped.
    """
    tokens, parents = list(first.token_ids), list(first.parents)
    probs = list(first.draft_probs) or [1.0] * len(tokens)
    node_q = list(first.node_q) or [None] * len(tokens)
    index = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))} if merge else {}
    placed: dict[int, int] = {-1: -1}  # second's node -> its node in the union
    for node, (parent, token) in enumerate(zip(second.parents, second.token_ids)):
        if parent not in placed:
            continue
        key = (placed[parent], token)
        if key in index:
            placed[node] = index[key]
            continue
        if len(tokens) >= max_nodes:
            continue
        placed[node] = len(tokens)
        if merge:
            index[key] = len(tokens)
        tokens.append(token)
        parents.append(key[0])
        probs.append(second.draft_probs[node] if second.draft_probs else 1.0)
        node_q.append(second.node_q[node] if second.node_q else None)
    sampled = any(q is not None for q in node_q)
    return TokenTree(tuple(tokens), tuple(parents), tuple(probs), tuple(node_q) if sampled else ())


@dataclass(frozen=True)
class GrowthStep:
    """Nodes added by one draft forward (indices continue the tree's), as streamed to the orchestrator."""

    first: int  # index of the first new node
    token_ids: tuple[int, ...]  # [S]
    parents: tuple[int, ...]  # [S]
    draft_probs: tuple[float, ...]  # [S]
    provisional: bool = False  # drafted while the tree's first nodes were being verified
    done: bool = False  # the tree stopped growing
    seeded: int = 0  # of these, last round's kept provisional tokens
    draft_ms: float = 0.0  # the draft forward behind this step (0: none ran for it, e.g. a provisional token whose
                           # row an earlier forward had computed)


@dataclass(frozen=True)
class TreeBuffers:
    """What the target forward needs for a root + tree block on top of ``prefix_len`` cached tokens."""

    input_ids: torch.Tensor  # [1, N+1] root token, then node tokens
    position_ids: torch.Tensor  # [1, N+1] prefix_len + depth (root depth 0)
    tree_attn_mask: torch.Tensor  # [N+1, N+1] bool, row r may attend column c (ancestors and itself)


def tree_attn_mask(tree: TokenTree) -> torch.Tensor:
    """[N+1, N+1] bool mask over root + nodes: each row sees the root, its ancestors and itself."""
    n = len(tree)
    rows = [[True] + [False] * n]  # built as lists, one tensor at the end: a tick builds one per session
    for i, parent in enumerate(tree.parents):
        row = list(rows[parent + 1])  # the parent's row (the root's for a child of the root)
        row[i + 1] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)  # [N+1, N+1]


def build_buffers(tree: TokenTree, root_token: int, prefix_len: int, device: torch.device | str = "cpu") -> TreeBuffers:
    input_ids = torch.tensor([[root_token, *tree.token_ids]], dtype=torch.long, device=device)  # [1, N+1]
    depths = torch.tensor([0, *tree.depths], dtype=torch.long, device=device)  # [N+1]
    position_ids = (prefix_len + depths).unsqueeze(0)  # [1, N+1]
    return TreeBuffers(input_ids, position_ids, tree_attn_mask(tree).to(device))


def full_attention_mask(tree_mask: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, N+1, prefix_len+N+1] additive mask: every row sees the whole cached prefix plus its tree ancestors."""
    rows = tree_mask.shape[0]
    allowed = torch.ones(rows, prefix_len + rows, dtype=torch.bool, device=tree_mask.device)  # [N+1, P+N+1]
    allowed[:, prefix_len:] = tree_mask
    zero = torch.zeros((), dtype=dtype, device=tree_mask.device)
    neg = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=tree_mask.device)
    return torch.where(allowed, zero, neg)[None, None]  # [1, 1, N+1, P+N+1]
