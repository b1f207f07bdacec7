"""One draft round, whatever the draft model: the pieces the model drafter and the feature (EAGLE) drafter share.

``GrowthRound`` is a streamed DraftTree round (grow a width-adaptive tree, then draft provisionally from the
best branch, copying prompt-lookup spans where the model agrees); ``grow_top_tree`` a whole top-k tree for
the Propose path; ``draft_sampling`` how a draft samples for a session.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from typing import Protocol

import torch
from opentelemetry import trace

from draft_service.lean import ForwardInterrupted
from specsplit import metrics
from specsplit.config import DraftConfig
from specsplit.growth import GrowingTree, GrowthPolicy, GrowthStep, best_leaf, grow_tree
from specsplit.lookup import COPY_MIN_HITS, LOOKUP_PROB, SPAN_PROBE, span_share
from specsplit.provisional import follows
from specsplit.sampling import SamplingParams, session_generator
from specsplit.tree import SparseDist, TokenTree, until_stop

tracer = trace.get_tracer(__name__)


class GrowthControl(Protocol):
    """What the orchestrator has said so far in a DraftTree round (set from another thread)."""

    verifying: int | None  # nodes sent for verification, once said
    closed: bool  # the round is over
    committed: list[int] | None  # [C] the verdict's committed tokens, when the round ended on one

    def wait(self, timeout: float | None = None) -> None: ...  # until verifying is set or closed


def draft_sampling(sampling: SamplingParams | None, q_top_k: int) -> tuple[SamplingParams, torch.Generator | None]:
    """How a model draft samples for a session: rejection sampling, the target's parameters with q truncated to
    ``q_top_k`` ids, and its own generator (seeded from the session's seed when there is one); greedy or coupled
    draws: the target's parameters, no generator (the draft's choices are the argmax of ``sampling.scores``)."""
    sampling = sampling or SamplingParams()
    if not sampling.rejection_sampled:
        return sampling, None
    generator = session_generator(sampling, stream=1)
    top_k = min(sampling.top_k or q_top_k, q_top_k)
    return SamplingParams(sampling.temperature, top_k, sampling.top_p, sampling.seed, rejection=True), generator


def grow_top_tree(logits: torch.Tensor, children, expand, max_nodes: int, depth: int, top_k: int,
                  sampled: bool, stop: frozenset[int] = frozenset()) -> TokenTree:
    """A draft tree grown depth by depth, one draft forward per depth for the whole frontier.

    logits: [1, V] the draft's next-token scores after the root. ``children(logits, frontier, cum)`` gives
    the frontier's candidate children (cum_prob, parent, token, q, dist) in order; ``expand(tree, frontier)``
    runs the frontier nodes and returns their next-token scores [F, V]. Greedy keeps at most 2 * top_k
    candidates per depth; the first candidate (the greedy chain's child) and the top_k - 1 most probable
    others are expanded, never one whose token is in ``stop`` (the target's EOS ids: generation ends there).
    Sampled candidates are kept or cut as a prefix of their draws, never by value.
    """
    tokens: list[int] = []
    parents: list[int] = []
    draft_probs: list[float] = []
    node_q: list[SparseDist | None] = []
    cum: list[float] = []  # [N] product of draft probs along each node's path
    frontier = [-1]  # nodes whose children come from the rows of `logits`
    for level in range(1, depth + 1):
        budget = max_nodes - len(tokens)
        candidates = children(logits, frontier, cum)[: budget if sampled else min(2 * top_k, budget)]
        if not candidates:
            break
        new_nodes = []
        for c, parent, token, q, dist in candidates:
            new_nodes.append(len(tokens))
            tokens.append(token)
            parents.append(parent)
            draft_probs.append(q)
            node_q.append(dist)
            cum.append(c)
        open_nodes = [n for n in new_nodes if tokens[n] not in stop]  # [O] a branch ends at a stop token
        if len(tokens) >= max_nodes or level == depth or not open_nodes:
            break
        frontier = [open_nodes[0], *sorted(open_nodes[1:], key=lambda n: -cum[n])[: top_k - 1]]
        logits = expand(TokenTree(tuple(tokens), tuple(parents)), frontier)  # [F, V]
    return TokenTree(tuple(tokens), tuple(parents), tuple(draft_probs), tuple(node_q) if sampled else ())


def growth_policy(config: DraftConfig, stop_token_ids=()) -> GrowthPolicy:
    """stop_token_ids: the session's (the target's EOS ids), where a branch ends."""
    return GrowthPolicy(config.branch_threshold, config.grow_width, config.grow_min_relative, config.grow_max_depth,
                        frozenset(stop_token_ids))


def chain_below(tree: GrowingTree, leaf: int, start: int) -> list[int]:
    """Nodes ``start``, ``start + 1``, ... while each is the child of the one before (the first: of ``leaf``), in
    order: a branch continued past ``leaf`` as consecutive nodes, which keeping those nodes alone leaves intact."""
    if leaf < 0:
        return []
    chain: list[int] = []
    parent = leaf
    for node in range(start, len(tree)):
        if tree.parents[node] != parent:
            break
        chain.append(node)
        parent = node
    return chain


class SpanAgreement:
    """The decayed share of a session's copied-span tokens its draft model agreed with: whether the next span's check
    runs over the whole span or first over ``SPAN_PROBE`` of its tokens (``specsplit.lookup``)."""

    def __init__(self):
        self.share = 0.0  # before any span: probe first

    def whole(self) -> bool:
        return self.share >= COPY_MIN_HITS

    def observe(self, agreed: int, checked: int) -> None:
        self.share = span_share(self.share, agreed, checked)


class GrowthRound:
    """One streamed DraftTree round of a draft model, whatever the model: grow, then draft provisionally.

    ``forward(tree, nodes, stop)`` is one draft forward: next-token logits [F, V'] of each node (-1 = the root)
    over ``vocab_ids`` (the draft's vocabulary as target ids; None: the same ids); it may raise
    ``ForwardInterrupted`` once ``stop()`` (None: never) is true, the draft's state as before it. ``forget(n)``: nodes
    from index n on were not sent for verification; their draft rows must not be attended to again.
    After ``run``, ``tree`` holds the round's nodes and ``leaf`` the end of the provisional path (-1: none).
    """

    def __init__(self, forward, forget, vocab_ids: torch.Tensor | None = None, lookup=None,
                 spans: SpanAgreement | None = None):
        """lookup(path_tokens) -> list[int]: a continuation copied from the session's text (prompt lookup) for
        the committed tokens + ``path_tokens``, or []; provisional drafting takes it before drafting on. spans: how
        much of the session's earlier spans the model agreed with (kept across rounds; default: this round's own)."""
        self.forward, self.forget, self.vocab_ids, self.lookup = forward, forget, vocab_ids, lookup
        self.spans = spans or SpanAgreement()
        self.tree = GrowingTree()
        self.leaf = -1
        self._top, self._prob = -1, 0.0  # the model's next token at the last leaf _copy looked at, its prob
        self._last_rows: dict[int, torch.Tensor] = {}  # node -> next-token logits [V'], from the latest forward
        self.stop: frozenset[int] = frozenset()  # the round's stop tokens (GrowthPolicy.stop_token_ids)
        self.from_root = False  # the round had no seeds (set by run)

    def _logits(self, nodes: list[int], stop: Callable[[], bool] | None = None, phase: str = "grow") -> torch.Tensor:
        """Next-token logits of ``nodes`` ([F, V']): one draft forward over those the latest call did not already run
        (a copied span's last node, whose row the span's forward gave). stop: the forward's (``ForwardInterrupted``).
        phase: what the forward is for (``_forward``)."""
        rows = {n: self._last_rows[n] for n in nodes if n in self._last_rows}
        missing = [n for n in nodes if n not in rows]
        if missing:
            rows.update(zip(missing, self._forward(missing, stop, phase)))
        self._last_rows = rows
        return torch.stack([rows[n] for n in nodes])

    def _forward(self, nodes: list[int], stop: Callable[[], bool] | None, phase: str) -> torch.Tensor:
        """``forward`` over ``nodes`` ([F, V']), traced and timed when it runs the model (the root's row alone is the
        committed tokens' own): a ``specsplit.draft.forward`` span and ``specsplit.draft.forward.duration``, by phase
        (grow: the tree, given: the orchestrator's chain, span: a copied prompt-lookup span, provisional: a token
        after the verified leaf) and whether the verdict stopped it (``ForwardInterrupted``)."""
        if all(n < 0 for n in nodes):
            return self.forward(self.tree, nodes, stop)
        attributes = {"specsplit.draft.phase": phase, "specsplit.num_tokens": sum(n >= 0 for n in nodes)}
        start, stopped = time.perf_counter(), False
        with tracer.start_as_current_span("specsplit.draft.forward", attributes=attributes, record_exception=False,
                                          set_status_on_exception=False) as span:
            try:
                return self.forward(self.tree, nodes, stop)
            except ForwardInterrupted:
                stopped = True
                span.set_attribute("specsplit.draft.stopped", True)
                raise
            finally:
                metrics.draft_forward_duration.record((time.perf_counter() - start) * 1e3,
                                                      {"phase": phase, "stopped": stopped})

    def _truncate(self, n: int) -> None:
        """Drop nodes from index n on: from the tree, the draft's rows (``forget``) and the rows kept here."""
        self.tree.truncate(n)
        self.forget(n)
        self._last_rows = {node: row for node, row in self._last_rows.items() if node < n}

    def _token(self, index: int) -> int:
        return index if self.vocab_ids is None else int(self.vocab_ids[index])

    def _expand(self, nodes: list[int]) -> list[list[tuple[int, float]]]:
        probs = self._logits(nodes).softmax(dim=-1)  # [F, V']
        values, indices = probs.topk(min(3, probs.shape[-1]), dim=-1)  # [F, 3]: at most 3 can be above 0.3
        return [[(self._token(i), v) for i, v in zip(indices[r].tolist(), values[r].tolist())]
                for r in range(len(nodes))]

    def run(self, seed: list[tuple[int, float]], max_nodes: int, policy: GrowthPolicy, control: "GrowthControl",
            provisional_max: int, given: list[int] | None = None) -> Iterator[GrowthStep]:
        """Each yielded step is one draft forward over the whole frontier. ``seed``: last round's kept
        provisional (token, prob) path, whose rows but the last the caller has cached in order. Once the
        orchestrator says how many nodes it sent for verification, growth stops and up to
        ``provisional_max`` tokens follow the best verified branch's leaf, one forward each, until closed.
        given: the round's tree is the seed and then these tokens (a span the orchestrator copied), run in one
        forward and streamed as one step; nothing is grown."""
        tree = self.tree
        self.stop = policy.stop_token_ids  # a branch ends at one: nothing past it is drafted, copied or drafted ahead
        start = time.perf_counter()
        self.from_root = not seed  # told that nothing was verified, provisional drafting starts at the committed tokens
        for token, prob in seed:
            tree.add(len(tree) - 1, token, prob)
        if seed:
            yield GrowthStep(0, tuple(tree.token_ids), tuple(tree.parents), tuple(tree.draft_probs),
                             seeded=len(seed), draft_ms=(time.perf_counter() - start) * 1e3)
        if given is not None:
            yield from self._given(given)
            finished = False  # nothing grows
        else:
            finished = yield from self._grow(seed, max_nodes, policy, control)
        if finished:
            yield GrowthStep(len(tree), (), (), (), done=True)
        yield from self._provisional(control, provisional_max)

    def _given(self, given: list[int]) -> Iterator[GrowthStep]:
        """The orchestrator's chain after the seed: one forward over it (its rows are provisional drafting's start)."""
        tree, first, parent = self.tree, len(self.tree), len(self.tree) - 1
        for token in given:
            parent = tree.add(parent, token, LOOKUP_PROB)
        if len(tree) > first:
            start = time.perf_counter()
            self._logits(list(range(first, len(tree))), phase="given")  # [G, V'] (kept in _last_rows)
            yield GrowthStep(first, tuple(tree.token_ids[first:]), tuple(tree.parents[first:]),
                             tuple(tree.draft_probs[first:]), draft_ms=(time.perf_counter() - start) * 1e3)

    def _grow(self, seed: list[tuple[int, float]], max_nodes: int, policy: GrowthPolicy,
              control: "GrowthControl") -> Generator[GrowthStep, None, bool]:
        """The round's own tree: a copied span first where the model agrees with one, then width-adaptive growth
        until the orchestrator verifies. Returns whether the tree stopped growing first."""
        tree = self.tree
        start = time.perf_counter()
        frontier = len(seed) - 1
        copied = [] if seed else self._copy(-1, max_nodes)  # [C] node ids
        if copied:  # a copied span first (a code edit's unchanged lines): one step, one forward over the span
            frontier = copied[-1]
            yield GrowthStep(0, tuple(tree.token_ids), tuple(tree.parents), tuple(tree.draft_probs),
                             draft_ms=(time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
        # (A growth forward is never stopped: it writes the sent leaves' rows, which provisional drafting starts from or,
        # without it, the next round would run again in its catch-up after the verdict.)
        for step in grow_tree(self._expand, max_nodes, policy, tree=tree, frontier=[frontier]):
            if control.verifying is not None or control.closed:
                return False  # the verifier already has fewer nodes than this forward made
            yield GrowthStep(step.first, step.token_ids, step.parents, step.draft_probs,
                             draft_ms=(time.perf_counter() - start) * 1e3)
            start = time.perf_counter()  # not counting the time the consumer held us at the yield
        return True

    def _provisional(self, control: "GrowthControl", provisional_max: int) -> Iterator[GrowthStep]:
        """Once told how many nodes were verified: up to ``provisional_max`` tokens after the best verified leaf. None
        verified (a span the orchestrator copied, or a round with no tree, went to the verifier instead): from the
        committed tokens themselves, one token a forward and no copied span (the verifier is checking the
        orchestrator's), in a round that had no seeds (``from_root``: the root's next-token row is the catch-up's)."""
        tree = self.tree
        control.wait()
        num_verified = control.verifying if control.verifying is not None else 0
        from_root = self.from_root and control.verifying == 0
        leaf = self.leaf = best_leaf(tree, num_verified)
        # Nodes past the verified ones that continue the best verified branch's leaf as a chain are this round's
        # first provisional tokens, already drafted: seeds past a verified prefix (a pipelined round), or what
        # growth made while nobody read it (a first round opened before the verifier's prefill).
        ahead = chain_below(tree, leaf, num_verified) if num_verified > 0 else []  # [A] node ids
        self._truncate(num_verified + len(ahead))
        for node in ahead if provisional_max and not control.closed else []:
            leaf = self.leaf = node
            yield GrowthStep(node, (tree.token_ids[node],), (tree.parents[node],), (tree.draft_probs[node],),
                             provisional=True)
        drafted = len(ahead)
        while (drafted < provisional_max and (tree.token_ids[leaf] not in self.stop if leaf >= 0 else from_root)
               and not control.closed):
            # a step with no forward reports 0 ms (the root's row is the catch-up forward's, which ran before)
            start, ran = time.perf_counter(), leaf >= 0 and leaf not in self._last_rows
            first = len(tree)
            try:
                row = (self._last_rows[leaf] if leaf in self._last_rows
                       else self._logits([leaf], self._moot(control, leaf), "provisional")[0])  # [V']
                if from_root:  # no copied span on a chain from the root: the verifier is checking one there
                    self._next(row)
                    copied = []
                else:
                    copied = self._copy(leaf, provisional_max - drafted, row, control)  # [C] node ids: a vetted span
            except ForwardInterrupted:
                return
            nodes = copied or [tree.add(leaf, self._top, self._prob)]
            leaf = self.leaf = nodes[-1]
            drafted += len(nodes)
            yield GrowthStep(first, tuple(tree.token_ids[first:]), tuple(tree.parents[first:]),
                             tuple(tree.draft_probs[first:]), provisional=True,
                             draft_ms=(time.perf_counter() - start) * 1e3 if ran or copied else 0.0)

    def _moot(self, control: "GrowthControl", node: int) -> Callable[[], bool]:
        """stop() of a provisional forward whose last row is ``node``'s: the round is over and the forward is for
        nothing, unless the verdict's committed tokens run along the path to ``node`` (then what it drafts is kept
        and seeds the next tree, which would otherwise run it again)."""
        path = [self.tree.token_ids[n] for n in self.tree.path_to(node)] if node >= 0 else []  # [P]
        return lambda: control.closed and not (control.committed is not None and follows(control.committed, path))

    def _next(self, row: torch.Tensor) -> None:
        """The model's next token after a node whose next-token logits are ``row`` ([V']), and its probability, into
        ``_top``/``_prob``."""
        prob, index = row.softmax(dim=-1).max(dim=-1)
        self._top, self._prob = self._token(int(index)), float(prob)

    def _copy(self, leaf: int, limit: int, row: torch.Tensor | None = None,
              control: "GrowthControl | None" = None) -> list[int]:
        """Prompt lookup's continuation after ``leaf`` (-1: the root), at most ``limit`` tokens, as far as the model
        drafts it too: the span is tried only if it is longer than one token and its first token is the model's own
        next token there; then a forward over it keeps the prefix along which the model's next token is each time the
        span's next one (while the session's spans have mostly been left early, ``SpanAgreement``, a forward over its
        first ``SPAN_PROBE`` tokens goes first, and the rest only follows if the model agreed with all of them).
        Returns the kept nodes (added under ``leaf``, their probabilities the model's), or [] (nothing added). Either
        way the model's next token after ``leaf`` and its probability are left in ``_top``/``_prob``. row: the leaf's
        next-token logits [V'] when already known; the lookup runs first, so the root's are only asked for when a span
        was found. control: provisional drafting's; once its round is over (the verdict came), the rest of a span whose
        probe the model agreed with is not run, and the probed tokens are kept (a dead round's forward holds up the
        next round, which reaches this draft only once it ends: on a Xeon, 150 ms for the last 14 tokens of a span);
        a span forward the verdict makes moot stops (``_moot``), its tokens left out.

        (Without the second check, a span the model agreed with only at its first token went out whole: on chat, a
        chance match then was the start of most of a pipelined tree of 25-31 nodes with 1-7 accepted, each a round trip
        lost across a network; bench/results/network_half_avx512_final/ngram_before.)"""
        path = [self.tree.token_ids[n] for n in self.tree.path_to(leaf)] if leaf >= 0 else []
        span = until_stop(self.lookup(path), self.stop)[:limit] if self.lookup is not None else []  # [S]
        if row is None and len(span) < 2:
            return []
        self._next(row if row is not None else self._logits([leaf])[0])
        if len(span) < 2 or span[0] != self._top:
            return []
        first, parent = len(self.tree), leaf
        agreed = [self._prob]  # [K] the model's probability of each kept span token
        done = 0  # span tokens in the tree and run
        checked = len(span)  # span tokens the model's agreement was checked on
        probe = len(span) if self.spans.whole() else min(SPAN_PROBE, len(span))
        for end in dict.fromkeys((probe, len(span))):  # the first `probe` tokens, then the rest if all were agreed
            for token in span[done:end]:
                parent = self.tree.add(parent, token, LOOKUP_PROB)
            nodes = list(range(first + done, first + end))  # [E] span[done:end]
            try:
                stop = self._moot(control, nodes[-1]) if control is not None else None
                probs = self._logits(nodes, stop, "span").softmax(dim=-1)  # [E, V'] row j: after span[done + j]
            except ForwardInterrupted:
                if not done:  # the round is over before the span was run: it is left out whole
                    self._truncate(first)
                    raise
                del agreed[done:]  # (the probe's tokens are kept, as when the rest is not run)
                checked = done
                break
            best, indices = probs.max(dim=-1)  # [E] each
            for j in range(end - done):
                if done + j + 1 == len(span) or self._token(int(indices[j])) != span[done + j + 1]:
                    break
                agreed.append(float(best[j]))
            done = end
            if len(agreed) <= end < len(span):
                break  # the model left the span within these tokens
            if end < len(span) and control is not None and control.closed:
                del agreed[end:]  # the model's next token after the probe is left to the next round's first step
                checked = end
                break
        self.spans.observe(len(agreed), checked)
        kept = list(range(first, first + len(agreed)))  # [K] node ids
        self._truncate(first + len(agreed))
        for node, p in zip(kept, agreed):  # root down: each node's confidence from its parent's, already set
            self.tree.set_prob(node, p)
        return kept
