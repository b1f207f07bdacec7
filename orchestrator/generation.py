"""The orchestrator's loop: propose -> verify -> accept -> stream, with fallback to target-only decoding.

It talks to a verifier and to draft services through the typed adapters in ``specsplit.rpc`` (or any
object with the same methods), and never sees protobuf.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from opentelemetry import trace

from orchestrator.controller import BudgetController
from orchestrator.detok import TextStream
from specsplit.config import OrchestratorConfig
from specsplit.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from specsplit.rpc import DraftInfo, RpcError, VerifierInfo
from specsplit.sampling import SamplingParams
from specsplit.stream import Chunk, RoundStats
from specsplit.tree import TokenTree

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

DRAFT_CHOICES = ("auto", "ngram", "model", "none")


@dataclass
class GenerationRequest:
    prompt_token_ids: list[int]
    max_new_tokens: int
    stop: list[str] = field(default_factory=list)
    draft: str = "auto"
    session_id: str = ""
    sampling: SamplingParams = field(default_factory=SamplingParams)


class Orchestrator:
    def __init__(self, verifier, drafts: list, tokenizer, config: OrchestratorConfig | None = None):
        """verifier: a RemoteVerifier; drafts: RemoteDraft objects, in "auto" preference order."""
        self.verifier = verifier
        self.tokenizer = tokenizer
        self.config = config or OrchestratorConfig()
        self._verifier_info: VerifierInfo | None = None
        self.drafts = list(drafts)
        self._draft_info: dict[int, DraftInfo] = {}

    # -- setup ---------------------------------------------------------------------------------------
    @property
    def verifier_info(self) -> VerifierInfo:
        if self._verifier_info is None:
            self._verifier_info = self.verifier.info(timeout=self.config.draft_timeout_s * 5)
        return self._verifier_info

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
        if choice == "none" or not self.drafts:
            return None
        if choice == "auto":
            return self.drafts[0]
        for draft in self.drafts:
            info = self._draft_info_of(draft)
            if info is not None and info.drafter == choice:
                return draft
        raise InvalidArgument(f"no {choice!r} draft service is configured; this orchestrator has: "
                              f"{', '.join(self.draft_names()) or 'none'} (use --draft none or auto)")

    def prompt_token_ids(self, prompt: str = "", messages: list[dict] | None = None,
                         token_ids: list[int] | None = None, chat_template: bool = True) -> list[int]:
        given = sum(bool(x) for x in (prompt, messages, token_ids))
        if given == 0:
            raise InvalidArgument("prompt is empty: give a prompt, chat messages or prompt token ids")
        if given > 1:
            raise InvalidArgument("give exactly one of prompt, messages and prompt_token_ids")
        if token_ids:
            return list(token_ids)
        if prompt and not chat_template:
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if self.tokenizer.chat_template is None:
            if messages:
                raise InvalidArgument("this model's tokenizer has no chat template; send a plain prompt")
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        messages = messages or [{"role": "user", "content": prompt}]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def validate(self, request: GenerationRequest) -> None:
        info = self.verifier_info
        if not request.prompt_token_ids:
            raise InvalidArgument("prompt is empty: it tokenized to no tokens")
        if len(request.prompt_token_ids) >= info.max_context:
            raise InvalidArgument(f"prompt has {len(request.prompt_token_ids)} tokens; the model's context holds "
                                  f"{info.max_context} (prompt + generated): shorten the prompt")
        if request.max_new_tokens <= 0:
            raise InvalidArgument(f"max_new_tokens must be > 0, got {request.max_new_tokens}")
        if request.max_new_tokens > self.config.max_new_tokens_limit:
            raise InvalidArgument(f"max_new_tokens {request.max_new_tokens} is over this server's limit of "
                                  f"{self.config.max_new_tokens_limit}")
        request.sampling.validate()

    # -- the loop ------------------------------------------------------------------------------------
    def generate(self, request: GenerationRequest, cancelled: threading.Event | None = None) -> Iterator[Chunk]:
        self.validate(request)
        cancelled = cancelled or threading.Event()
        info = self.verifier_info
        session_id = request.session_id or uuid.uuid4().hex
        cfg = self.config
        max_new = min(request.max_new_tokens, info.max_context - len(request.prompt_token_ids))
        with tracer.start_as_current_span(f"specsplit.orchestrator.generate {info.model}") as span:
            span.set_attribute("gen_ai.operation.name", "generate")
            span.set_attribute("gen_ai.request.model", info.model)
            span.set_attribute("gen_ai.request.max_tokens", request.max_new_tokens)
            span.set_attribute("gen_ai.conversation.id", session_id)
            span.set_attribute("gen_ai.usage.input_tokens", len(request.prompt_token_ids))
            draft = self.pick_draft(request.draft)
            self._prefill(session_id, request.prompt_token_ids, request.sampling)
            session = _Session(session_id, list(request.prompt_token_ids), draft, request.sampling)
            try:
                if draft is not None:
                    self._start_draft(session)
                yield Chunk("", [], session_id=session_id, prompt_token_ids=list(request.prompt_token_ids))
                yield from self._rounds(session, request, max_new, cancelled, info)
            finally:
                span.set_attribute("gen_ai.usage.output_tokens", session.generated)
                span.set_attribute("specsplit.rounds", session.round)
                self._release(session)

    def _rounds(self, session, request, max_new, cancelled, info) -> Iterator[Chunk]:
        stream = TextStream(self.tokenizer, list(request.stop))
        controller = BudgetController(max_nodes=min(info.max_tree_nodes, self.config_max_nodes(session)),
                                      deterministic=request.sampling.seed is not None)
        eos = set(info.eos_token_ids)
        while True:
            if cancelled.is_set():
                yield Chunk(stream.finish(), [], finish_reason="cancelled")
                return
            remaining = max_new - session.generated
            with tracer.start_as_current_span("specsplit.orchestrator.round") as span:
                session.round += 1
                span.set_attribute("specsplit.round", session.round)
                budget = controller.choose(remaining - 1) if session.draft_usable() else 0
                tree, draft_ms = self._propose(session, budget)
                verdict, timing = self.verifier.verify(
                    session.id, tree, len(session.token_ids), remaining, timeout=self.config.verify_timeout_s
                )
                committed = list(verdict.committed_token_ids)
                # The tree's real cost is its share of the verifier's batched forward: under load the fixed
                # cost of a forward is shared by many sessions, drafted tokens are relatively dearer, and the
                # controller drafts less (an older verifier reports no share: use its time).
                controller.observe(len(tree), len(verdict.accepted_nodes), _branch_depth(tree, verdict),
                                   timing.cost_ms or timing.verify_ms, draft_ms if tree else None)
                session.token_ids.extend(committed)
                session.unsent.extend(committed)
                span.set_attribute("specsplit.num_draft_tokens", len(tree))
                span.set_attribute("specsplit.num_accepted", len(verdict.accepted_nodes))
            finish = ""
            for i, token in enumerate(committed):
                if token in eos:
                    committed, finish = committed[: i + 1], "eos"
                    break
            kept, text, hit_stop = stream.add(committed)
            if hit_stop:
                finish = "stop"
            session.generated += len(kept)
            if not finish and session.generated >= max_new:
                finish = "length"
            if finish:
                text += stream.finish() if finish != "stop" else ""
            stats = RoundStats(session.round, len(tree), len(verdict.accepted_nodes), len(kept), draft_ms or 0.0,
                               timing.verify_ms, session.drafter_name(self) if tree else "none", tree.depth)
            yield Chunk(text, kept, stats=stats, finish_reason=finish)
            if finish:
                return

    def config_max_nodes(self, session) -> int:
        info = self._draft_info_of(session.draft) if session.draft is not None else None
        return info.max_nodes if info is not None and info.max_nodes else 64

    def _prefill(self, session_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        with tracer.start_as_current_span("specsplit.orchestrator.prefill"):
            try:
                self.verifier.prefill(session_id, prompt_token_ids, timeout=self.config.prefill_timeout_s,
                                      sampling=sampling)
            except RpcError as err:
                if hasattr(err, "code") and err.code().name == "RESOURCE_EXHAUSTED":
                    # The verifier is full: say so at once, so the caller can retry later or elsewhere.
                    raise ResourceExhausted(f"the verifier is at capacity: {err.details()}") from None
                raise

    def _start_draft(self, session) -> None:
        try:
            session.draft.start(session.id, session.token_ids, self.verifier_info.tokenizer_fingerprint,
                                timeout=self.config.draft_timeout_s, sampling=session.sampling)
            session.unsent = []
            session.draft_down_until = 0
        except RpcError as err:
            if _is_refusal(err):
                raise FailedPrecondition(f"draft service {session.draft.address} refused the session: {err.details()}") from None
            self._draft_failed(session, err)

    def _propose(self, session, budget: int) -> tuple[TokenTree, float | None]:
        if session.draft is None:
            return TokenTree.empty(), None
        if session.draft_down_until:
            if session.round < session.draft_down_until:
                return TokenTree.empty(), None
            self._start_draft(session)  # the draft service may have restarted: start over from all tokens
            if session.draft_down_until:
                return TokenTree.empty(), None
        if budget <= 0:
            return TokenTree.empty(), None  # no call: committed tokens travel with the next Propose
        try:
            tree, draft_ms = session.draft.propose(session.id, session.unsent, len(session.token_ids), budget,
                                                   timeout=self.config.draft_timeout_s)
        except RpcError as err:
            self._draft_failed(session, err)
            return TokenTree.empty(), None
        session.unsent = []
        return tree, draft_ms

    def _draft_failed(self, session, err) -> None:
        code = err.code() if hasattr(err, "code") else err
        log.warning("draft %s failed for session %s (%s); target-only decoding for %d rounds",
                    session.draft.address, session.id, code, self.config.draft_retry_rounds)
        trace.get_current_span().add_event("specsplit.draft_fallback", {"grpc.status": str(code)})
        session.draft_down_until = session.round + self.config.draft_retry_rounds

    def _release(self, session) -> None:
        try:
            self.verifier.release(session.id, timeout=self.config.draft_timeout_s)
        except RpcError as err:
            log.warning("release of %s on the verifier failed: %s", session.id, err.code())
        if session.draft is not None and not session.draft_down_until:
            try:
                session.draft.end(session.id, timeout=self.config.draft_timeout_s)
            except RpcError:
                pass


@dataclass
class _Session:
    id: str
    token_ids: list[int]  # committed: prompt + generated (may run past a stop; that tail is never sent)
    draft: object | None
    sampling: SamplingParams
    unsent: list[int] = field(default_factory=list)  # committed tokens the draft has not seen yet
    round: int = 0
    generated: int = 0  # tokens handed to the client
    draft_down_until: int = 0  # round until which the draft is skipped after a failure (0: healthy)

    def draft_usable(self) -> bool:
        return self.draft is not None and (not self.draft_down_until or self.round >= self.draft_down_until)

    def drafter_name(self, orchestrator: Orchestrator) -> str:
        info = orchestrator._draft_info_of(self.draft) if self.draft is not None else None
        return info.drafter if info else "none"


def _branch_depth(tree: TokenTree, verdict) -> int:
    """Depth of the branch acceptance followed (the deepest branch when nothing was accepted)."""
    if not len(tree):
        return 0
    if not verdict.accepted_nodes:
        return tree.depth
    last = verdict.accepted_nodes[-1]
    below = [d for i, d in enumerate(tree.depths) if last in tree.path_to(i)]
    return max(below)


def _is_refusal(err) -> bool:
    import grpc

    return hasattr(err, "code") and err.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
