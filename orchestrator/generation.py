"""The orchestrator's loop: propose -> verify -> accept -> commit -> stream, with failover and resume.

Each round ends with a compare-and-set write of the session's state to the session store (the round
number is the fencing token) *before* its tokens are streamed. A client whose orchestrator died
resumes on any orchestrator sharing the store, saying how many generated tokens it has; the stream
continues from there, so no token is lost and none is repeated. A verifier replica that dies moves its
sessions to another replica (``orchestrator.placement``); draft services are handled by
``orchestrator.drafts``. The loop talks to services through the typed
adapters in ``specsplit.rpc`` and never sees protobuf.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from collections.abc import Iterator

from opentelemetry import trace

from orchestrator.detok import TextStream
from orchestrator.drafts import DraftMixin
from orchestrator.placement import KvPlacement
from orchestrator.replicas import ReplicaSet, plaintext_hint
from orchestrator.requests import GenerationRequest, check_request, tokenize_prompt
from orchestrator.session import LiveSession, burst_sizer, controller_from_state, text_stream_at
from specsplit import metrics as meter
from specsplit.config import OrchestratorConfig
from specsplit.errors import (DataLoss, FailedPrecondition, NotFound, ResourceExhausted, SpecSplitError, StaleRound,
                              Unavailable, made_no_session)
from specsplit.rpc import DraftInfo, RpcError, VerifierInfo
from specsplit.store import CANCELLED, DETACHED, FINISHED, RUNNING, TERMINAL, InMemoryStore, SessionState, update
from specsplit.stream import Chunk, RoundStats
from specsplit.tree import TokenTree

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)


class _CancelledElsewhere(Exception):
    """A Cancel call (possibly on another orchestrator) cancelled the session between two rounds."""


class Orchestrator(DraftMixin):
    def __init__(self, verifiers, drafts: list, tokenizer, config: OrchestratorConfig | None = None, store=None):
        """verifiers: RemoteVerifier replicas (or one); drafts: RemoteDraft objects in "auto" preference
        order; store: a SessionStore (default: an in-process one)."""
        self.config = config or OrchestratorConfig()
        self.replicas = ReplicaSet(list(verifiers) if isinstance(verifiers, (list, tuple)) else [verifiers],
                                   self.config.health_interval_s, cut_after=self.config.health_cut_after)
        self.store = store if store is not None else InMemoryStore()
        self.placement = KvPlacement(self.replicas, self.store, self.config)
        self.tokenizer = tokenizer
        self.instance = uuid.uuid4().hex[:12]
        self._verifier_info: VerifierInfo | None = None
        self.drafts = list(drafts)
        self._draft_info: dict[int, DraftInfo] = {}
        self._live: dict[str, LiveSession] = {}  # sessions this process is generating now
        self._cancelled_early: dict[str, float] = {}  # ids a Cancel named before they existed -> when (monotonic)
        self._cancel_lock = threading.Lock()
        # The latest session's verification trigger per draft (``share_estimates``): a new session starts
        # from its estimates instead of from scratch. Estimates only: no token depends on them (streamed
        # trees are greedy or coupled draws: the tokens are the target's whatever the trigger does).
        self._learned: dict[object, object] = {}
        # Generations running now, at most max_streams: each holds one of the server's threads, and a call past them
        # would wait for a thread with no word (a Cancel or a health check queued behind it).
        self._streams = threading.BoundedSemaphore(self.config.max_streams)

    def close(self, wait_s: float = 5.0) -> None:
        deadline = time.monotonic() + wait_s
        while self._live and time.monotonic() < deadline:  # cancelled generations end their round before the channels
            time.sleep(0.01)
        self.placement.close()  # Release calls still out go first
        self.replicas.close()

    def generating(self) -> int:
        """Generations this process is running now (until each has settled its session, its verifier caches freed)."""
        return len(self._live) + self.placement.releasing()

    # -- setup ---------------------------------------------------------------------------------------
    @property
    def verifier_info(self) -> VerifierInfo:
        if self._verifier_info is None:
            errors = []
            for replica in self.replicas:
                try:
                    self._verifier_info = replica.client.info(timeout=self.config.draft_timeout_s * 5)
                    break
                except RpcError as err:
                    errors.append(f"{replica.address}: {err.code().name}{plaintext_hint(err)}")
            else:
                raise Unavailable(f"no verifier replica answered ({'; '.join(errors)}); retry later")
        return self._verifier_info

    def prompt_token_ids(self, prompt: str = "", messages: list[dict] | None = None,
                         token_ids: list[int] | None = None, chat_template: bool = True) -> list[int]:
        return tokenize_prompt(self.tokenizer, prompt, messages, token_ids, chat_template, self.verifier_info.max_context)

    def validate(self, request: GenerationRequest) -> None:
        check_request(request, self.verifier_info, self.config.max_new_tokens_limit)

    # -- starting, resuming, settling -------------------------------------------------------------------
    def _start(self, request: GenerationRequest) -> LiveSession:
        self.validate(request)
        info = self.verifier_info
        draft = self.pick_draft(request.draft)
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        state = SessionState(
            session_id=request.session_id or uuid.uuid4().hex, prompt_token_ids=list(request.prompt_token_ids),
            max_new_tokens=min(request.max_new_tokens, info.max_context - len(request.prompt_token_ids)),
            sampling=request.sampling, seed=seed, stop=list(request.stop), draft=request.draft, round=1,
            resumable=request.resumable, owner=self.instance)
        session = LiveSession(state, draft, controller_from_state(state, self._max_nodes(draft, request.draft)),
                              TextStream(self.tokenizer, list(request.stop)), owned=True)
        self._set_draft_mode(session, request.draft)
        session.burst = burst_sizer(state, self.config, draft is not None or session.medusa, self.verifier_info)
        session.save_controller()
        with self._cancel_lock:  # (a Cancel that came before the session existed is honoured now)
            self.store.create(state)  # a taken session id is refused here
            if self._cancelled_early.pop(state.session_id, None) is not None:
                session.cancel.set()
        try:
            if draft is not None:  # first: a model draft prefills the prompt and grows its first tree meanwhile
                self._start_draft(session)
                self._open_first_round(session)
            if session.opened is not None and self.config.early_verify and not session.wants_features:
                session.prefill = self.placement.start_prefill(session)  # the first round sends its tree early
            if session.prefill is None:
                self.placement.prefill(session)
                self._commit_started(session)  # the store now names the replica holding the cache
        except BaseException:
            self._abandon(session)
            raise
        return session

    def _abandon(self, session: LiveSession) -> None:
        """A new session whose start failed: free what it holds and forget it (its id may be used again)."""
        self._drop_opened(session)
        self._end_draft(session)
        self.placement.release(session)
        self.store.delete(session.id)

    def _prefilled(self, session: LiveSession) -> None:
        """Wait for a new session's prefill still running (``placement.PrefillInFlight``); if it failed, the session
        is abandoned (as a failed start is) and the error raised."""
        inflight, session.prefill = session.prefill, None
        if inflight is None:
            return
        try:
            inflight.future.result()
        except BaseException as err:
            self._abandon(session)
            session.lost = True  # nothing left for _settle to do
            raise made_no_session(err)
        self._commit_started(session)  # the store now names the replica holding the cache

    def _commit_started(self, session: LiveSession) -> None:
        """A new session's first write, once its prompt is cached; a Cancel that came during the prefill (it bumped
        the stored round) cancels it: the stream ends with finish_reason "cancelled", not with an error."""
        try:
            self._commit(session)
        except _CancelledElsewhere:
            session.cancel.set()

    def _resume(self, request: GenerationRequest) -> LiveSession:
        session_id, client_has = request.resume_session_id, request.resume_from_token
        state = self.store.load(session_id)
        if state is None or not state.resumable:  # (a plain session's tokens are its own stream's alone)
            raise NotFound(f"session {session_id!r} is not in the session store as a resumable one: it never started "
                           "(with resume=True), or it ended or expired too long ago; start a new generation")
        owned = state.status not in TERMINAL
        draft = self.pick_draft(state.draft) if owned else None
        session = LiveSession(state, draft, controller_from_state(state, self._max_nodes(draft, state.draft)),
                              text_stream_at(self.tokenizer, state, min(client_has, state.generated)), owned=owned)
        self._set_draft_mode(session, state.draft)
        session.burst = burst_sizer(state, self.config, draft is not None or session.medusa, self.verifier_info)
        if not owned:
            return session  # finished or cancelled: only what the client is missing is sent
        session.skip = max(0, client_has - state.generated)  # the store lost rounds the client had seen
        if session.skip and state.sampling.rejection_sampled and state.sampling.seed is None:
            # Greedy, coupled and seeded rounds come out the same again; unseeded rejection sampling's trees follow
            # timings, so its draws would differ, and what follows the client's tokens would be drawn after others.
            raise DataLoss(f"session {session_id!r}: the session store lost the last {session.skip} tokens this "
                           "client received (a store restarted without its last writes), and rejection sampling without "
                           "a seed cannot draw them again exactly; start a new generation (with a seed, a resume draws "
                           "them again exactly)")
        state.status, state.owner, state.resumable = RUNNING, self.instance, True
        try:
            self._commit(session)  # the claim: a concurrent resume of the same session loses here
        except (StaleRound, _CancelledElsewhere):
            raise FailedPrecondition(f"session {session_id!r} was just resumed or cancelled by another request; "
                                     "resume it again to continue from its current state") from None
        self.placement.attach(session)
        return session

    def _settle(self, session: LiveSession) -> None:
        """After the stream: free a finished or cancelled session everywhere; detach a resumable one."""
        state = session.state
        if session.prefill is not None:  # (a stream that ended before its first Verify)
            try:
                self._prefilled(session)
            except BaseException as err:  # noqa: BLE001 - abandoned; the stream already ended with its own error
                log.info("session %s: prefill failed after its stream ended: %s", session.id, err)
        self._drop_opened(session)  # (a session that ended before its first round)
        if not session.owned or session.lost:  # a replay, or another request owns the session now
            # Free the caches this process placed that the owner does not use (where the store does not say: none).
            owner = self.store.load(session.id) if session.lost else None
            if session.lost and (owner is None or owner.verifier):
                self.placement.release(session, wait=False, keep=owner.verifier if owner else "")
            else:
                self.placement.forget(session)
            return
        self._end_draft(session)
        if state.status not in TERMINAL and state.resumable and not (session.cancel.is_set() or session.failed):
            # The client went away (or this process hit an error): keep everything for a resume.
            if not self.placement.offload(session):
                self.placement.forget(session)  # the cache stays on its replica for the resume
            state.status = DETACHED
        else:
            self.placement.release(session, wait=False)  # the stream ends without waiting a round trip for it
            self.store.drop_kv(session.id)
            state.kv_length = 0
            if state.status not in TERMINAL:
                state.status, state.finish_reason = CANCELLED, "error" if session.failed else "cancelled"
        if not session.committed_final:
            try:
                self._commit(session)
            except (SpecSplitError, _CancelledElsewhere) as err:
                log.info("final write of session %s skipped: %s", session.id, err)

    def cancel(self, session_id: str) -> bool:
        """Cancel a session wherever it runs (its orchestrator notices at its next commit) and free it."""
        live = self._live.get(session_id)
        if live is not None:
            live.cancel.set()
        cancelled = []

        def mark(state: SessionState):
            if state.status in TERMINAL:
                return False
            state.status, state.finish_reason = CANCELLED, "cancelled"
            cancelled.append(state)

        with self._cancel_lock:
            update(self.store, session_id, mark)
            if not cancelled and live is None:  # not started yet (a Cancel sent right after its Generate): when it
                now = time.monotonic()  # starts within a minute, it starts cancelled
                self._cancelled_early = {k: t for k, t in list(self._cancelled_early.items())[-9999:] if now - t < 60}
                self._cancelled_early[session_id] = now
        if cancelled:
            if cancelled[-1].verifier:
                self.placement.release_at(cancelled[-1].verifier, session_id)
            self.store.drop_kv(session_id)
        return bool(cancelled) or live is not None

    def _commit(self, session: LiveSession) -> None:
        state = session.state
        state.round += 1
        session.save_controller()
        try:
            self.store.commit(state)
        except StaleRound:
            fresh = self.store.load(session.id)
            if fresh is not None and fresh.status == CANCELLED:
                raise _CancelledElsewhere() from None
            if not self._retake_round(state, fresh):
                session.lost = True
                raise
        session.committed_final = state.status in TERMINAL or state.status == DETACHED

    def _retake_round(self, state: SessionState, fresh: SessionState | None) -> bool:
        """After a write refused as stale: if the store holds less than our last write and nobody else wrote since (a
        write failed unapplied; a store restarted older or empty), write ``state`` over it: this process has it all."""
        if fresh is not None and not (fresh.owner == state.owner == self.instance and fresh.round < state.round - 1):
            return False
        try:
            self.store.commit(state, after=fresh.round if fresh is not None else 0)
        except StaleRound:
            return False
        return True

    # -- the loop ------------------------------------------------------------------------------------
    def generate(self, request: GenerationRequest, cancelled: threading.Event | None = None) -> Iterator[Chunk]:
        """cancelled: set when the client's stream is gone. Past ``max_streams`` generations at once: refused at once
        (RESOURCE_EXHAUSTED: the client may retry later or on another orchestrator)."""
        if not self._streams.acquire(blocking=False):
            raise ResourceExhausted(f"this orchestrator runs {self.config.max_streams} generations already "
                                    "(max_streams); retry later or on another orchestrator")
        try:
            yield from self._generate(request, cancelled)
        finally:
            self._streams.release()

    def _generate(self, request: GenerationRequest, cancelled: threading.Event | None) -> Iterator[Chunk]:
        cancelled = cancelled or threading.Event()
        try:
            info = self.verifier_info
        except Unavailable as err:  # no verifier replica answered: a start made nothing (a resume's session stays)
            raise err if request.resume_session_id else made_no_session(err)
        with tracer.start_as_current_span(f"specsplit.orchestrator.generate {info.model}") as span:
            span.set_attributes({"gen_ai.operation.name": "text_completion", "gen_ai.request.model": info.model,
                                 "specsplit.resumed": bool(request.resume_session_id)})
            started = None if request.resume_session_id else time.perf_counter()  # for a new one's first tokens
            try:
                session = self._resume(request) if request.resume_session_id else self._start(request)
            except BaseException as err:  # refused (a bad request, at capacity, nothing to resume): no session
                span.set_attribute("error.type", type(err).__qualname__)
                meter.generations.add(1, {"finish_reason": "refused"})
                raise err if request.resume_session_id else made_no_session(err)  # (a failed start is abandoned)
            state = session.state
            self._live[session.id] = session
            before = (state.generated, state.rounds)  # (a resumed session's, made before this call)
            span.set_attributes({"gen_ai.request.max_tokens": state.max_new_tokens, "gen_ai.conversation.id": session.id,
                                 "gen_ai.usage.input_tokens": len(state.prompt_token_ids)})
            ended = "unfinished"  # the client left, or a transient outage (a resumable session can be resumed)
            try:
                if session.draft is not None and request.resume_session_id:  # (a new session's started in _start)
                    self._start_draft(session)
                if session.prefill is None:  # else once the prefill is done: a failed one is an error, not a stream
                    yield session.announce()
                yield from session.replay(request.resume_from_token)
                if state.status == RUNNING:
                    rounds = self._rounds(session, cancelled, info)
                    try:
                        for chunk in rounds:
                            if not session.announced:  # the prefill is done by any round's end
                                yield session.announce()
                            if chunk.token_ids and started is not None:
                                meter.time_to_first_token.record((time.perf_counter() - started) * 1e3)
                                started = None
                            yield chunk
                    finally:
                        rounds.close()
            except (GeneratorExit, Unavailable, StaleRound):
                raise  # the client left, or a transient outage: a resumable session stays resumable
            except BaseException as err:
                session.failed, ended = True, "error"
                span.set_attribute("error.type", type(err).__qualname__)
                raise
            finally:
                try:
                    self._settle(session)
                finally:
                    if self._live.get(session.id) is session:  # (a resume elsewhere in this process may own the id now)
                        del self._live[session.id]
                ended = state.finish_reason or ended
                meter.generations.add(1, {"finish_reason": ended})
                span.set_attributes({"gen_ai.response.finish_reasons": [ended],  # this call's tokens and rounds only
                                     "gen_ai.usage.output_tokens": state.generated - before[0],
                                     "specsplit.rounds": state.rounds - before[1]})

    def _rounds(self, session: LiveSession, cancelled: threading.Event, info: VerifierInfo) -> Iterator[Chunk]:
        state = session.state
        eos = set(info.eos_token_ids)
        while True:
            if session.prefill is not None and (session.cancel.is_set() or cancelled.is_set()):
                self._prefilled(session)  # (before anything ends the stream)
            if session.cancel.is_set():
                state.status, state.finish_reason = CANCELLED, "cancelled"
                yield Chunk(session.stream.finish(), [], finish_reason="cancelled")
                return
            if cancelled.is_set():
                return  # the client is gone: _settle detaches (resumable) or cancels the session
            remaining = state.max_new_tokens - state.generated
            round_start = time.perf_counter()
            with tracer.start_as_current_span("specsplit.orchestrator.round") as span:
                state.rounds += 1
                span.set_attribute("specsplit.round", state.rounds)
                wasted = kept_provisional = 0
                if self._streams_trees(session):
                    done = self._tree_round(session, remaining, lambda t: self._verify(session, t, remaining))
                    tree, draft_ms, verdict, timing = done.tree, done.draft_ms, done.verdict, done.timing
                    wasted, kept_provisional = done.wasted, done.provisional_kept
                else:
                    budget = session.controller.choose(remaining - 1) if session.draft_usable() else 0
                    tree, draft_ms = self._propose(session, budget)
                    verdict, timing = self._verify(session, tree, remaining, session.tree_burst(tree, remaining))
                    wasted = len(tree) - len(verdict.accepted_nodes)
                    session.observe_budget_round(tree, verdict, timing, draft_ms, round_start)
                committed = list(verdict.committed_token_ids)
                span.set_attribute("specsplit.num_draft_tokens", len(tree))
                span.set_attribute("specsplit.num_accepted", len(verdict.accepted_nodes))
                span.set_attribute("specsplit.num_decoded", len(verdict.decoded_token_ids))
                span.set_attribute("specsplit.feature_bytes", session.feature_bytes)
            feature_bytes, session.feature_bytes = session.feature_bytes, 0
            session.unsent.extend(committed)
            state.committed_token_ids.extend(committed)
            finish, visible = "", committed
            for i, token in enumerate(committed):
                if token in eos:
                    visible, finish = committed[: i + 1], "eos"
                    break
            sent = session.stream.mark()
            hidden, kept, text, hit_stop = session.add_text(visible)
            if hit_stop:
                finish = "stop"
            state.generated += len(hidden) + len(kept)
            if not finish and state.generated >= state.max_new_tokens:
                finish = "length"
            if finish:
                text += session.stream.finish() if finish != "stop" else ""
                state.status, state.finish_reason = FINISHED, finish
            try:
                self._commit(session)  # before streaming: a resuming client never misses a sent token
            except _CancelledElsewhere:  # (this round's tokens are not sent; the text held back of those sent is)
                state.status, state.finish_reason = CANCELLED, "cancelled"
                session.stream.rewind(sent)
                yield Chunk(session.stream.finish(), [], finish_reason="cancelled")
                return
            stats = RoundStats(state.rounds, len(tree), len(verdict.accepted_nodes), len(kept), draft_ms or 0.0,
                               timing.verify_ms, self._drafter_name(session) if tree else "none", tree.depth,
                               feature_bytes, wasted, kept_provisional, len(verdict.decoded_token_ids))
            meter.record_round(stats, round_start)
            if kept or text or finish:
                yield Chunk(text, kept, stats=stats, finish_reason=finish)
            if finish:
                return

    def _verify(self, session: LiveSession, tree: TokenTree, remaining: int, steps: int | None = None):
        """Verify the round's tree -> (verdict, timing). With no tree the target decodes a burst of tokens
        alone in the same request (``orchestrator.burst``), sized by the round trips measured so far; ``steps``:
        decode steps after the verdict (``LiveSession.tree_burst``; None: a tree's none, no tree's a burst)."""
        if steps is None:
            steps = 0 if len(tree) else session.burst.tokens(remaining) - 1
        if session.prefill is not None:  # a new session's first round, its prefill still running
            reply = self._verify_first(session, tree, remaining, steps)  # (its call time includes the prefill's)
        else:
            reply = self.placement.verify(session, tree, remaining, decode_steps=steps)
            session.burst.observe(reply.timing.call_ms, reply.timing.verify_ms, len(reply.verdict.committed_token_ids),
                                  plain=not len(tree), decoded=len(reply.verdict.decoded_token_ids) if len(tree) else 0,
                                  busy_ms=reply.timing.busy_ms)
        return reply.verdict, reply.timing

    def _verify_first(self, session: LiveSession, tree: TokenTree, remaining: int, steps: int):
        """The first Verify, sent as the prefill is expected to end in the verifier (``placement.PrefillInFlight``),
        before its answer is back; if it could not be, it is sent again once the prefill is done."""
        session.prefill.wait_to_send()
        early = None if session.prefill.future.done() else self.placement.send_early(session, tree, remaining, steps)
        self._prefilled(session)
        if early is not None and early[0] is session.replica:
            self.placement.verified(session, *early)
            return early[1]
        return self.placement.verify(session, tree, remaining, decode_steps=steps)

