"""Provisional generation: what survives of tokens drafted while a tree was being verified.

While the verifier checks a tree, the draft keeps drafting from the most confident branch's leaf. The
*provisional path* is that branch's tokens followed by the provisional ones, as token ids from the root
(the last committed token) down. When the verdict comes back, the round's committed tokens (accepted +
the recovered or bonus token) either run along the provisional path or leave it: in the first case
the rest of the path continues the committed text and seeds the next tree at no cost, otherwise it is
dropped. Both the draft (to reuse its KV cache) and the orchestrator (to count) decide with this one rule.
"""

from __future__ import annotations


def follows(committed_tokens: list[int], provisional_tokens: list[int]) -> bool:
    """The committed tokens are a prefix of the provisional path (which may end with them).

    committed_tokens: [C] this round's committed tokens (accepted + recovered/bonus).
    provisional_tokens: [P] the provisional path from the root (best branch, then provisional tokens).
    """
    n = len(committed_tokens)
    return n > 0 and list(provisional_tokens[:n]) == list(committed_tokens)


def reconcile_provisional(committed_tokens: list[int], provisional_tokens: list[int]) -> list[int]:
    """The provisional tokens kept after ``committed_tokens`` ([C]): the rest of the path ([P]) if the
    committed tokens are its prefix (``follows``), else none."""
    if not follows(committed_tokens, provisional_tokens):
        return []
    return list(provisional_tokens[len(committed_tokens):])
