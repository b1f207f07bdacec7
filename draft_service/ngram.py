"""The n-gram draft: prompt lookup (specsplit/lookup.py) over the session's own tokens drafts what followed the same words before.

No model, no tokenizer dependence: it works on any target's ids (code edits copy long spans of their input).
"""

from __future__ import annotations

from specsplit.config import DraftConfig
from specsplit.lookup import NgramIndex
from specsplit.sampling import SamplingParams
from specsplit.tree import TokenTree, until_stop


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

    def propose(self, session_id: str, token_ids: list[int], max_nodes: int, stop_token_ids=()) -> TokenTree:
        index = self._index[session_id]
        if index.tokens != token_ids[: len(index.tokens)]:  # history rewritten: rebuild
            index = NgramIndex(self.config.ngram_min, self.config.ngram_max)
            self._index[session_id] = index
        index.extend(token_ids[len(index.tokens) :])
        if max_nodes <= 0:
            return TokenTree.empty()
        paths = [until_stop(p, stop_token_ids) for p in index.continuations(max_nodes, self.config.ngram_branches)]
        # Alternatives get short branches; the most recent match gets the rest of the budget.
        alt_len = max(1, max_nodes // 4)
        alts = [p[:alt_len] for p in paths[1:]]
        while alts and sum(map(len, alts)) >= max_nodes:
            alts.pop()
        primary = paths[:1] and [paths[0][: max_nodes - sum(map(len, alts))]]
        return TokenTree.from_paths(primary + alts).truncated(max_nodes)

    def end(self, session_id: str, idle=None) -> None:
        self._index.pop(session_id, None)
