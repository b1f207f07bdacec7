"""What the verifier's model thread works on: sessions, the work items of a tick, their results, stats.

Requests arrive on gRPC threads (``verifier_service.engine.TargetEngine``) and become work items that
the scheduler (``verifier_service.scheduler``) gathers into ticks; each is answered with its result.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from specsplit.accept import Verdict
from specsplit.features import Features
from specsplit.sampling import SamplingParams
from specsplit.tree import TokenTree
from verifier_service import offload
from verifier_service.scheduler import Work


TURNAROUND_DECAY = 0.7  # weight of a session's earlier rounds in its moving-average turnaround


@dataclass(eq=False)
class TargetSession:
    token_ids: list[int]  # [committed_length] prompt + generated
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None  # the session's RNG (sampling only)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one Prefill/Verify of a session at a time
    slot: int = -1  # its KV slot, taken on the model thread by the first Prefill tick
    released: bool = False
    answered_at: float = 0.0  # perf_counter when its last request was answered
    # Its cache is what this verifier computes: False once imported from a blob of another precision (an offload in
    # float16): then its K/V are never kept for other prompts to copy (their tokens could change).
    exact_kv: bool = True
    # Its time from an answer to its next Verify (network both ways, orchestrator, draft): a tick does not wait
    # for a session that will not be back within batch_wait_ms. The lower of the last one and a moving average
    # (one slow round -- a pause, say -- neither sticks nor counts alone). Measured from its second Verify on
    # (the gap after a Prefill is no round trip); 0 until then: waited for.
    turnaround_s: float = 0.0
    turnaround_avg_s: float = 0.0
    verifies: int = 0  # Verify requests it has sent here
    return_features: bool = False  # answer each Prefill/Verify with the features of the newly cached positions
    medusa: bool = False  # answer each Prefill/Verify with a Medusa proposal tree

    @property
    def needs_hidden(self) -> bool:
        return self.return_features or self.medusa

    def verify_arrived(self, enqueued: float) -> float:
        """A Verify of this session was queued at ``enqueued`` (perf_counter): its think time [s] since the last
        answer, which also updates the session's turnaround (from its second Verify on)."""
        think = enqueued - self.answered_at
        if self.verifies:  # a round trip (the first Verify follows a Prefill or an import)
            self.turnaround_avg_s = think if not self.turnaround_avg_s else (
                TURNAROUND_DECAY * self.turnaround_avg_s + (1 - TURNAROUND_DECAY) * think)
            self.turnaround_s = min(think, self.turnaround_avg_s)
        self.verifies += 1
        return think

    @property
    def committed_length(self) -> int:
        return len(self.token_ids)

    @property
    def cached_length(self) -> int:
        return len(self.token_ids) - 1  # the pending token is not cached


@dataclass(frozen=True)
class VerifyResult:
    verdict: Verdict
    committed_length: int
    verify_ms: float  # arrival to answer: queueing + forward + acceptance
    queue_ms: float = 0.0  # waiting for the tick this request rode in
    cost_ms: float = 0.0  # this request's share of its forward (fixed cost split by rows, the rest by tokens)
    features: Features | None = None  # the newly cached positions' features (root + accepted rows), if asked
    proposal: TokenTree | None = None  # Medusa's tree for the next Verify, if asked
    busy_ms: float = 0.0  # of verify_ms, the model thread's time in ticks (its own and others'): not idling


class PrefillResult(NamedTuple):
    committed_length: int
    prefill_ms: float
    features: Features | None = None  # the cached prompt positions' features, if asked
    proposal: TokenTree | None = None  # Medusa's tree for the first Verify, if asked
    copied_tokens: int = 0  # prompt tokens copied from another prompt's K/V (verifier_service.prefix), not computed


@dataclass
class BatchStats:
    ticks: int = 0
    forwards: int = 0
    rows: int = 0
    max_rows: int = 0  # most rows in one forward
    tokens: int = 0  # tokens through the forwards (packed: no padding)
    forward_ms: float = 0.0  # summed forward wall time
    prefill_ms: float = 0.0  # the prompt chunks' share of forward_ms (each row's cost share, batching.cost_shares)
    prefix_tokens: int = 0  # prompt tokens whose K/V were copied from another prompt's, not computed (prefix.py)
    think_ms: float = 0.0  # summed time from answering a session to its next Verify (what batch_wait_ms must cover)
    thinks: int = 0
    graphed: int = 0  # forwards replayed as a CUDA graph (verifier_service.graphs), or their fixed shape run off a GPU

    def add_forward(self, rows: int, tokens: int, graphed: bool) -> None:
        self.forwards, self.rows, self.tokens = self.forwards + 1, self.rows + rows, self.tokens + tokens
        self.max_rows, self.graphed = max(self.max_rows, rows), self.graphed + graphed

    @property
    def mean_think_ms(self) -> float:
        return self.think_ms / max(self.thinks, 1)


@dataclass(eq=False)
class PrefillWork(Work):
    session: TargetSession | None = None
    token_ids: list[int] = field(default_factory=list)  # [P-1] what to cache: the prompt less its last token
    done: int = 0
    copied: int = 0  # of them, copied from a kept prompt or one being prefilled (prefix.py)
    started: bool = False  # its first tick has run (what it shares with other prompts is copied)
    hidden: list = field(default_factory=list)  # per chunk [C, H] final hidden states (features/Medusa only)


@dataclass(eq=False)
class VerifyWork(Work):
    session: TargetSession | None = None
    tree: TokenTree = field(default_factory=TokenTree.empty)
    max_commit: int = 0
    decode_steps: int = 0  # after the verdict, decode alone up to this many more tokens (one tick each)
    # A burst in progress (the work continues with an empty tree for each decoded token):
    verdict: Verdict | None = None  # the tree's verdict (first tick)
    decoded: list[int] = field(default_factory=list)  # [D] tokens decoded alone since
    start_position: int = 0  # the first newly cached position (first tick)
    kept_hidden: list = field(default_factory=list)  # per tick [K, H] hidden states of the rows it kept
    queue_ms: float = 0.0  # waiting for the first tick
    cost_ms: float = 0.0  # summed shares of the forwards it rode in

    def record(self, verdict: Verdict, start_position: int, hidden: torch.Tensor | None) -> None:
        """One tick's verdict (the tree's, or a burst step's single token) and the hidden states of its
        rows ([Q, H], None if not asked); start_position: the first position that tick cached."""
        if self.verdict is None:
            self.verdict, self.start_position = verdict, start_position
        else:
            self.decoded.append(verdict.next_token_id)
        if hidden is not None:
            self.kept_hidden.append(hidden[list(verdict.rows_to_keep)])  # [K, H]

    def burst_goes_on(self, eos: frozenset[int], room: bool) -> bool:
        """Another burst step: steps left, no EOS token yet, under max_commit, room in the context."""
        committed = len(self.verdict.committed_token_ids) + len(self.decoded)
        last = self.decoded[-1] if self.decoded else self.verdict.next_token_id
        return (len(self.decoded) < self.decode_steps and last not in eos and room
                and (self.max_commit <= 0 or committed < self.max_commit))

    def answer(self) -> tuple[Verdict, torch.Tensor | None]:
        """The whole request's verdict (decoded tokens included) and [K, H] every row it cached, if asked."""
        kept = torch.cat(self.kept_hidden) if self.kept_hidden else None
        return replace(self.verdict, decoded_token_ids=tuple(self.decoded)), kept


@dataclass(eq=False)
class ReleaseWork(Work):
    session: TargetSession | None = None


@dataclass(eq=False)
class ExportWork(Work):
    session: TargetSession | None = None
    dtype: torch.dtype | None = None  # the blob's dtype (None: the cache's own)


@dataclass(eq=False)
class ImportWork(Work):
    session: TargetSession | None = None
    layers: offload.Layers = field(default_factory=list)  # per layer [H_kv, L, D] keys and values (CPU)
