"""Proposers: given a session's committed tokens and a node budget, propose a draft token tree.

Every proposer sees the *whole* committed sequence on each call and keeps whatever per-session state
it likes (an n-gram index, a KV cache); the draft servicer only routes calls.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch
from opentelemetry import trace

from draft_service.lean import ForwardInterrupted, LeanLlama
from draft_service.ngram import NgramProposer
from draft_service.rounds import (GrowthControl, GrowthRound, SpanAgreement, draft_sampling, grow_top_tree,
                                  growth_policy)
from specsplit.growth import GrowingTree, GrowthStep
from specsplit.lookup import SpanLookup
from specsplit.provisional import reconcile_provisional

from specsplit import kvcache
from specsplit.config import DraftConfig
from specsplit.models import LoadedModel
from specsplit.runner import ModelRunner
from specsplit.sampling import SamplingParams, distribution, round_seed, scores
from specsplit.tree import SparseDist, TokenTree, union_trees


class Proposer(Protocol):
    name: str
    tokenizer_fingerprint: str  # "" when the proposer works on any tokenizer's ids

    def start(self, session_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None: ...

    def propose(self, session_id: str, token_ids: list[int], max_nodes: int, stop_token_ids=()) -> TokenTree:
        """A whole tree after ``token_ids``; no node below one whose token is in ``stop_token_ids``."""

    def end(self, session_id: str, idle: threading.Event | None = None) -> None:
        """idle: set once no round of the session runs any more; its state may then serve a later session that
        starts the same way (``ModelProposer`` keeps the latest ended session's cache: a conversation's next turn).
        None: nothing is kept."""


@dataclass
class _ModelSession:
    cache: object  # the draft's KV cache: committed tokens only, between calls
    cached: list[int]  # the token ids in the cache
    sampling: SamplingParams  # the target's; q mirrors it (truncated to q_top_k ids)
    generator: torch.Generator | None
    # The last DraftTree round's provisional path (best verified branch + provisional tokens), drafted
    # after `path_base` committed tokens; the cache holds those committed tokens + a prefix of the path.
    path_base: int = 0
    path_tokens: list[int] = field(default_factory=list)  # [P]
    path_probs: list[float] = field(default_factory=list)  # [P]
    warming: Future | None = None  # the prompt's prefill, started with the session (the first round waits on it)
    lookup: SpanLookup | None = None  # prompt lookup over the committed tokens (a draft that copies spans)
    spans: SpanAgreement = field(default_factory=SpanAgreement)  # how much of its copied spans the draft agreed with


tracer = trace.get_tracer(__name__)
PREFILL_MIN_TOKENS = 4  # forwards of this many tokens or more go through prefill_model, unless calibrated (prefill_from)
REUSE_MIN_TOKENS = 8  # a new prompt starting with at least this many of an ended session's tokens reuses its cache
# A new session's prefill waits at most this long for the ended session's last round to let go of the cache it may
# reuse (a conversation's next turn sent at once, an agent's loop): about a draft forward or two.
REUSE_WAIT_S = 0.3


class ModelProposer:
    """A Hugging Face causal LM drafting a tree, one draft forward per depth.

    The draft's cache holds committed tokens only. Each depth expands the chosen frontier nodes in a
    single forward with a tree mask over the cache; afterwards the tree's entries are cut off again.

    Greedy targets get a deterministic top-k tree (q one-hot), and the top-1 chain is always expanded,
    so with draft == target the whole chain is accepted; coupled draws, the same on the rows' coupled scores
    (``specsplit.sampling.scores``). Rejection sampling gets children drawn i.i.d.
    from the draft's truncated distribution q, which travels with each node: siblings are kept or cut
    as a prefix of their draws, never by their values, so each child stays an exact draw from q.
    """

    name = "model"
    calibration = None  # draft_service.dtypes.Calibration when the dtypes were measured (the half draft)

    def __init__(self, loaded: LoadedModel, config: DraftConfig | None = None, name: str = "model",
                 prefill_model=None, copies: bool = False, prefill_from: int | None = None):
        """prefill_model: the same weights in a dtype whose many-token forwards are faster, for forwards of
        ``prefill_from`` (default ``PREFILL_MIN_TOKENS``) or more tokens (a prompt, a copied span); which dtype that
        is, and from how many tokens on, depends on the machine (draft_service/dtypes.py). copies: provisional
        drafting first copies what followed the same words earlier in the session (prompt lookup, suffix n-grams of
        at least ``config.lookup_min_ngram`` tokens), then drafts on with the model: code edits keep lookup's long
        spans."""
        self.name = name  # "model": a draft LM; "half": the target itself at low precision
        self.loaded = loaded
        self.model = loaded.model
        self.prefill_model = prefill_model
        self.prefill_from = prefill_from or PREFILL_MIN_TOKENS
        self.copies = copies
        self.config = config or DraftConfig()
        self.tokenizer_fingerprint = loaded.fingerprint
        self._cache_kwarg = kvcache.cache_kwarg(self.model)
        self._sessions: dict[str, _ModelSession] = {}
        self._runner = ModelRunner("draft", self.config.threads)
        self._prefills = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specsplit-draft-prefill")
        self._ended: tuple[_ModelSession, threading.Event] | None = None  # the latest ended session, and its idle
        self._ended_lock = threading.Lock()

    def start(self, session_id: str, prompt_token_ids: list[int], sampling: SamplingParams | None = None) -> None:
        """A new session; its prompt's prefill starts now, in the background, so that it overlaps the
        verifier's (the orchestrator starts the draft first). A prompt that begins with the latest ended session's
        tokens (the conversation it continues) starts from that session's cache: only the rest is computed."""
        sampling, generator = draft_sampling(sampling, self.config.q_top_k)
        session = _ModelSession(kvcache.new_cache(self.model), [], sampling, generator)
        with self._ended_lock:
            ended, self._ended = self._ended, None
        if prompt_token_ids:
            # (in the caller's context: the prefill's span belongs to the session's trace)
            session.warming = self._prefills.submit(contextvars.copy_context().run, self._warm, session,
                                                    list(prompt_token_ids), ended)
        self._sessions[session_id] = session

    def _session(self, session_id: str) -> _ModelSession:
        session = self._sessions[session_id]
        if session.warming is not None:
            warming, session.warming = session.warming, None
            warming.result()  # (a failed prefill fails this round: the orchestrator falls back to the target)
        return session

    def _warm(self, session: _ModelSession, prompt: list[int], ended) -> torch.Tensor:
        """A new session's prompt prefill: from the latest ended session's cache when the prompt continues it (its
        last round done with it), else from scratch."""
        with tracer.start_as_current_span("specsplit.draft.prefill") as span:
            span.set_attribute("specsplit.prompt_tokens", len(prompt))
            if ended is not None:
                old, idle = ended  # (read once its round is done: until then its cache and tokens may still change)
                common = kvcache.common_length(old.cached, prompt) if idle.wait(REUSE_WAIT_S) else 0
                if common >= REUSE_MIN_TOKENS:
                    session.cached, session.cache = old.cached, old.cache  # (the catch-up cuts it to the common start)
                    span.set_attribute("specsplit.reused_tokens", common)
            return self._catch_up(session, prompt)

    def end(self, session_id: str, idle: threading.Event | None = None) -> None:
        session = self._sessions.pop(session_id, None)
        if idle is not None and self.config.reuse_ended and session is not None and session.warming is None:
            with self._ended_lock:
                self._ended = (session, idle)

    def _forward(self, input_ids, position_ids, mask, cache, logits_to_keep: int = 0, model=None,
                 stop=None) -> torch.Tensor:
        """stop(): the forward may end early (``lean.ForwardInterrupted``; only a lean forward does)."""
        model = model or self.model
        options = {"stop": stop} if stop is not None and isinstance(model, LeanLlama) else {}
        out = self._runner(model, input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                           use_cache=True, logits_to_keep=logits_to_keep, **{self._cache_kwarg: cache}, **options)
        return out.logits[0].float()  # [Q, V]

    def propose(self, session_id: str, token_ids: list[int], max_nodes: int, stop_token_ids=()) -> TokenTree:
        session = self._session(session_id)
        session.path_tokens, session.path_probs = [], []
        if max_nodes <= 0:
            return TokenTree.empty()
        if session.generator is not None and session.sampling.seed is not None:  # same draws on any restart
            session.generator.manual_seed(round_seed(session.sampling.seed, len(token_ids), stream=1))
        committed = len(token_ids)
        # [1, V] after the root (last committed token); coupled draws: as scores (sampling.scores), like every row
        logits = scores(self._catch_up(session, token_ids)[-1:], session.sampling, [committed])
        sampled = session.sampling.rejection_sampled
        top_k = self.config.model_top_k
        slot: dict[int, int] = {}  # node -> its offset in the cache after the committed tokens
        if sampled:
            children = lambda logits, frontier, cum: self._sampled_children(session, logits, frontier, cum)  # noqa: E731
        else:
            children = lambda logits, frontier, cum: self._top_children(logits, frontier, cum, top_k)  # noqa: E731

        def expand(tree: TokenTree, frontier: list[int]) -> torch.Tensor:
            rows = self._expand(session.cache, committed, tree, slot, frontier)  # [F, V]
            return scores(rows, session.sampling, [committed + tree.depths[n] for n in frontier])

        tree = grow_top_tree(logits, children, expand, max_nodes, self.config.model_depth, top_k, sampled,
                             frozenset(stop_token_ids))
        kvcache.truncate(session.cache, committed)
        return tree

    grows_from_given = True  # grow() takes ``given``: a chain verified in place of a grown tree

    def grow(self, session_id: str, token_ids: list[int], max_nodes: int, control: GrowthControl,
             provisional_max: int = 0, stop_token_ids=(), given: list[int] | None = None) -> Iterator[GrowthStep]:
        """One DraftTree round: stream a width-adaptive tree as it grows, then draft provisionally.

        Each yielded step is one draft forward over the whole frontier (tree mask over the draft's KV
        cache). Once the orchestrator says how many nodes it sent for verification, growth stops and up to
        ``provisional_max`` tokens follow the best verified branch's leaf, one forward each, until the round
        is closed. The cache keeps committed + that path, so next round's committed tokens are mostly cached
        already, and if they ran along the path, the rest of it seeds the next tree with no forward at all.
        given: the round's tree is this chain (a span the orchestrator copied), not a grown one: the part of it
        the kept provisional tokens do not already hold is run in one forward, and provisional drafting goes on
        from its end (``GrowthRound.run``).
        """
        session = self._session(session_id)
        if session.sampling.rejection_sampled:  # trees of draws, each sent with its q: the Propose path's trees
            tree = self.propose(session_id, token_ids, max_nodes, stop_token_ids)
            yield GrowthStep(0, tree.token_ids, tree.parents, tree.draft_probs, done=True)
            return
        committed = len(token_ids)
        slot: dict[int, int] = {}  # node -> its offset in the cache after the committed tokens
        seed = self._kept_provisional(session, token_ids, given)
        session.path_tokens, session.path_probs = [], []
        for node in range(len(seed) - 1):
            slot[node] = node  # the cache already holds them, in order, right after the committed tokens
        # [V] after the root; coupled draws: scores (sampling.scores) here and in every row below
        root_logits = None if seed else scores(self._catch_up(session, token_ids)[-1:], session.sampling, [committed])[0]

        def forward(tree: GrowingTree, nodes: list[int], stop=None) -> torch.Tensor:
            """Next-token logits of each node ([F, V]); one draft forward for the non-root ones (stop: as for
            ``_forward``; interrupted, the nodes it ran get no rows)."""
            rows = {-1: root_logits} if -1 in nodes else {}
            run = [n for n in nodes if n >= 0]
            if run:  # with any ancestors not in the cache yet (a copied span's parent), ancestors first
                run = sorted({a for n in run for a in tree.path_to(n) if a not in slot} | set(run))
                grown = TokenTree(tuple(tree.token_ids), tuple(tree.parents))
                try:
                    out = self._expand(session.cache, committed, grown, slot, run, stop=stop)  # [F, V]
                except ForwardInterrupted:
                    for node in run:
                        del slot[node]  # (the cache did not grow: its next forward writes those rows again)
                    raise
                rows.update(zip(run, scores(out, session.sampling, [committed + grown.depths[n] for n in run])))
            return torch.stack([rows[n] for n in nodes])  # [F, V]

        def forget(num_verified: int) -> None:
            for node in [n for n in slot if n >= num_verified]:
                del slot[node]  # their cache rows stay (masked out) until the compaction in _keep_path

        round_ = GrowthRound(forward, forget, lookup=self._lookup(session, token_ids) if self.copies else None,
                             spans=session.spans)
        try:
            yield from round_.run(seed, max_nodes, growth_policy(self.config, stop_token_ids), control,
                                  provisional_max, given=None if given is None else given[len(seed):])
        finally:
            self._keep_path(session, token_ids, round_.tree, slot, round_.leaf)

    def _lookup(self, session: _ModelSession, token_ids: list[int]):
        """The round's prompt lookup: lookup(path_tokens) -> the span copied after the committed tokens + them."""
        if session.lookup is None:
            session.lookup = SpanLookup(self.config.lookup_min_ngram, self.config.ngram_max)
        return lambda path_tokens: session.lookup.span(token_ids, path_tokens)

    def _kept_provisional(self, session: _ModelSession, token_ids: list[int],
                          given: list[int] | None = None) -> list[tuple[int, float]]:
        """Last round's provisional tokens that continue ``token_ids`` and whose KV (all but the last) is
        cached right after them (as far as they start ``given``, when given); the cache is cut to exactly that.
        [] when there are none."""
        base, path = session.path_base, session.path_tokens
        if not path or len(token_ids) <= base or session.cached[:base] != token_ids[:base]:
            return []
        kept = reconcile_provisional(token_ids[base:], path)
        if given is not None:
            kept = kept[:kvcache.common_length(kept, given)]
        need = list(token_ids) + kept[:-1]
        if not kept or session.cached[: len(need)] != need:
            return []
        kvcache.truncate(session.cache, len(need))
        session.cached = need
        return list(zip(kept, session.path_probs[len(path) - len(kept):]))

    def _keep_path(self, session: _ModelSession, token_ids: list[int], tree: GrowingTree, slot: dict[int, int],
                   leaf: int) -> None:
        """Leave committed + the provisional path's cached prefix in the cache (in order) and remember the path."""
        committed = len(token_ids)
        path = tree.path_to(leaf) if 0 <= leaf < len(tree) else []
        cached_nodes = []
        for node in path:
            if node not in slot:
                break
            cached_nodes.append(node)
        kvcache.compact(session.cache, committed, tuple(slot[n] for n in cached_nodes))
        session.cached = list(token_ids) + [tree.token_ids[n] for n in cached_nodes]
        session.path_base = committed
        session.path_tokens = [tree.token_ids[n] for n in path]
        session.path_probs = [tree.draft_probs[n] for n in path]

    def _catch_up(self, session: _ModelSession, token_ids: list[int]) -> torch.Tensor:
        """Bring the cache to the committed tokens; return the next-token logits after the last one ([1, V])."""
        # (always re-run the last token to get its next-token logits)
        common = min(kvcache.common_length(session.cached, token_ids), len(token_ids) - 1)
        kvcache.truncate(session.cache, common)
        device = self.model.device
        ids = torch.tensor([token_ids[common:]], dtype=torch.long, device=device)  # [1, U]
        positions = torch.arange(common, len(token_ids), device=device).unsqueeze(0)  # [1, U]
        logits = self._forward_many(ids, positions, None, session.cache, logits_to_keep=1)  # [1, V]
        session.cached = list(token_ids)
        return logits

    @staticmethod
    def _top_children(logits, frontier, cum, top_k):
        """Deterministic: each frontier node's top-k tokens, greedy chain first, then by cumulative prob."""
        probs = logits.softmax(dim=-1)  # [F, V]
        values, indices = probs.topk(top_k, dim=-1)  # [F, k]
        candidates = []
        for row, parent in enumerate(frontier):
            base = 1.0 if parent < 0 else cum[parent]
            for rank in range(top_k):
                q = float(values[row, rank])
                if q > 0.0:  # (a token the request's top-k or top-p cut has none: coupled scores of -inf)
                    candidates.append((base * q, parent, int(indices[row, rank]), q, None, row == 0 and rank == 0))
        candidates.sort(key=lambda c: (not c[5], -c[0]))
        return [c[:5] for c in candidates]

    def _sampled_children(self, session, logits, frontier, cum):
        """Sampling: each frontier node's children are k i.i.d. draws from q, in frontier then draw order."""
        q_rows = distribution(logits, session.sampling)  # [F, V]
        candidates = []
        for row, parent in enumerate(frontier):
            base = 1.0 if parent < 0 else cum[parent]
            q = q_rows[row]  # [V]
            dist = SparseDist.from_probs(q)
            draws = torch.multinomial(q, self.config.model_top_k, replacement=True, generator=session.generator)
            for token in draws.tolist():
                candidates.append((base * float(q[token]), parent, token, float(q[token]), dist))
        return candidates

    def _expand(self, cache, committed: int, tree: TokenTree, slot: dict[int, int], frontier: list[int],
                stop=None) -> torch.Tensor:
        """Run the frontier nodes on top of the cache (committed tokens + nodes already in ``slot``).

        Every ancestor of a frontier node was itself a frontier node at a smaller depth, so it has a slot.
        """
        device = self.model.device
        used = kvcache.cache_length(cache) - committed  # rows after the committed tokens (some may be cut nodes)
        for node in frontier:
            slot[node] = used
            used += 1
        allowed = torch.zeros(len(frontier), committed + used, dtype=torch.bool)  # [F, C+T]
        allowed[:, :committed] = True
        for row, node in enumerate(frontier):
            for ancestor in tree.path_to(node):
                allowed[row, committed + slot[ancestor]] = True
        ids = torch.tensor([[tree.token_ids[n] for n in frontier]], dtype=torch.long, device=device)  # [1, F]
        positions = torch.tensor([[committed - 1 + tree.depths[n] for n in frontier]], device=device)  # [1, F]
        return self._forward_many(ids, positions, allowed.to(device), cache, stop=stop)  # [F, V] logits

    def _forward_many(self, ids, positions, allowed, cache, logits_to_keep: int = 0, stop=None) -> torch.Tensor:
        """A forward over the draft's cache; ``prefill_from`` or more tokens (a prompt, a copied span) go
        through ``prefill_model`` when there is one, the cache cast to its dtype and back.
        allowed: [Q, C+Q] which cached/new positions each new token may attend to (None: causal)."""
        model = self.prefill_model if self.prefill_model is not None and ids.shape[1] >= self.prefill_from else self.model
        mask = None
        if allowed is not None:
            zero, neg = torch.zeros((), dtype=model.dtype), torch.finfo(model.dtype).min
            mask = torch.where(allowed, zero.to(allowed.device), neg)[None, None]  # [1, 1, Q, C+Q]
        if model is self.model:
            return self._forward(ids, positions, mask, cache, logits_to_keep, stop=stop)
        kvcache.cast(cache, model.dtype)
        try:
            return self._forward(ids, positions, mask, cache, logits_to_keep, model=model, stop=stop)
        finally:
            kvcache.cast(cache, self.model.dtype)


class CombinedProposer:
    """A model drafter's tree with the n-gram lookup's branches merged in: code edits keep their n-gram
    gains (long copied spans) and everything else gets the model's tree.

    The n-gram lookup drafts first, up to the whole node budget (a long match is a copied span, the surest
    draft there is: half the budget cut code edits' tau from 13.7 to 4.6); the model gets the rest, all of it
    when the lookup finds nothing. Greedy: a trie union (a
    model node equal to an n-gram node under the same parent is the same node). Sampling: the model's
    nodes were drawn i.i.d. from q and must be kept or cut by their position, never by their value, so
    the two trees are joined side by side without merging (siblings may repeat a token).
    """

    def __init__(self, model, ngram: NgramProposer):
        self.model, self.ngram = model, ngram
        self.name = f"{model.name}+ngram"
        self.tokenizer_fingerprint = model.tokenizer_fingerprint
        self.target_identity = getattr(model, "target_identity", "")
        self.wants_features = getattr(model, "wants_features", False)
        self.artifact = getattr(model, "artifact", "")
        self._sampled: dict[str, bool] = {}

    def start(self, session_id: str, prompt_token_ids: list[int], sampling: SamplingParams | None = None) -> None:
        sampling = sampling or SamplingParams()
        self.model.start(session_id, prompt_token_ids, sampling)
        self.ngram.start(session_id, prompt_token_ids, sampling)
        self._sampled[session_id] = sampling.rejection_sampled

    def add_features(self, session_id: str, chunks) -> None:
        self.model.add_features(session_id, chunks)

    def propose(self, session_id: str, token_ids: list[int], max_nodes: int, stop_token_ids=()) -> TokenTree:
        lookup = self.ngram.propose(session_id, token_ids, max_nodes, stop_token_ids)
        drafted = self.model.propose(session_id, token_ids, max_nodes - len(lookup), stop_token_ids)
        return union_trees(lookup, drafted, max_nodes, merge=not self._sampled[session_id])

    def end(self, session_id: str, idle: threading.Event | None = None) -> None:
        self.model.end(session_id, idle)
        self.ngram.end(session_id)
        self._sampled.pop(session_id, None)

