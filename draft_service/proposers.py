"""Proposers: given a session's committed tokens and a node budget, propose a draft token tree.

Every proposer sees the *whole* committed sequence on each call and keeps whatever per-session state
it likes (an n-gram index, a KV cache); the draft servicer only routes calls.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specsplit import kvcache
from specsplit.config import DraftConfig
from specsplit.models import LoadedModel
from specsplit.runner import ModelRunner
from specsplit.tree import TokenTree


class Proposer(Protocol):
    name: str
    tokenizer_fingerprint: str  # "" when the proposer works on any tokenizer's ids

    def start(self, session_id: str, prompt_token_ids: list[int]) -> None: ...

    def propose(self, session_id: str, token_ids: list[int], max_nodes: int) -> TokenTree: ...

    def end(self, session_id: str) -> None: ...


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

    def continuations(self, max_len: int, max_branches: int) -> list[list[int]]:
        """Distinct continuations of the longest suffix n-gram seen before, most recent occurrence first."""
        end = len(self.tokens)
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            starts = self.follow.get(tuple(self.tokens[end - n :]), [])
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

    def start(self, session_id: str, prompt_token_ids: list[int]) -> None:
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
        return _trim_to_budget(TokenTree.from_paths(primary + alts), max_nodes)

    def end(self, session_id: str) -> None:
        self._index.pop(session_id, None)


def _trim_to_budget(tree: TokenTree, max_nodes: int) -> TokenTree:
    if len(tree) <= max_nodes:
        return tree
    return TokenTree(tree.token_ids[:max_nodes], tree.parents[:max_nodes], tree.draft_probs[:max_nodes])


class ModelProposer:
    """A Hugging Face causal LM drafting a top-k tree, one draft forward per depth.

    The draft's cache holds committed tokens only. Each depth expands the chosen frontier nodes in a
    single forward with a tree mask over the cache; afterwards the tree's entries are cut off again.
    The greedy (top-1) chain is always expanded, so with draft == target the whole chain is accepted.
    """

    name = "model"

    def __init__(self, loaded: LoadedModel, config: DraftConfig | None = None):
        self.loaded = loaded
        self.model = loaded.model
        self.config = config or DraftConfig()
        self.tokenizer_fingerprint = loaded.fingerprint
        self._cache_kwarg = kvcache.cache_kwarg(self.model)
        self._sessions: dict[str, tuple[object, list[int]]] = {}  # session -> (cache, cached token ids)
        self._runner = ModelRunner("draft")

    def start(self, session_id: str, prompt_token_ids: list[int]) -> None:
        self._sessions[session_id] = (kvcache.new_cache(self.model), [])

    def end(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def _forward(self, input_ids, position_ids, mask, cache) -> torch.Tensor:
        out = self._runner(self.model, input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                           use_cache=True, **{self._cache_kwarg: cache})
        return out.logits[0].float().softmax(dim=-1)  # [Q, V]

    def propose(self, session_id: str, token_ids: list[int], max_nodes: int) -> TokenTree:
        cache, cached = self._sessions[session_id]
        if max_nodes <= 0:
            return TokenTree.empty()
        device = self.model.device
        # Catch up: drop cached tokens that diverge from the committed ones, run the rest in one forward.
        common = 0
        for a, b in zip(cached, token_ids):
            if a != b:
                break
            common += 1
        common = min(common, len(token_ids) - 1)  # always re-run the last token to get its next-token probs
        kvcache.truncate(cache, common)
        catch_up = token_ids[common:]
        ids = torch.tensor([catch_up], dtype=torch.long, device=device)  # [1, U]
        positions = torch.arange(common, len(token_ids), device=device).unsqueeze(0)  # [1, U]
        probs = self._forward(ids, positions, None, cache)[-1:]  # [1, V] next-token probs after the root
        self._sessions[session_id] = (cache, list(token_ids))
        committed = len(token_ids)

        tokens: list[int] = []
        parents: list[int] = []
        draft_probs: list[float] = []
        cum: list[float] = []  # [N] product of draft probs along each node's path
        frontier = [-1]  # nodes whose children come from `probs` rows
        slot: dict[int, int] = {}  # node -> its offset in the cache after the committed tokens
        top_k = self.config.model_top_k
        for depth in range(1, self.config.model_depth + 1):
            candidates = []  # (cumulative prob, parent, token, q)
            values, indices = probs.topk(top_k, dim=-1)  # [F, k]
            for row, parent in enumerate(frontier):
                base = 1.0 if parent < 0 else cum[parent]
                for rank in range(top_k):
                    q = float(values[row, rank])
                    candidates.append((base * q, parent, int(indices[row, rank]), q, rank == 0 and row == 0))
            # Keep the greedy chain's child first, then the most probable others, within the budget.
            candidates.sort(key=lambda c: (not c[4], -c[0]))
            candidates = candidates[: min(top_k * 2, max_nodes - len(tokens))]
            if not candidates:
                break
            new_nodes = []
            for c, parent, token, q, _ in candidates:
                new_nodes.append(len(tokens))
                tokens.append(token)
                parents.append(parent)
                draft_probs.append(q)
                cum.append(c)
            if len(tokens) >= max_nodes or depth == self.config.model_depth:
                break
            # Expand the greedy child plus the next most probable ones in one forward.
            frontier = new_nodes[:top_k]
            probs = self._expand(cache, committed, TokenTree(tuple(tokens), tuple(parents)), slot, frontier)
        kvcache.truncate(cache, committed)
        return TokenTree(tuple(tokens), tuple(parents), tuple(draft_probs))

    def _expand(self, cache, committed: int, tree: TokenTree, slot: dict[int, int], frontier: list[int]) -> torch.Tensor:
        """Run the frontier nodes on top of the cache (committed tokens + nodes already in ``slot``).

        Every ancestor of a frontier node was itself a frontier node at a smaller depth, so it has a slot.
        """
        device = self.model.device
        for node in frontier:
            slot[node] = len(slot)
        allowed = torch.zeros(len(frontier), committed + len(slot), dtype=torch.bool)  # [F, C+T]
        allowed[:, :committed] = True
        for row, node in enumerate(frontier):
            for ancestor in tree.path_to(node):
                allowed[row, committed + slot[ancestor]] = True
        neg = torch.finfo(self.model.dtype).min
        zero = torch.zeros((), dtype=self.model.dtype)
        mask = torch.where(allowed, zero, neg).to(device)[None, None]  # [1, 1, F, C+T]
        ids = torch.tensor([[tree.token_ids[n] for n in frontier]], dtype=torch.long, device=device)  # [1, F]
        positions = torch.tensor([[committed - 1 + tree.depths[n] for n in frontier]], device=device)  # [1, F]
        return self._forward(ids, positions, mask, cache)  # [F, V]
