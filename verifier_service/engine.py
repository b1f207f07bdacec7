"""The target side: per-session KV caches, one tree forward per Verify, greedy acceptance, compaction.

A session's cache holds every committed token except the last one (the *pending* token). Verify runs
the pending token (the tree's root) plus all tree nodes in one forward, accepts, then compacts the cache
to prefix + root + accepted path; the recovered/bonus token becomes the new pending token. An empty tree
is therefore exactly one step of plain decoding.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
from opentelemetry import trace

from specsplit import kvcache
from specsplit.accept import Verdict, accept_greedy
from specsplit.config import VerifierConfig
from specsplit.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from specsplit.models import LoadedModel
from specsplit.sampling import SamplingParams, accept_sampled, distribution
from specsplit.runner import ModelRunner
from specsplit.tree import TokenTree, build_buffers, full_attention_mask

tracer = trace.get_tracer(__name__)


@dataclass
class TargetSession:
    cache: object  # transformers Cache holding committed tokens [0, committed_length - 1)
    token_ids: list[int]  # [committed_length] prompt + generated
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None  # the session's RNG (sampling only)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def committed_length(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class VerifyResult:
    verdict: Verdict
    committed_length: int
    verify_ms: float


class TargetEngine:
    def __init__(self, loaded: LoadedModel, config: VerifierConfig | None = None):
        self.loaded = loaded
        self.model = loaded.model
        self.config = config or VerifierConfig()
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_context = self.config.max_context or int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.device = self.model.device
        self.dtype = self.model.dtype
        self._cache_kwarg = kvcache.cache_kwarg(self.model)
        self._sessions: dict[str, TargetSession] = {}
        self._sessions_lock = threading.Lock()
        self._runner = ModelRunner("verifier")  # every forward on one thread, one at a time

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.loaded.tokenizer.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    def num_sessions(self) -> int:
        return len(self._sessions)

    def _forward(self, input_ids, position_ids, attention_mask, cache, logits_to_keep: int = 0) -> torch.Tensor:
        """[1, Q, V] logits for Q new tokens on top of ``cache`` (which grows by Q); the last
        ``logits_to_keep`` rows only when that is > 0 (prefill needs none: it skips the LM head's cost)."""
        out = self._runner(
            self.model,
            input_ids=input_ids,  # [1, Q]
            position_ids=position_ids,  # [1, Q]
            attention_mask=attention_mask,  # [1, 1, Q, P+Q] or None (causal)
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **{self._cache_kwarg: cache},
        )
        return out.logits  # [1, Q, V]

    def prefill(self, session_id: str, prompt_token_ids: list[int],
                sampling: SamplingParams | None = None) -> tuple[int, float]:
        """Cache the prompt (all but its last token, which becomes the pending token)."""
        sampling = sampling or SamplingParams()
        sampling.validate()
        if not session_id:
            raise InvalidArgument("session_id is empty")
        if not prompt_token_ids:
            raise InvalidArgument("prompt is empty: give at least one token")
        if len(prompt_token_ids) >= self.max_context:
            raise InvalidArgument(
                f"prompt has {len(prompt_token_ids)} tokens; this model's context holds {self.max_context} "
                "(prompt + generated); shorten the prompt"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        with self._sessions_lock:
            if session_id in self._sessions:
                raise FailedPrecondition(f"session {session_id!r} already exists; Release it or use a new id")
            if len(self._sessions) >= self.config.max_sessions:
                raise ResourceExhausted(
                    f"verifier holds {len(self._sessions)} sessions (max_sessions={self.config.max_sessions}); "
                    "retry later or on another replica"
                )
            session = TargetSession(cache=kvcache.new_cache(self.model), token_ids=list(prompt_token_ids),
                                    sampling=sampling, generator=_generator(sampling))
            self._sessions[session_id] = session
        start = time.perf_counter()
        try:
            with session.lock, tracer.start_as_current_span("specsplit.verifier.prefill") as span:
                span.set_attribute("gen_ai.usage.input_tokens", len(prompt_token_ids))
                if len(prompt_token_ids) > 1:
                    ids = torch.tensor([prompt_token_ids[:-1]], dtype=torch.long, device=self.device)  # [1, P-1]
                    positions = torch.arange(ids.shape[1], device=self.device).unsqueeze(0)  # [1, P-1]
                    self._forward(ids, positions, None, session.cache, logits_to_keep=1)
        except BaseException:
            self.release(session_id)
            raise
        return session.committed_length, (time.perf_counter() - start) * 1e3

    def session(self, session_id: str) -> TargetSession:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise NotFound(f"unknown session {session_id!r}: it was never prefilled here, or was released") from None

    def verify(self, session_id: str, tree: TokenTree, expected_committed_length: int, max_commit: int = 0) -> VerifyResult:
        tree.validate(self.vocab_size, self.config.max_tree_nodes)
        session = self.session(session_id)
        with session.lock:
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
            start = time.perf_counter()
            with tracer.start_as_current_span("specsplit.verifier.verify") as span:
                span.set_attribute("specsplit.num_draft_tokens", len(tree))
                verdict = self._verify_locked(session, tree, max_commit)
                span.set_attribute("specsplit.num_accepted", len(verdict.accepted_nodes))
            return VerifyResult(verdict, session.committed_length, (time.perf_counter() - start) * 1e3)

    def _verify_locked(self, session: TargetSession, tree: TokenTree, max_commit: int) -> Verdict:
        prefix_len = session.committed_length - 1  # cached tokens; the pending token is the root
        buffers = build_buffers(tree, session.token_ids[-1], prefix_len, self.device)
        # A chain (or an empty tree) is plain causal attention: let the model build that mask itself.
        mask = None if tree.is_chain() else full_attention_mask(buffers.tree_attn_mask, prefix_len, self.dtype)
        try:
            logits = self._forward(buffers.input_ids, buffers.position_ids, mask, session.cache)  # [1, N+1, V]
        except BaseException:
            kvcache.truncate(session.cache, prefix_len)  # the session stays as it was before this Verify
            raise
        if session.sampling.greedy:
            target_token_ids = logits[0].argmax(dim=-1).tolist()  # [N+1]
            verdict = accept_greedy(tree, target_token_ids, max_commit)
        else:
            p = distribution(logits[0], session.sampling).cpu()  # [N+1, V]
            verdict = accept_sampled(tree, p, tree.node_q, session.generator, max_commit)
        kvcache.compact(session.cache, prefix_len, verdict.rows_to_keep)
        session.token_ids.extend(verdict.committed_token_ids)
        return verdict

    def release(self, session_id: str) -> bool:
        with self._sessions_lock:
            return self._sessions.pop(session_id, None) is not None


def _generator(sampling: SamplingParams) -> torch.Generator | None:
    if sampling.greedy:
        return None
    generator = torch.Generator()
    if sampling.seed is None:
        generator.seed()
    else:
        generator.manual_seed(sampling.seed)
    return generator
