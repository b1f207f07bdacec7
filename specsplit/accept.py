"""Acceptance: which drafted tokens the target agrees with.

Terms (as in vLLM's rejection sampler):
- accepted tokens: draft tokens the target agreed with, along one root-to-node path;
- recovered token: the target's own token where it first disagreed with every child;
- bonus token: the target's token after the last node when a whole branch was accepted.
Either way the round commits ``accepted + [next_token]``, so every round commits >= 1 token; a decode
burst (the target decoding alone after the verdict, in the same request) adds its decoded tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.tree import TokenTree


@dataclass(frozen=True)
class Verdict:
    accepted_nodes: tuple[int, ...]  # [A] tree node indices along the accepted path
    accepted_token_ids: tuple[int, ...]  # [A] their tokens
    next_token_id: int  # the recovered or bonus token
    decoded_token_ids: tuple[int, ...] = ()  # [D] the target's own tokens after it (a decode burst)

    @classmethod
    def along(cls, tree: TokenTree, accepted: list[int], next_token_id: int) -> "Verdict":
        """The verdict for an accepted path of tree nodes and the token that follows it."""
        return cls(tuple(accepted), tuple(tree.token_ids[n] for n in accepted), int(next_token_id))

    @property
    def committed_token_ids(self) -> tuple[int, ...]:
        return (*self.accepted_token_ids, self.next_token_id, *self.decoded_token_ids)

    @property
    def rows_to_keep(self) -> tuple[int, ...]:
        """Rows of the root + tree block whose KV entries stay cached (root, then accepted nodes)."""
        return (0, *(node + 1 for node in self.accepted_nodes))


def accept_greedy(tree: TokenTree, target_token_ids: list[int], max_commit: int = 0) -> Verdict:
    """Longest root-to-node path whose tokens equal the target's argmax, plus the next target token.

    target_token_ids: [N+1] the target's argmax after each row (row 0 = root, row i+1 = node i).
    max_commit: commit at most this many tokens (0 = no limit).
    """
    assert len(target_token_ids) == len(tree) + 1, (len(target_token_ids), len(tree))
    children = tree.child_lists
    accepted: list[int] = []
    node, row = -1, 0
    while max_commit <= 0 or len(accepted) + 1 < max_commit:
        want = target_token_ids[row]
        match = next((c for c in children.get(node, ()) if tree.token_ids[c] == want), None)
        if match is None:
            break
        accepted.append(match)
        node, row = match, match + 1
    return Verdict.along(tree, accepted, target_token_ids[row])
