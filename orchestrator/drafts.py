"""The orchestrator's side of the draft services: choosing one, starting, proposing, streaming trees, ending.

A mixin of ``orchestrator.generation.Orchestrator`` (it uses ``self.drafts``, ``self._draft_info``,
``self._learned``, ``self.config`` and ``self.verifier_info``). A failed draft never fails a generation
(``orchestrator.draft_failover``).
"""

from __future__ import annotations

import copy
import logging
import queue
import time
from dataclasses import dataclass, field

from opentelemetry import trace

from orchestrator.draft_failover import DraftFailover
from orchestrator.session import LiveSession
from orchestrator.trigger import RoundOutcome, leaves_stub, make_trigger, tree_confidence
from specsplit.errors import FailedPrecondition, InvalidArgument, Unavailable
from specsplit.growth import GrowingTree, best_leaf
from specsplit.lookup import LOOKUP_MAX, LOOKUP_PROB, SpanLookup, span_hits, use_bridge, use_span
from specsplit.provisional import follows, reconcile_provisional
from specsplit.rpc import DraftInfo, RpcError, StatusCode
from specsplit.tree import TokenTree, branch_below, union_trees, until_stop

log = logging.getLogger("orchestrator.generation")

STREAMING_DRAFTERS = ("model", "half", "half+ngram", "eagle")  # drafters that stream growing trees (DraftTree)
DRAFT_CHOICES = ("auto", "ngram", "model", "half", "half+ngram", "eagle", "eagle+ngram", "medusa", "medusa+ngram", "none")
MEDUSA = ("medusa", "medusa+ngram")  # self-speculation in the verifier (+ngram: merged with a lookup draft's tree)


class DraftMixin(DraftFailover):
    def draft_names(self) -> list[str]:
        names = []
        for draft in self.drafts:
            info = self._draft_info_of(draft)
            if info is not None:
                names.append(info.drafter)
        return names

    def _draft_info_of(self, draft) -> DraftInfo | None:
        if id(draft) not in self._draft_info:
            try:
                self._draft_info[id(draft)] = draft.info(timeout=self.config.draft_timeout_s)
            except RpcError as err:
                log.warning("draft service %s unreachable: %s", draft.address, err.code())
                return None
        return self._draft_info[id(draft)]

    def pick_draft(self, choice: str):
        """The draft service for a request's --draft choice (None: target-only)."""
        if choice not in DRAFT_CHOICES:
            raise InvalidArgument(f"unknown draft {choice!r}; choose one of {', '.join(DRAFT_CHOICES)}")
        if choice in MEDUSA:
            if not self.verifier_info.medusa:
                raise InvalidArgument(f"--draft {choice} needs a verifier started with Medusa heads (--medusa PATH)")
            if choice == "medusa" or not self.drafts:
                return None  # self-speculation: the verifier proposes (merged with an n-gram draft where there is one)
            choice = "ngram"
        if choice == "none" or (choice == "auto" and not self.drafts):
            return None  # (a drafter named where there is none is refused below, not silently dropped)
        if choice == "auto":
            return self.drafts[0]
        silent = []  # draft services whose kind is unknown: they did not answer (yet)
        for draft in self.drafts:
            info = self._draft_info_of(draft)
            if info is not None and info.drafter == choice:
                return draft
            if info is None:
                silent.append(draft.address)
        if silent:  # one of them may be that kind: not the request's fault, and worth a retry
            raise Unavailable(f"no {choice!r} draft service answered: {', '.join(silent)} did not say what it drafts "
                              f"in {self.config.draft_timeout_s:g} s; retry, or use --draft auto or none")
        raise InvalidArgument(f"no {choice!r} draft service is configured; this orchestrator has: "
                              f"{', '.join(self.draft_names()) or 'none'} (use --draft none or auto)")

    # -- drafts --------------------------------------------------------------------------------------
    def _max_nodes(self, draft, choice: str = "") -> int:
        if choice == "medusa":
            return min(self.verifier_info.max_tree_nodes, self.verifier_info.medusa_max_nodes or 64)
        if choice == "medusa+ngram":
            return self.verifier_info.max_tree_nodes
        info = self._draft_info_of(draft) if draft is not None else None
        draft_max = info.max_nodes if info is not None and info.max_nodes else 64
        return min(self.verifier_info.max_tree_nodes, draft_max)

    def _set_draft_mode(self, session: LiveSession, choice: str) -> None:
        """Medusa self-speculation, or whether the session's draft reads the target's features."""
        session.medusa = choice in MEDUSA
        info = self._draft_info_of(session.draft) if session.draft is not None else None
        session.wants_features = bool(info and info.wants_features)

    def _drafter_name(self, session: LiveSession) -> str:
        if session.medusa:
            return "medusa+ngram" if session.draft is not None else "medusa"
        info = self._draft_info_of(session.draft) if session.draft is not None else None
        return info.drafter if info else "none"

    def _start_draft(self, session: LiveSession, first: bool = True) -> None:
        """StartSession from all committed tokens; a refusal fails a new generation, mid-generation it is a failed draft."""
        try:
            session.draft.start(session.id, session.token_ids, self.verifier_info.tokenizer_fingerprint,
                                timeout=self.config.draft_timeout_s, sampling=session.sampling,
                                target_identity=self.verifier_info.target_identity,
                                stop_token_ids=self.verifier_info.eos_token_ids)
            session.unsent = []  # (features held for the draft stay: a fresh draft session starts its cache at them)
            session.state.draft_down_until = 0
        except RpcError as err:
            if first and _is_refusal(err):
                raise FailedPrecondition(f"draft service {session.draft.address} refused the session: {err.details()}") from None
            self._draft_failed(session, err)

    def _propose(self, session: LiveSession, budget: int) -> tuple[TokenTree, float | None]:
        """A whole tree (lookup drafts, sampled sessions, Medusa), without what it drafted past an EOS token."""
        tree, draft_ms = (self._propose_medusa if session.medusa else self._propose_draft)(session, budget)
        return tree.ended_at(self.verifier_info.eos_token_ids), draft_ms

    def _propose_medusa(self, session: LiveSession, budget: int) -> tuple[TokenTree, float | None]:
        """The verifier's own Medusa tree (its cost is in verify_ms), merged with the n-gram lookup's tree
        (drafted first, up to the whole budget; Medusa's tree fills the rest) when the session has a lookup draft:
        both are deterministic, so a trie union."""
        proposal, session.proposal = session.proposal or TokenTree.empty(), None
        lookup, draft_ms = self._propose_draft(session, budget) if session.draft is not None else (TokenTree.empty(), None)
        tree = union_trees(lookup, proposal, max(budget, 0))
        return tree, (draft_ms or 0.0) if len(tree) else None

    def _propose_draft(self, session: LiveSession, budget: int) -> tuple[TokenTree, float | None]:
        state = session.state
        if session.draft is None:
            return TokenTree.empty(), None
        if state.draft_down_until:
            if session.draft_paused():
                return TokenTree.empty(), None
            self._restart_draft(session)
            if state.draft_down_until:
                return TokenTree.empty(), None
        if budget <= 0:
            return TokenTree.empty(), None  # no call: committed tokens travel with the next Propose
        try:
            tree, draft_ms = session.draft.propose(session.id, session.unsent, len(session.token_ids), budget,
                                                   timeout=self.config.draft_timeout_s, features=session.features)
        except RpcError as err:
            self._draft_failed(session, err)
            return TokenTree.empty(), None
        session.unsent = []
        session.features = []
        return tree, draft_ms

    # -- streamed trees: the verification trigger and provisional generation -----------------------------
    def _streams_trees(self, session: LiveSession) -> bool:
        """Greedy or coupled-sampled sessions with a model or feature (EAGLE) draft grow their trees on the draft and
        verify on the trigger; lookup drafts (n-gram, merged with one or not) and rejection sampling send whole trees
        sized by the budget."""
        return (self.config.trigger != "budget" and not session.sampling.rejection_sampled and session.draft_usable()
                and self._drafter_name(session) in STREAMING_DRAFTERS)

    def _open_round(self, session: LiveSession, remaining: int, wait_s: float = 0.0) -> "RoundStart":
        """A streamed round up to the draft's first step: the trigger, last round's kept provisional tokens (verified
        at once if the trigger says so), a copied span, or the draft's DraftTree stream, opened (the draft grows its
        tree from then on, whether or not anyone reads it yet). wait_s: how long the round may wait before it is
        read (the stream's deadline covers it)."""
        if session.trigger is None:
            # A new session starts from what the orchestrator's latest session with this draft measured (its
            # alpha, rates, draft-or-not choice), not from scratch: the first rounds are then already sized.
            # (per kind of decoding too: a sampled session's draft probabilities are of perturbed scores)
            key = ("trigger", self.config.trigger, self._drafter_name(session), session.sampling.greedy)
            learned = self._learned.get(key) if self.config.share_estimates else None
            session.trigger = (copy.deepcopy(learned) if learned is not None else
                               make_trigger(self.config.trigger, self.config.fixed_tree_nodes,
                                            self.config.pipeline and self.config.provisional_max > 0))
            self._learned[key] = session.trigger
            session.trigger.new_session()
        trigger = session.trigger
        ahead_on = bool(self.config.pipeline and self.config.provisional_max)  # kept provisional tokens are used
        ahead, session.ahead = (session.ahead if ahead_on else []), []
        fresh = not ahead  # no kept provisional tokens: the verifier waits for this tree's every node
        if session.state.draft_down_until:  # the draft failed earlier and its pause is over: start it again
            self._restart_draft(session)
        # A draft that copies spans (half+ngram): a span prompt lookup finds is verified as it is, not the draft's tree (a
        # code edit's unchanged lines), while such spans are mostly right, or when it continues last round's kept
        # provisional tokens (the draft's own, which vouch for it) further than they go (the draft drafts on from its end).
        span = self._lookup_span(session, remaining, pipelined=bool(ahead))  # [S]
        copied = use_span(span, [t for t, _ in ahead], session.copy_hits)
        bridge = not copied and not ahead and use_bridge(session.since_copy, session.behind)
        session.since_copy = 0 if copied else session.since_copy + 1
        vouched = copied and bool(ahead)  # the span goes on from last round's kept provisional tokens
        if copied:
            ahead = []
        if copied or bridge or session.state.draft_down_until or not trigger.wants_draft():
            max_nodes = 0  # no draft model this round: a copied span, or the target decodes alone
        else:
            max_nodes = min(self._max_nodes(session.draft), self.config.tree_max_nodes, max(remaining - 1, 0))
        start = RoundStart(span, copied, fresh, max_nodes, time.perf_counter())
        tree = start.tree
        if copied:
            parent = -1
            for token in span:
                parent = tree.add(parent, token, LOOKUP_PROB)
            # A span going on from the kept provisional tokens (the draft's own tokens vouch for its start) does not
            # stop the pipeline: the draft runs it and drafts on from its end while it is verified, as under any tree.
            # (Drafting on from the end of every copied span, edit points' too, the draft's work past spans broken
            # early was waste and held up the next round: code edits 0.91x / 0.99x of this rule at RTT 0 / 50; README
            # "Where the draft's time goes".)
            if trigger.drafting and not session.state.draft_down_until and ahead_on:
                # At an edit point (no kept tokens behind the span) the draft grows nothing and drafts on from the
                # committed tokens meanwhile, as if no span were copied (``hedge``): if the span breaks early, what
                # the draft drafted is the next tree, as after any verified tree. (Before, it sat idle, then caught up
                # and grew a fresh tree: summaries and code edits ran 1.06x / 1.05x faster with this at RTT 0 / 50;
                # README "Under a copied span at an edit point".)
                start.hedge = not vouched
                given = span if vouched else []  # (a hedge: no node budget, nothing given)
                start.stream = self._open_stream(session, len(given), wait_s, given=given)
        elif max_nodes > 0:
            start.stream = self._open_stream(session, max_nodes, wait_s)
            if start.stream is not None and ahead:  # last round's kept provisional tokens: verified at once if the
                parent = -1                           # trigger says so
                for token, prob in ahead[:max_nodes]:
                    parent = tree.add(parent, token, prob)
                if trigger.should_verify(tree.confidence[parent], len(tree), kept=True) and \
                        not leaves_stub(len(tree), max_nodes, remaining):
                    start.ahead = ahead
                    start.seeded = len(tree)  # pipelined: the draft seeds these same tokens and goes on from them
                    trace.get_current_span().set_attribute("specsplit.pipelined", True)
                else:
                    start.tree = GrowingTree()  # the draft's stream brings them, and grows on
        return start

    def _open_stream(self, session: LiveSession, max_nodes: int, wait_s: float, given: list[int] = ()):
        """The draft's DraftTree stream for a round (None: the draft failed); given: the round's tree is this chain."""
        try:
            stream = session.draft.draft_tree(session.id, session.unsent, len(session.token_ids), max_nodes,
                                              self.config.provisional_max, features=session.features, given=given,
                                              timeout=wait_s + self.config.verify_timeout_s + self.config.draft_timeout_s)
        except RpcError as err:
            self._draft_failed(session, err)
            return None
        session.unsent = []
        session.features = []
        return stream

    def _open_first_round(self, session: LiveSession) -> None:
        """Open a new session's first streamed round before the verifier's prefill: the draft (its own prefill started
        with the session) grows the first tree while the verifier caches the prompt, instead of after it."""
        if self._streams_trees(session):
            session.opened = self._open_round(session, session.state.max_new_tokens, wait_s=self.config.prefill_timeout_s)

    @staticmethod
    def _drop_opened(session: LiveSession) -> None:
        """A round opened early that will not run (the prefill failed, the session ended): end the draft's round."""
        opened, session.opened = session.opened, None
        if opened is not None and opened.stream is not None:
            opened.stream.close()

    def _tree_round(self, session: LiveSession, remaining: int, verify) -> "TreeRound":
        """One round: stream the draft's growing tree until the trigger fires, verify it while the draft goes
        on provisionally from the best branch's leaf, then end the draft's round.

        verify(tree) -> (verdict, timing) is the verifier call (it may fail over; it raises on failure).
        """
        start, session.opened = session.opened, None
        if start is None:
            start = self._open_round(session, remaining)
        else:
            if session.prefill is not None:  # still running: the tree goes when it is expected to be done
                session.prefill.wait_to_send()
            start.started = time.perf_counter()  # opened before the prefill: the round starts now
        trigger, tree, stream, ahead = session.trigger, start.tree, start.stream, start.ahead
        started, seeded, fresh, span, copied, max_nodes = (start.started, start.seeded, start.fresh, start.span,
                                                           start.copied, start.max_nodes)
        steps, step_ms = 0, 0.0  # draft forwards, their time as the draft measured it (no waiting, no network)

        def add(step) -> list[int]:
            nonlocal seeded, steps, step_ms
            # Never past the round's node budget (the verifier's, --tree-max-nodes, the request's end): a draft's
            # first step brings all of last round's kept tokens, which may be more.
            nodes = list(zip(step.parents, step.token_ids, step.draft_probs))[:max(max_nodes - len(tree), 0)]
            live = [tree.add(p, t, q) for p, t, q in nodes]
            seeded += min(step.seeded, len(live))
            if live and not step.seeded and step.first > 0:  # a tree forward (the root's children
                steps += 1                                   # come from the catch-up forward)
                step_ms += step.draft_ms
                trigger.note_step(step.draft_ms)
            return live

        if stream is not None:
            try:
                # The first step may wait for the previous round's last forward and catch up on many tokens.
                timeout = self.config.draft_timeout_s * 5
                while not ahead and not copied:
                    step = stream.next(timeout=timeout)
                    timeout = self.config.draft_timeout_s
                    if step is None or step.provisional:
                        break
                    live = add(step)
                    if step.done or len(tree) >= max_nodes or (
                            trigger.should_verify(tree_confidence(tree.confidence, live), len(tree), fresh=fresh)
                            and not leaves_stub(len(tree), max_nodes, remaining)):
                        # Steps the draft grew before they were read (a first round, grown while the verifier cached
                        # the prompt) cost no wait: the trigger may verify them too, rather than leave them to the
                        # next round (the draft's growth past the verified nodes; one round trip later).
                        for grown in ([] if step.done else stream.ready()):
                            best = max((q * (tree.confidence[p] if p >= 0 else 1.0)  # its best node's confidence
                                        for p, q in zip(grown.parents, grown.draft_probs)), default=0.0)
                            if grown.provisional or len(tree) + len(grown.token_ids) > max_nodes or \
                                    not trigger.verifies_grown(best):
                                break
                            add(grown)
                        break
            except (RpcError, queue.Empty) as err:
                stream.close()
                stream = None
                tree = GrowingTree()
                self._draft_failed(session, err if isinstance(err, RpcError) else StatusCode.DEADLINE_EXCEEDED)
        draft_ms = (time.perf_counter() - started) * 1e3
        leaf = -1 if start.hedge else best_leaf(tree)  # provisional drafting continues the branch ending here
        if stream is not None:
            # growth stops; provisional drafting starts under the verification (a hedge's: at the committed tokens)
            stream.verifying(0 if start.hedge else len(tree))
            if not self.config.provisional_max or (leaf >= 0 and not copied and
                                                   not trigger.provisional_worth(tree.confidence[leaf])):
                stream.close()  # the draft stops (a provisional forward at its next layer)
        token_tree = TokenTree(tuple(tree.token_ids), tuple(tree.parents), tuple(tree.draft_probs))
        after_prefill = session.prefill is not None  # the call waits for the prompt's prefill too
        verdict = None
        try:
            verdict, timing = verify(token_tree)
        finally:
            if stream is not None:  # the draft stops its running forward, unless that drafts along the committed tokens
                stream.close(list(verdict.committed_token_ids) if verdict is not None else None)
        round_ms = (time.perf_counter() - started) * 1e3
        committed = list(verdict.committed_token_ids)
        accepted = len(verdict.accepted_nodes)
        provisional: list[tuple[int, float]] = []  # [P] (token, draft prob) drafted from the leaf meanwhile
        under: list[float] = []  # ms of each draft forward the draft ran during the verification
        try:
            arrived = stream.ready() if stream is not None else []
            under = [s.draft_ms for s in arrived if s.provisional and s.draft_ms > 0]
            # (else: the draft drafted on from another leaf)
            if start.hedge or not (ahead or copied) or _draft_seeded(arrived, tree.token_ids, copied):
                provisional = [(t, q) for s in arrived if s.provisional for t, q in zip(s.token_ids, s.draft_probs)]
        except RpcError:
            pass
        if span:
            session.copy_hits = span_hits(session.copy_hits, span, committed)
        session.behind = 0 if stream is not None else session.behind + len(committed)
        path = tree.path_to(leaf) if leaf >= 0 else []
        route = [(tree.token_ids[n], tree.draft_probs[n]) for n in path] + provisional
        route_ids = [t for t, _ in route]  # [R]
        kept = reconcile_provisional(committed, route_ids)
        # Provisional drafting followed the committed path, bonus token included (with a verification ~2 draft forwards
        # long it often has nothing past it to keep, yet the pipeline works: the draft is already on the right path).
        followed = follows(committed, route_ids)
        if kept:
            session.ahead = route[len(route) - len(kept):]
        branch = branch_below(tree.parents, verdict.accepted_nodes[-1]) if accepted else path
        trigger.observe(RoundOutcome(
            num_drafted=len(branch), num_accepted=accepted, nodes=len(tree), after_prefill=after_prefill,
            confidences=tuple(tree.confidence[n] for n in branch), committed=len(committed), round_ms=round_ms,
            draft_steps=steps, draft_ms=step_ms, plain=max_nodes == 0, copied=copied, pipelined_next=followed,
            verify_ms=getattr(timing, "call_ms", 0.0) or 0.0, provisional_steps=len(under), provisional_ms=sum(under)))
        # Provisional tokens along the committed path are drafted right: the first is this round's bonus token (before,
        # it counted as waste, one token in every pipelined round), the rest are kept; off the path all are waste.
        wasted = len(tree) - accepted + (0 if followed else len(provisional))
        return TreeRound(token_tree, draft_ms if len(tree) else None, verdict, timing, wasted, seeded)

    def _lookup_span(self, session: LiveSession, remaining: int, pipelined: bool = False) -> list[int]:
        """What prompt lookup copies after the committed tokens ([S]; [] unless the draft copies spans): as long as the
        trigger says, at most ``LOOKUP_MAX`` past kept tokens (``pipelined``; bench/NETWORK.md "Code edits across the
        network", measured again in "The level-scored stretch on a Xeon with AVX-512 VNNI": sized by the trigger there,
        code edits ran 0.85-0.89x at RTT 0)."""
        if not self._drafter_name(session).endswith("+ngram") or session.sampling.rejection_sampled:
            return []
        session.lookup = session.lookup or SpanLookup()
        budget = min(self._max_nodes(session.draft), self.config.tree_max_nodes, max(remaining - 1, 0))
        span = until_stop(session.lookup.span(session.token_ids, max_len=budget), self.verifier_info.eos_token_ids)
        return span[:min(budget, LOOKUP_MAX) if pipelined else session.trigger.span_nodes(budget)]


def _draft_seeded(steps, token_ids, given: bool = False) -> bool:
    """Whether the draft's round began with the tree the orchestrator sent (a pipelined round: its seeded step starts
    with those tokens; given, a copied span's: its seeded step and the span's, its only ones before the provisional
    ones, hold them), so its provisional tokens continue that tree's leaf."""
    drafted = [t for s in steps if (s.seeded or given) and not s.provisional for t in s.token_ids]  # [D]
    return len(drafted) >= len(token_ids) > 0 and tuple(drafted[: len(token_ids)]) == tuple(token_ids)


def _is_refusal(err) -> bool:
    return hasattr(err, "code") and err.code() in (StatusCode.FAILED_PRECONDITION, StatusCode.INVALID_ARGUMENT)


@dataclass
class RoundStart:
    """A streamed round as ``_open_round`` left it, before the draft's steps are read."""

    span: list[int]  # [S] what prompt lookup copies (the tree, when ``copied``)
    copied: bool  # the tree is that span, not the draft's (which may draft on from its end: ``stream``)
    fresh: bool  # no kept provisional tokens to start from
    max_nodes: int  # the draft's node budget this round (0: no draft model)
    started: float  # perf_counter() at the round's start
    tree: GrowingTree = field(default_factory=GrowingTree)  # the copied span, or the kept tokens verified at once
    ahead: list[tuple[int, float]] = field(default_factory=list)  # those kept tokens (token, draft prob), if so
    seeded: int = 0  # tree nodes seeded by them
    stream: object | None = None  # the draft's TreeStream (None: no draft call this round)
    hedge: bool = False  # a copied span's round whose draft drafts on from the committed tokens, not from the span


@dataclass(frozen=True)
class TreeRound:
    tree: TokenTree  # what was verified
    draft_ms: float | None  # drafting until the trigger (None: nothing drafted)
    verdict: object  # specsplit.accept.Verdict
    timing: object  # specsplit.rpc.VerifyTiming
    wasted: int  # drafted tokens not committed: off the accepted path, and provisional ones dropped
    provisional_kept: int  # tree nodes seeded by last round's provisional tokens
