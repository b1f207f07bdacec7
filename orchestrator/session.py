"""A session as the orchestrator drives it: the stored ``SessionState`` plus what lives only in this process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

from orchestrator.burst import BurstSizer
from orchestrator.controller import BudgetController
from orchestrator.detok import TextStream
from specsplit.features import Features
from specsplit.lookup import SpanLookup
from specsplit.rpc import VerifierInfo
from specsplit.sampling import SamplingParams
from specsplit.store import TERMINAL, SessionState
from specsplit.stream import Chunk
from specsplit.tree import TokenTree


@dataclass
class LiveSession:
    state: SessionState  # what another orchestrator would need to continue: written after every round
    draft: object | None  # a RemoteDraft, or None (target-only)
    controller: BudgetController
    stream: TextStream  # detokenizer over the generated tokens the client has
    unsent: list[int] = field(default_factory=list)  # committed tokens the draft has not seen yet
    replica: object | None = None  # the verifier Replica holding the KV cache (None: must be restored)
    used: set = field(default_factory=set)  # replica addresses that may hold a KV cache of this session
    skip: int = 0  # generated tokens the client has beyond the stored state: regenerated, never resent
    cancel: threading.Event = field(default_factory=threading.Event)  # a Cancel call for this session
    owned: bool = False  # this request created or claimed it (False: a replay of a finished session)
    lost: bool = False  # another request claimed it since: touch nothing
    failed: bool = False  # a permanent error ended the stream: cancel rather than detach
    committed_final: bool = False  # the store already has its end state (finished, cancelled, detached)
    wants_features: bool = False  # its draft reads the target's features: the verifier returns them
    features: list[Features] = field(default_factory=list)  # features the draft has not been sent yet
    feature_bytes: int = 0  # feature bytes received since the last round's stats
    medusa: bool = False  # self-speculation: the verifier proposes the next tree (no draft service)
    proposal: TokenTree | None = None  # the verifier's Medusa tree for the next round
    trigger: object | None = None  # the verification trigger of streamed trees (orchestrator.trigger), per session
    burst: BurstSizer = field(default_factory=BurstSizer)  # tokens a target-only round asks for
    # Last round's provisional tokens that continue the committed text, (token, draft prob) from the root down:
    # the draft holds them too, and with OrchestratorConfig.pipeline they are the next tree, verified at once.
    ahead: list[tuple[int, float]] = field(default_factory=list)
    lookup: SpanLookup | None = None  # prompt lookup for rounds without the draft model (a draft that copies spans)
    since_copy: int = 1 << 30  # rounds since the last one that verified a copied span
    behind: int = 0  # committed tokens of rounds without the draft since its last round (it catches up on them first)
    restarted_at: int = -(1 << 30)  # the round whose draft failure restarted the draft at once (drafts._draft_failed)
    draft_retry_at: float = 0.0  # time.monotonic() after which a paused draft is tried again (0: by rounds only)
    draft_backoff_s: float = 0.0  # the pause's length in seconds: doubles at each failure of the session's draft
    copy_hits: float = 1.0  # decayed share of looked-up span tokens that were right (specsplit.lookup.span_hits)
    opened: object | None = None  # a new session's first round, opened before the verifier's prefill (drafts.RoundStart)
    prefill: object | None = None  # a new session's prefill still running in its own thread (placement.PrefillInFlight)
    loading: object | None = None  # the replica a restore is loading the cache onto (set before its call)
    announced: bool = False  # the stream's first chunk (session id, prompt) was sent

    @property
    def id(self) -> str:
        return self.state.session_id

    @property
    def token_ids(self) -> list[int]:
        """[P + G'] prompt + committed."""
        return self.state.token_ids

    @property
    def sampling(self) -> SamplingParams:
        """What the verifier and the draft get: the request's params with the session's seed."""
        params = self.state.sampling
        return params if params.greedy else replace(params, seed=self.state.seed)

    def draft_usable(self) -> bool:
        return self.medusa or (self.draft is not None and not self.draft_paused())

    def draft_paused(self) -> bool:
        """The draft failed and neither its rounds (``draft_down_until``) nor its seconds (``draft_retry_at``) of
        target-only decoding are over (a session resumed from the store, with no time set, retries at once)."""
        down = self.state.draft_down_until
        return bool(down) and self.state.round < down and time.monotonic() < self.draft_retry_at

    def absorb(self, reply) -> None:
        """Keep what a verifier reply (``specsplit.rpc.VerifierReply``) carries for the next round."""
        if reply.features is not None:
            self.features.append(reply.features)
            self.feature_bytes += reply.features.nbytes
        if self.medusa:
            self.proposal = reply.proposal

    def tree_burst(self, tree: TokenTree, remaining: int) -> int | None:
        """Decode steps a budget round's Verify asks for after its tree's verdict (``BurstSizer.steps_after_tree``,
        by the controller's expected accepted tokens for the tree's depth); None with no tree (a plain burst)."""
        return self.burst.steps_after_tree(self.controller.expected_accepted(tree.depth), remaining) if len(tree) else None

    def observe_budget_round(self, tree: TokenTree, verdict, timing, draft_ms: float | None, round_start: float) -> None:
        """What a budget round (a whole tree or none, ``BudgetController``) measured: its wall time since
        ``round_start`` (perf_counter s) for the bursts, its cost for the controller. The tree's real cost is its
        share of the verifier's batched forward: under load the fixed cost of a forward is shared by many sessions,
        drafted tokens are relatively dearer, and the controller drafts less (an older verifier reports no share: use
        its time). A burst's cost is per token, one forward each (after a tree: the tree counted as one)."""
        decoded = len(verdict.decoded_token_ids)
        if len(tree):
            self.burst.observe_drafted((time.perf_counter() - round_start) * 1e3, decoded)
        per = 1 + decoded if len(tree) else len(verdict.committed_token_ids)
        depth = len(tree.branch_below(verdict.accepted_nodes[-1])) if verdict.accepted_nodes else tree.depth
        self.controller.observe(len(tree), len(verdict.accepted_nodes), depth,  # (the branch acceptance followed)
                                (timing.cost_ms or timing.verify_ms) / per, draft_ms if tree else None)

    def save_controller(self) -> None:
        self.state.controller = asdict(self.controller)

    def announce(self) -> Chunk:
        """The stream's first chunk: the session id and the prompt's tokens."""
        self.announced = True
        return Chunk("", [], session_id=self.id, prompt_token_ids=list(self.state.prompt_token_ids))

    def replay(self, client_has: int) -> Iterator[Chunk]:
        """Committed tokens a resuming client has not seen (and the finish, if the session ended)."""
        state = self.state
        missing = state.committed_token_ids[client_has:state.generated]
        finish = state.finish_reason if state.status in TERMINAL else ""
        if not missing and not finish:
            return
        kept, text, _ = self.stream.add(missing) if missing else ([], "", False)
        if finish and finish != "stop":
            text += self.stream.finish()
        yield Chunk(text, kept, finish_reason=finish)

    def add_text(self, tokens: list[int]) -> tuple[list[int], list[int], str, bool]:
        """Detokenize a round's tokens: (tokens the client already has, new tokens kept, new text, hit a stop)."""
        hidden: list[int] = []
        if self.skip:
            hidden, _, hit = self.stream.add(tokens[: self.skip])
            self.skip -= len(tokens[: self.skip])
            tokens = tokens[len(hidden):]
            if hit or not tokens:
                return hidden, [], "", hit
        kept, text, hit = self.stream.add(tokens)
        return hidden, kept, text, hit


def controller_from_state(state: SessionState, max_nodes: int) -> BudgetController:
    """The session's budget controller: fresh, or as it was after the last committed round."""
    if not state.controller:
        deterministic = state.sampling.rejection_sampled and state.sampling.seed is not None
        return BudgetController(max_nodes=max_nodes, deterministic=deterministic)
    saved = dict(state.controller)
    saved["verify_ms"] = {int(k): v for k, v in saved.get("verify_ms", {}).items()}  # JSON keys are strings
    return BudgetController(**saved)


def burst_sizer(state: SessionState, config, drafted: bool, info: VerifierInfo) -> BurstSizer:
    """The session's decode-burst sizer (``orchestrator.burst``): one token a round for a seeded session sampled by
    rejection sampling with a draft (timings must not decide its rounds), else sized by the measured round trip; never
    more than the verifier decodes in one Verify (``info.max_decode_steps`` after its first token)."""
    fixed = drafted and state.sampling.rejection_sampled and state.sampling.seed is not None
    most = min(config.burst_max, info.max_decode_steps + 1) if info.max_decode_steps else config.burst_max
    return BurstSizer(most, config.burst_overhead, fixed=fixed)


def text_stream_at(tokenizer, state: SessionState, client_has: int) -> TextStream:
    """A detokenizer positioned after the first ``client_has`` generated tokens (what the client has seen)."""
    stream = TextStream(tokenizer, list(state.stop))
    if client_has:
        stream.add(state.committed_token_ids[:client_has])
    return stream
