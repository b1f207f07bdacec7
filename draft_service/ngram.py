"""Prompt lookup: an n-gram index over the session's own tokens drafts what followed the same words before.

No model, no tokenizer dependence: it works on any target's ids (code edits copy long spans of their input).
"""

from __future__ import annotations

from specsplit.config import DraftConfig
from specsplit.sampling import SamplingParams
from specsplit.tree import TokenTree


class NgramIndex:
    """Positions after every n-gram (n in [n_min, n_max]) of a growing token sequence."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.follow: dict[tuple[int, ...], list[int]] = {}  # n-gram -> start indices of what followed it

    def extend(self, new_tokens: list[int]) -> None:
        for token in new_tokens:
            self.tokens.append(token)
            end = len(self.tokens)  # the n-grams ending at end-1 are followed by index `end`
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.follow.setdefault(tuple(self.tokens[end - n : end]), []).append(end)

    def continuations(self, max_len: int, max_branches: int, context: list[int] | None = None) -> list[list[int]]:
        """Distinct continuations of the longest suffix n-gram seen before, most recent occurrence first.

        context: whose suffix to look up (default: the indexed tokens themselves); e.g. the indexed tokens
        followed by drafted ones, which are not indexed."""
        end = len(self.tokens)
        context = self.tokens if context is None else context
        for n in range(min(self.n_max, len(context)), self.n_min - 1, -1):
            starts = self.follow.get(tuple(context[len(context) - n :]), [])
            paths: list[list[int]] = []
            for start in reversed(starts):
                if start >= end:
                    continue  # the suffix itself: nothing followed it yet
                path = self.tokens[start : start + max_len]
                if path and not any(p[: len(path)] == path for p in paths):
                    paths.append(path)
                if len(paths) == max_branches:
                    break
            if paths:
                return paths
        return []


class NgramProposer:
    """Prompt lookup over prompt + generated text; several matches become branches of one tree."""

    name = "ngram"
    tokenizer_fingerprint = ""

    def __init__(self, config: DraftConfig | None = None):
        self.config = config or DraftConfig()
        self._index: dict[str, NgramIndex] = {}

    def start(self, session_id: str, prompt_token_ids: list[int], sampling: SamplingParams | None = None) -> None:
        index = NgramIndex(self.config.ngram_min, self.config.ngram_max)
        index.extend(list(prompt_token_ids))
        self._index[session_id] = index

    def propose(self, session_id: str, token_ids: list[int], max_nodes: int) -> TokenTree:
        index = self._index[session_id]
        if index.tokens != token_ids[: len(index.tokens)]:  # history rewritten: rebuild
            index = NgramIndex(self.config.ngram_min, self.config.ngram_max)
            self._index[session_id] = index
        index.extend(token_ids[len(index.tokens) :])
        if max_nodes <= 0:
            return TokenTree.empty()
        paths = index.continuations(max_nodes, self.config.ngram_branches)
        # Alternatives get short branches; the most recent match gets the rest of the budget.
        alt_len = max(1, max_nodes // 4)
        alts = [p[:alt_len] for p in paths[1:]]
        while alts and sum(map(len, alts)) >= max_nodes:
            alts.pop()
        primary = paths[:1] and [paths[0][: max_nodes - sum(map(len, alts))]]
        return TokenTree.from_paths(primary + alts).truncated(max_nodes)

    def end(self, session_id: str) -> None:
        self._index.pop(session_id, None)
