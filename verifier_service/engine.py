"""The target side: sessions in KV slots, batched tree verification, greedy/sampled acceptance, compaction.

A session's slot holds every committed token except the last one (the *pending* token). Verify runs the pending
token (the tree's root) plus all tree nodes, accepts, then compacts the slot to prefix + root + accepted path; the
recovered/bonus token becomes the new pending token. An empty tree is therefore exactly one step of plain decoding,
and a Verify may go on with such steps on the following ticks (a *decode burst*: the target decoding alone, batched
with everyone else's work) before it answers.

Verify and Prefill calls from many sessions are batched: the scheduler (``verifier_service.scheduler``) gathers them
into ticks on the one model thread; each tick's rows run as one packed forward (``verifier_service.batching``; on a
GPU, optionally a CUDA graph: ``verifier_service.graphs``) over the slot cache (``verifier_service.slots``), and every
request is answered with exactly its own result. Prefill is cached ``prefill_chunk`` tokens per tick, riding along
with everyone's verification.

A session's cache can also leave and arrive as bytes (ExportSession, ImportSession: ``verifier_service.transfer``).

A session may ask at Prefill for the target's *features* (final hidden states after the final norm,
``specsplit.features``) of every position it newly caches -- taken from the same forward, no extra one -- for a
feature drafter, and for *Medusa proposals*: the verifier's own heads (``verifier_service.medusa``) turn the feature
of the last cached position into the tree the next Verify checks (self-speculation, no draft service).

Coupled draws come from (seed, position); rejection sampling with a seed reseeds every round from (seed, committed
length): another replica (after failover, an import or a re-prefill) continues with exactly the same draws.
"""

from __future__ import annotations

import logging
import time

import torch
from opentelemetry import trace

from specsplit import metrics as meter
from specsplit.accept import Verdict, accept_greedy
from specsplit.config import VerifierConfig
from specsplit.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from specsplit.features import Features
from specsplit.llama import kv_shape
from specsplit.models import LoadedModel
from specsplit.sampling import SamplingParams, accept_sampled, distribution, round_seed, scores
from specsplit.tree import TokenTree
from verifier_service.batching import (Row, cost_shares, group_overhead_for, pack_rows, prefill_row, row_offsets,
                                       verify_row)
from verifier_service.scheduler import Scheduler, Work
from verifier_service.sessions import ADMISSION_GRACE_S, SessionTable
from verifier_service.graphs import graphed_forward_for
from verifier_service.lean import packed_forward_for
from verifier_service.prefix import Prefilling, PrefixCache
from verifier_service.slots import SlotStore
from verifier_service.transfer import KVTransfer, ms_since
from verifier_service.work import (BatchStats, ExportWork, ImportWork, PrefillResult, PrefillWork, ReleaseWork,
                                   TargetSession, VerifyResult, VerifyWork)

tracer = trace.get_tracer(__name__)
log = logging.getLogger(__name__)

ACTIVE_WINDOW_S = 1.0  # a session answered longer ago than this is idle: no tick waits for it


class TargetEngine(KVTransfer):
    def __init__(self, loaded: LoadedModel, config: VerifierConfig | None = None, medusa=None):
        """medusa: a ``verifier_service.medusa.MedusaProposer`` (None: no self-speculation)."""
        self.loaded = loaded
        self.medusa = medusa
        self.model = loaded.model
        self.config = config or VerifierConfig()
        self.config.validate()
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_context = self.config.max_context or int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.device = self.model.device
        self.dtype = self.model.dtype
        self.stats = BatchStats()
        self._num_layers = int(self.model.config.num_hidden_layers)
        self._kv_shape = kv_shape(self.model.config)  # (H_kv, D) of its K/V
        self._packed_forward = packed_forward_for(self.model, self.config.lean_forward)
        self._graphs = graphed_forward_for(self._packed_forward, self.config, self.max_context, self.device, self.dtype)
        self._store = SlotStore(self.config.max_sessions, self.config.kv_grow_tokens, scratch=bool(self._graphs))
        self._prefixes = PrefixCache(self.config.prefix_cache_tokens)
        self._prefilling: list[PrefillWork] = []  # prompts being prefilled (model thread only)
        self._parked: list[PrefillWork] = []  # new prompts waiting for one of those to compute their shared start
        self._group_overhead = group_overhead_for(self.device, self.config.attention_group_overhead)
        self._sessions = SessionTable(self.config.max_sessions, self.config.max_queued_prefill_tokens)
        cfg = self.config
        self._eos = frozenset(self.eos_token_ids)  # a decode burst stops after one of these
        self._scheduler = Scheduler(self._tick, cfg.max_batch, cfg.max_batch_tokens, cfg.batch_wait_ms / 1e3,
                                    expected=self._expected_sessions, threads=cfg.threads)

    @property
    def eos_token_ids(self) -> list[int]:
        """What HF ``generate`` stops at: the generation config's EOS ids (none: generation runs to its length; the
        tokenizer's EOS token is not one then, or the output would end where the target's own decoding goes on)."""
        eos = self.model.generation_config.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    def num_sessions(self) -> int:
        return len(self._sessions)

    def close(self) -> None:
        self._scheduler.close()  # (the ticks run on until the works in flight are done, for up to 10 s)
        for work in self._parked:
            if not work.future.done():
                work.future.set_exception(Unavailable("the verifier shut down before this request ran"))

    def clear_prefixes(self) -> None:
        """Forget the kept prompts' K/V (``verifier_service.prefix``): later prompts are computed whole."""
        self._prefixes.clear()

    def _expected_sessions(self, deadline: float) -> set[int]:
        """The sessions (ids) a tick waits for until ``deadline``: answered within the last ACTIVE_WINDOW_S and,
        by their usual turnaround, back by then. One whose edge usually takes longer (a far network, a slow
        draft) is not waited for -- the model would idle for it -- and rides in a later tick instead."""
        recent = time.perf_counter() - ACTIVE_WINDOW_S
        return {id(s) for s in self._sessions.all()
                if s.answered_at > recent and s.answered_at + s.turnaround_s <= deadline}

    # -- the API (any thread) ------------------------------------------------------------------------
    def prefill(self, session_id: str, prompt_token_ids: list[int], sampling: SamplingParams | None = None,
                return_features: bool = False, medusa: bool = False) -> PrefillResult:
        """Cache the prompt (all but its last token, which becomes the pending token).

        return_features / medusa: this and every later answer of the session carries the features of the
        newly cached positions / a Medusa proposal tree."""
        sampling = sampling or SamplingParams()
        sampling.validate(), sampling.check_seeded()
        self._check_new(session_id, prompt_token_ids)
        if medusa and self.medusa is None:
            raise FailedPrecondition("this verifier has no Medusa heads (start it with --medusa PATH)")
        to_cache = list(prompt_token_ids[:-1])
        session = self._sessions.admit(session_id, prompt_token_ids, sampling, len(to_cache))  # its lock held
        session.return_features, session.medusa = return_features, medusa
        work = PrefillWork(session, min(len(to_cache), self.config.prefill_chunk), session=session, token_ids=to_cache)
        try:
            with tracer.start_as_current_span("specsplit.verifier.prefill") as span:
                span.set_attribute("specsplit.prompt_tokens", len(prompt_token_ids))  # (also a failover's re-prefill)
                result: PrefillResult = self._scheduler.submit(work).result()
                if result.features is not None:
                    span.set_attribute("specsplit.feature_bytes", result.features.nbytes)
                return result
        except BaseException:
            self.release(session_id, expected=session)
            raise
        finally:
            session.lock.release()

    def _check_new(self, session_id: str, token_ids: list[int]) -> None:
        if not session_id:
            raise InvalidArgument("session_id is empty")
        if not token_ids:
            raise InvalidArgument("prompt is empty: give at least one token")
        if len(token_ids) >= self.max_context:
            raise InvalidArgument(
                f"prompt has {len(token_ids)} tokens; this model's context holds {self.max_context} "
                "(prompt + generated); shorten the prompt"
            )
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")

    def session(self, session_id: str) -> TargetSession:
        return self._sessions.get(session_id)

    def verify(self, session_id: str, tree: TokenTree, expected_committed_length: int, max_commit: int = 0,
               decode_steps: int = 0) -> VerifyResult:
        """Verify the tree; then (decode_steps) decode alone up to that many more tokens, one tick each,
        stopping early at an EOS token, at max_commit or at the context's end (a decode burst)."""
        tree.validate(self.vocab_size, self.config.max_tree_nodes)
        if not 0 <= decode_steps <= self.config.max_decode_steps:
            raise InvalidArgument(f"decode_steps={decode_steps}: this verifier decodes at most "
                                  f"{self.config.max_decode_steps} tokens alone per Verify (max_decode_steps)")
        # (sent right behind its session's Prefill, it may be read a moment before that Prefill: see sessions.py)
        session = self._sessions.get(session_id, wait_s=ADMISSION_GRACE_S)
        with session.lock:
            if session.released:
                raise NotFound(f"session {session_id!r} was released")
            if expected_committed_length != session.committed_length:
                raise FailedPrecondition(
                    f"session {session_id!r} has {session.committed_length} committed tokens, the request expected "
                    f"{expected_committed_length}: a stale or repeated Verify; nothing was changed"
                )
            if session.committed_length + len(tree) >= self.max_context:
                raise ResourceExhausted(
                    f"session {session_id!r} would exceed the context of {self.max_context} tokens "
                    f"({session.committed_length} committed + {len(tree)} tree nodes)"
                )
            with tracer.start_as_current_span("specsplit.verifier.verify") as span:
                span.set_attribute("specsplit.num_draft_tokens", len(tree))
                work = VerifyWork(session, len(tree) + 1, session=session, tree=tree, max_commit=max_commit,
                                  decode_steps=decode_steps)
                result: VerifyResult = self._scheduler.submit(work).result()
                span.set_attribute("specsplit.num_accepted", len(result.verdict.accepted_nodes))
                span.set_attribute("specsplit.num_decoded", len(result.verdict.decoded_token_ids))
                span.set_attribute("specsplit.queue_ms", result.queue_ms)
                if result.features is not None:
                    span.set_attribute("specsplit.feature_bytes", result.features.nbytes)
            return result

    def release(self, session_id: str, expected: TargetSession | None = None) -> bool:
        """expected: release only that session (see ``SessionTable.release``)."""
        # Queued under the table's lock: a Prefill admitted after this Release is queued after it, so the
        # slot is free again by the time that Prefill needs one.
        return self._sessions.release(session_id, lambda session: self._scheduler.submit(
            ReleaseWork(session, 0, session=session)), expected)

    # -- the model thread ----------------------------------------------------------------------------
    def _tick(self, works: list[Work]) -> list[Work]:
        """Run one tick; then the parked prefills whose shared start is computed now (or whose session went)
        continue, their first chunk in the next tick."""
        try:
            continuing = self._run_tick(works)
        except BaseException as err:  # outside a forward (those fail their own works): fail this tick's works
            for work in works:        # with their bookkeeping, not just their futures (the scheduler's backstop)
                self._fail(work, err)
            continuing = []
        parked, self._parked = self._parked, []
        for work in parked:
            if work.future.done():  # failed with the tick
                continue
            started = True if work.session.released else self._begin_prefill(work)
            if started:
                continuing.append(work)
            elif started is False:
                self._parked.append(work)
        return continuing

    def _run_tick(self, works: list[Work]) -> list[Work]:
        """Build a row per work, run the planned forwards, answer or continue each work."""
        tick_start = time.perf_counter()
        rows: list[Row] = []
        owners: list[Work] = []
        for work in works:
            session = work.session
            if isinstance(work, ReleaseWork):
                if session.slot >= 0:
                    if session.answered_at:  # all of its cache is in place: kept for a conversation's next turn
                        self._keep(session, session.token_ids[:-1])
                    self._store.release(session.slot)
                    session.slot = -1
                work.future.set_result(True)
            elif session.released:
                self._fail(work, NotFound("the session was released while this request waited"))
            elif isinstance(work, (ExportWork, ImportWork)):
                self._move_kv(work)
            elif isinstance(work, PrefillWork):
                if session.slot < 0:
                    try:
                        session.slot = self._store.acquire()
                    except ResourceExhausted as err:
                        self._fail(work, err)
                        continue
                if not work.started:
                    started = self._begin_prefill(work)
                    if started is None:  # failed (and answered)
                        continue
                    if not started:
                        self._parked.append(work)  # an in-flight prompt is computing the start they share
                        continue
                if work.done == len(work.token_ids):  # nothing (more) to cache: a one-token or a kept prompt
                    session.answered_at = time.perf_counter()
                    work.future.set_result(PrefillResult(session.committed_length, ms_since(work.enqueued),
                                                         copied_tokens=work.copied))
                    continue
                rows.append(prefill_row(session.slot, work.done, work.token_ids[work.done:work.done + work.tokens]))
                owners.append(work)
            else:
                rows.append(verify_row(session.slot, session.cached_length, session.token_ids[-1], work.tree))
                owners.append(work)
                if work.verdict is None:  # a request's first tick (not a burst's next step)
                    work.queue_ms = (tick_start - work.enqueued) * 1e3
                    self.stats.think_ms += session.verify_arrived(work.enqueued) * 1e3
                    self.stats.thinks += 1
        self.stats.ticks += 1
        continuing: list[Work] = []
        if not rows:
            return continuing
        by_slot = sorted(range(len(rows)), key=lambda b: rows[b].slot)  # contiguous slots: K/V views, no copy
        rows, owners = [rows[b] for b in by_slot], [owners[b] for b in by_slot]
        start = time.perf_counter()
        try:
            logits, argmax, hidden = self._forward(rows, [isinstance(w, VerifyWork) for w in owners],
                                                   any(w.session.needs_hidden for w in owners))
            if self.device.type == "cuda":  # kernels run asynchronously: time (and cost) the forward, not its launch
                torch.cuda.current_stream(self.device).synchronize()  # (not the device: another engine may capture)
        except BaseException as err:  # nothing was committed: every session stays as it was
            for work in owners:
                self._fail(work, err)
            return continuing
        forward_ms = ms_since(start)
        meter.forward_duration.record(forward_ms)
        self.stats.forward_ms += forward_ms
        shares = cost_shares([len(r) for r in rows], self.config.forward_overhead_tokens, forward_ms)
        self.stats.prefill_ms += sum(share for share, work in zip(shares, owners) if isinstance(work, PrefillWork))
        moves: list[tuple[int, int, tuple[int, ...]]] = []  # this tick's compactions (slot, keep_from, rows)
        try:
            self._answer_rows(rows, owners, logits, argmax, hidden, shares, continuing, moves)
        finally:  # every accepted row's K/V move into place before the next tick reads the slots
            self._store.compact_many(moves)
        return continuing

    def _answer_rows(self, rows: list[Row], owners: list[Work], logits: list[torch.Tensor | None],
                     argmax: list[list[int] | None], hidden: list[torch.Tensor] | None, shares: list[float],
                     continuing: list[Work], moves: list) -> None:
        """Accept each verify row (its compaction added to ``moves``) and answer or continue its work."""
        for b, work in enumerate(owners):
            row_hidden = hidden[b] if hidden is not None and work.session.needs_hidden else None
            if isinstance(work, PrefillWork):
                if row_hidden is not None:
                    work.hidden.append(row_hidden)  # [C, H]
                self._advance_prefill(work, len(rows[b]), continuing)
                continue
            try:
                start_position = work.session.cached_length
                work.record(self._accept(work, logits[b], argmax[b], moves), start_position, row_hidden)
                work.cost_ms += shares[b]
                if work.burst_goes_on(self._eos, work.session.committed_length + 1 < self.max_context):
                    work.tree, work.tokens = TokenTree.empty(), 1  # the next step: the new pending token
                    continuing.append(work)
                    continue
                verdict, kept = work.answer()
                features, proposal = self._extras(work.session, work.start_position, kept)
            except BaseException as err:  # a burst's earlier steps stay committed; the caller re-syncs
                self._fail(work, err)
                continue
            work.session.answered_at = time.perf_counter()
            work.future.set_result(VerifyResult(verdict, work.session.committed_length, ms_since(work.enqueued),
                                                work.queue_ms, work.cost_ms, features, proposal,
                                                (self._scheduler.busy_s() - work.busy_at_submit) * 1e3))

    def _extras(self, session: TargetSession, start_position: int,
                kept: torch.Tensor | None) -> tuple[Features | None, TokenTree | None]:
        """The features of the newly cached rows (kept: [K, H], positions start_position ..
        start_position + K - 1) and Medusa's proposal from the last of them."""
        if kept is None or not len(kept):
            return None, (TokenTree.empty() if session.medusa else None)
        features = Features.of(start_position, kept) if session.return_features else None
        proposal = self.medusa.propose(kept[-1], session.sampling, session.committed_length) if session.medusa else None
        return features, proposal

    def _forward(self, rows: list[Row], needs_logits: list[bool], needs_hidden: bool = False
                 ) -> tuple[list[torch.Tensor | None], list[list[int] | None], list[torch.Tensor] | None]:
        """One packed forward of all rows: per row its [Q_b, V] logits and their argmax [Q_b] (None where not
        needed: a prefill chunk) and (needs_hidden) its final hidden states after the final norm [Q_b, H]."""
        offsets = row_offsets(rows)
        keep = [i for b, need in enumerate(needs_logits) if need for i in range(offsets[b], offsets[b + 1])]
        meter.batch_rows.record(len(rows))
        meter.batch_tokens.record(offsets[-1])
        graphed = self._graphs and self._graphs(self._store, rows, keep, needs_hidden)  # None: no fixed shape fits
        self.stats.add_forward(len(rows), offsets[-1], bool(graphed))
        logits, final = graphed or self._packed_forward(  # [K, V], [T, H]
            self._store, pack_rows(rows, self.dtype, self.device, self._group_overhead), keep=keep, hidden=needs_hidden)
        # logits: the verify rows' tokens, in packed order; their argmax in one reduction and one copy to the
        # host for the whole tick (per row, each would be a launch and a device sync on a GPU)
        ids = logits.argmax(dim=-1).tolist() if keep else []  # [K]
        per_row: list[torch.Tensor | None] = []
        per_row_ids: list[list[int] | None] = []
        k = 0
        for row, need in zip(rows, needs_logits):
            per_row.append(logits[k:k + len(row)] if need else None)
            per_row_ids.append(ids[k:k + len(row)] if need else None)
            k += len(row) if need else 0
        hidden = [final[offsets[b]:offsets[b + 1]] for b in range(len(rows))] if needs_hidden else None
        return per_row, per_row_ids, hidden

    def _accept(self, work: VerifyWork, logits: torch.Tensor, argmax: list[int], moves: list) -> Verdict:
        """logits: [N+1, V] for root + nodes, argmax: [N+1] their argmax. Accept, queue the slot's compaction
        (the tick's end), commit."""
        session, tree = work.session, work.tree
        if session.sampling.greedy:
            verdict = accept_greedy(tree, argmax, work.max_commit)
        elif session.sampling.coupled:  # greedy acceptance on the target's coupled draws after the rows ([N+1, V])
            draws = scores(logits, session.sampling, [session.committed_length + d for d in (0, *tree.depths)])
            verdict = accept_greedy(tree, draws.argmax(dim=-1).tolist(), work.max_commit)
        else:
            if session.sampling.seed is not None:  # per-round draws: another replica would draw the same
                session.generator.manual_seed(round_seed(session.sampling.seed, session.committed_length))
            p = distribution(logits, session.sampling).cpu()  # [N+1, V]
            verdict = accept_sampled(tree, p, tree.node_q, session.generator, work.max_commit)
        moves.append((session.slot, session.cached_length, verdict.rows_to_keep))  # compacted at the tick's end
        session.token_ids.extend(verdict.committed_token_ids)
        return verdict

    def _begin_prefill(self, work: PrefillWork) -> bool | None:
        """``_start_prefill``; None if it failed (copying a shared start can grow the K/V store past the device's
        memory): that prefill is answered with the error, and the tick and the other waiting prefills go on."""
        try:
            return self._start_prefill(work)
        except Exception as err:
            self._fail(work, err)
            return None

    def _keep(self, session: TargetSession, token_ids: list[int]) -> None:
        """Keep a session's prompt K/V for later prompts that share its start (``PrefixCache.keep``), unless its
        cache is not exactly what this verifier computes (imported from a blob of another precision: copied into
        other sessions, its rounding would change their tokens). A failure to keep (memory) costs only reuse."""
        if not session.exact_kv:
            return
        try:
            self._prefixes.keep(self._store, session.slot, token_ids, self._num_layers)
        except Exception as err:
            log.warning("could not keep a prompt's K/V for reuse (%s); later prompts compute it", err)

    def _start_prefill(self, work: PrefillWork) -> bool:
        """A prefill's start: the prompt's start shared with a kept prompt or one being prefilled now is copied
        (``PrefixCache.share``). False: an in-flight prompt is still computing a longer shared start; it waits."""
        self._prefilling = [w for w in self._prefilling if not w.future.done() and w.session.slot >= 0]
        copied = 0
        if not work.session.needs_hidden:  # (one that needs every position's hidden states computes them all)
            live = [Prefilling(w.session.slot, w.token_ids, w.done) for w in self._prefilling]
            copied = self._prefixes.share(self._store, work.session.slot, work.token_ids, live)
            if copied is None:
                return False
        work.started = True
        self._prefilling.append(work)
        self.stats.prefix_tokens += copied
        work.copied = copied
        self._prefilled(work, copied)
        return True

    def _prefilled(self, work: PrefillWork, cached: int) -> None:
        """``cached`` more prompt tokens are in the slot; the next chunk is sized."""
        work.done += cached
        self._sessions.cached(cached)
        work.tokens = min(len(work.token_ids) - work.done, self.config.prefill_chunk)

    def _advance_prefill(self, work: PrefillWork, cached: int, continuing: list[Work]) -> None:
        self._prefilled(work, cached)
        if work.tokens:
            continuing.append(work)
        else:
            session = work.session
            self._keep(session, work.token_ids)
            features = proposal = None
            if work.hidden:
                hidden = torch.cat(work.hidden)  # [P-1, H] every cached prompt position
                features, proposal = self._extras(session, 0, hidden)
            elif session.medusa:
                proposal = TokenTree.empty()
            session.answered_at = time.perf_counter()
            work.future.set_result(PrefillResult(session.committed_length, ms_since(work.enqueued), features, proposal,
                                                 work.copied))

    def _fail(self, work: Work, err: BaseException) -> None:
        if work.future.done():  # answered already (a tick failing after some of its works were)
            return
        if isinstance(work, PrefillWork):
            self._sessions.cached(len(work.token_ids) - work.done)
            work.done = len(work.token_ids)
        work.future.set_exception(err)

