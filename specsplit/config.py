"""Service configuration. Every default carries the reason it is what it is."""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.errors import InvalidArgument
from specsplit.lookup import LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM

# Set for a child service (``launch.DraftProcess``): it stops once its parent is gone (a `specsplit generate` killed,
# or that died before it could close its stack), instead of living on with its model loaded (or loading it).
PARENT_PID_ENV = "SPECSPLIT_PARENT_PID"

# A model's --dtype names -> torch's dtype names (here, not beside torch, so flags are checked without importing it).
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}


@dataclass
class VerifierConfig:
    max_tree_nodes: int = 64  # a 64-node tree costs ~3.6x a 1-token forward on CPU; bigger never pays there
    max_sessions: int = 256  # each session holds a KV cache; past this, Prefill answers RESOURCE_EXHAUSTED
    max_context: int = 0  # 0: the model's max_position_embeddings
    idle_timeout_s: float = 300.0  # a session untouched this long lost its orchestrator: free its KV cache
    # Batching: one forward serves the pending Verify (and Prefill chunks) of many sessions.
    max_batch: int = 32  # rows (sessions) per scheduler tick; 1 = one request at a time
    # Most a tick waits for active sessions' next Verify (it stops once all are in): their orchestrator
    # and draft round trips take ~1.5 ms each on 2 CPU cores and queue on the GIL, ~25 ms for 16 sessions.
    batch_wait_ms: float = 40.0
    max_batch_tokens: int = 512  # tokens per tick (~1 s of SmolLM2 on 2 CPU cores); bounds everyone's latency
    prefill_chunk: int = 128  # a long prompt is cached this many tokens per tick, so it never stalls verification
    max_queued_prefill_tokens: int = 16384  # prompt tokens waiting to be cached; past this Prefill is refused at once
    forward_overhead_tokens: int = 32  # a forward's fixed cost in tokens (CPU: ~50 ms weight reads / ~1.7 ms a token)
    # What one more attention group (an SDPA call, its K/V and query gathers, in every layer) costs, in padded
    # queries; rows of different lengths share a group when padding is cheaper. 0: by device, 8 on CPU,
    # and 4096 on a GPU, where the launches cost more than any padding (one group: SmolLM2 on an H200 ran
    # 41 ms forwards of 7.6 rows in two or three groups, vs 19-22 ms for one row).
    attention_group_overhead: int = 0
    kv_grow_tokens: int = 256  # slot capacity grows in steps of this many positions
    # A Verify may ask the target to decode alone this many more tokens (a burst, one tick each); its
    # answer waits for all of them, so the cap bounds how long one request holds its stream back.
    max_decode_steps: int = 64
    # torch CPU threads of the verifier's forwards (0: the process's). Beside a draft on the same cores,
    # the embedded stack gives it the cores the draft leaves (specsplit.launch.colocated_threads).
    threads: int = 0
    # Packed forwards of a Llama-architecture target through verifier_service.lean: the model's weights and
    # operations without HF's per-module host work (bit-identical logits). False: through the model's forward.
    lean_forward: bool = True
    # Verification ticks replayed as CUDA graphs (verifier_service.graphs): a small target's forward on a GPU is
    # paced by launching its kernels, not by running them. The KV store then holds all max_sessions slots at
    # once (2 x layers x KV heads x head size x dtype bytes a position a slot), so size max_sessions to the GPU.
    # Off a GPU the same fixed-shape ticks run without graphs (slower: padding); needs lean_forward.
    cuda_graphs: bool = False
    # Prompt tokens whose K/V are kept after their prefill, so a later prompt that starts the same way (a system
    # turn, an earlier turn of the conversation) copies them instead of computing them, and prompts arriving
    # together share their common start (verifier_service.prefix).
    # Memory: 2 x layers x KV heads x head size x dtype bytes a token (SmolLM2 in float32: 46 KB). 0: off.
    prefix_cache_tokens: int = 2048

    def validate(self) -> None:
        if self.max_batch < 1 or self.max_sessions < 1:
            raise InvalidArgument("max_batch and max_sessions must be >= 1")
        if self.cuda_graphs and not self.lean_forward:
            raise InvalidArgument("cuda_graphs replays the lean forward: it cannot go with lean_forward=False (--hf-forward)")
        if self.prefix_cache_tokens < 0:
            raise InvalidArgument(f"prefix_cache_tokens must be >= 0 (0: off), got {self.prefix_cache_tokens}")
        if not 0 < self.prefill_chunk <= self.max_batch_tokens or self.max_tree_nodes + 1 > self.max_batch_tokens:
            raise InvalidArgument(f"max_batch_tokens={self.max_batch_tokens} must hold a prefill chunk "
                             f"({self.prefill_chunk}) and a whole tree (max_tree_nodes + 1 = {self.max_tree_nodes + 1})")


@dataclass
class DraftConfig:
    max_nodes: int = 64  # matches the verifier's default tree budget
    ngram_max: int = LOOKUP_MAX_NGRAM  # longest suffix n-gram looked up (prompt lookup's usual 3-4)
    ngram_min: int = 1  # shortest suffix n-gram that may match
    ngram_branches: int = 3  # distinct continuations offered as branches of one tree
    lookup_min_ngram: int = LOOKUP_MIN_NGRAM  # a draft that copies spans (half+ngram) copies after suffix n-grams this long
    model_top_k: int = 2  # children per expanded node in the model drafter's tree
    model_depth: int = 6  # draft forwards per tree
    # Width-adaptive trees (DraftTree): see draft_service/growth.py
    branch_threshold: float = 0.3  # LLMCad: a candidate above 0.3 opens a new branch
    grow_width: int = 4  # frontier nodes expanded per draft forward
    grow_min_relative: float = 0.05  # branches under 5% of the best one's confidence stop
    grow_max_depth: int = 32  # draft forwards per tree at most
    threads: int = 0  # torch CPU threads of a model or eagle draft's forwards (0: the process's)
    q_top_k: int = 32  # a sampling draft draws from its top 32 tokens: q travels as at most 32 (id, prob) pairs
    idle_timeout_s: float = 300.0  # a session untouched this long lost its orchestrator: forget it
    # A model draft's new session that continues the latest ended one (a conversation's next turn sends the earlier
    # turns again) starts from that session's KV cache: only the new tokens are computed.
    reuse_ended: bool = True
    # The half draft takes its dtypes from an earlier calibration of the same machine, model shape and threads, kept in
    # the cache dir (draft_service.dtypes.CALIBRATION_FILE), instead of timing them at every start (the CLI's services).
    remember_calibration: bool = False


@dataclass
class OrchestratorConfig:
    default_max_new_tokens: int = 256  # when a request leaves max_new_tokens at 0
    max_new_tokens_limit: int = 4096  # a request asking more gets INVALID_ARGUMENT
    draft_timeout_s: float = 2.0  # a Propose slower than this counts as a draft failure (fall back)
    verify_timeout_s: float = 60.0  # a big tree on a busy CPU verifier can take seconds
    prefill_timeout_s: float = 300.0  # long prompts on CPU
    draft_retry_rounds: int = 32  # after a draft failure, target-only rounds before trying the draft again
    # ... or this many seconds, whichever comes first (far verifiers make long rounds); the wait doubles at each failure
    # of the session's draft, up to 32x (a hung draft costs a retry's draft_timeout_s at most that often)
    draft_retry_s: float = 1.0
    health_interval_s: float = 1.0  # grpc.health.v1 checks of verifier replicas (a failed call also marks one down)
    health_cut_after: int = 3  # failed checks in a row that cut a replica's calls in flight short (0: never)
    offload_idle: bool = True  # a detached session's KV cache moves to the session store, freeing the replica
    offload_min_tokens: int = 256  # below this, re-prefill is about as fast as a restore: not worth the bytes
    offload_dtype: str = ""  # "" keeps the cache's dtype (token-identical); "float16" halves an fp32 blob
    max_streams: int = 256  # concurrent Generate streams (each holds a server thread); matches the verifier's sessions
    # Greedy sessions with a model or eagle draft stream width-adaptive trees (DraftTree) and verify when the
    # trigger says so; "budget" keeps the older per-round node budget (Propose). See bench/network.py.
    # Default: the goodput trigger with provisional drafting, the one setting that is never far from
    # the best with either kind of draft measured (bench/results/network*.md, edge and cloud on separate
    # cores). With a draft that is always right (the target as draft) it ran at 0.79-1.09x of fixed-4 +
    # provisional across four runs at RTT 0 / 50 (geomean over RTT 0-100 in the first: 8.83 vs 9.33
    # tokens/s); with the shipped draft_lm, usually wrong, at 1.4-1.9x of it (RTT 0 / 50, two runs); with
    # the streamed eagle drafter at 1.00-1.02x of the best fixed size (fixed-1) at RTT 0-100 (three runs),
    # 1.01-1.24x once it could also choose target-only rounds (bench/results/network_eagle.md, run E), and
    # 0.94-1.04x, 1.06-1.13x, 1.18-1.56x, 1.26-1.99x at RTT 0/20/50/100 once those decode bursts (five runs,
    # bench/results/network_burst.md). With the half draft on an AVX-512 CPU, warmed up: 0.95-1.00x of the best
    # fixed size with provisional drafting at RTT 0-100 (every pipelined config runs at the draft's pace), and
    # goodput+0 1.12-1.25x of the best fixed size without it (bench/results/network_half_avx512/). With the int4 half
    # draft on a Zen 5 EPYC (8.7 ms a step): 0.97-1.18x of the best fixed size, below it in 1 of 39 RTT comparisons
    # (bench/results/network_half_zen5_int4/).
    trigger: str = "goodput"  # goodput | edgellm | fixed | budget
    fixed_tree_nodes: int = 4  # trigger "fixed": verify at this many nodes
    tree_max_nodes: int = 48  # node budget of a streamed tree (any trigger)
    # Tokens drafted from the best branch while its tree is verified (0: off). At most what the draft makes during one
    # verification is of use; 16 capped an int4 half draft (8.7 ms a step) at RTT 100 ms on a Zen 5 EPYC, where 32
    # ran the default 1.06x faster over four prompts (54.96 / 57.21 vs 50.53 / 53.24 / 54.81 tokens/s, RTT 50 the
    # same within noise; bench/results/network_half_zen5_int4/provisional_max/). Where the branch is unlikely to be
    # accepted whole the goodput trigger stops it early (trigger.PROVISIONAL_MIN_CHANCE).
    provisional_max: int = 32
    # Pipelined verification: when last round's provisional tokens continue the committed text, send them for
    # verification at once as the next tree (the draft goes on drafting provisionally from their end) instead
    # of waiting for the draft's next round and the trigger. The verifier never waits for the draft, and a
    # tree is as long as what the draft made during the last verification (incl. the network round trip).
    pipeline: bool = True
    # A new session's first tree is sent while the verifier is still prefilling the prompt, timed from the measured
    # prefill rate to arrive as the prefill ends (the verifier runs it right after): its tokens come back one
    # network round trip sooner than when the tree waits for the prefill's answer. Off, or until a prefill has been
    # measured: the first tree is sent after the answer.
    early_verify: bool = True
    # Rounds with no draft tree (--draft none, a draft that does not pay, a failed draft) ask the verifier to
    # decode a burst of tokens alone in one request, sized so the measured round trip outside the verifier
    # is at most burst_overhead of the round (RTT 50 ms, ~80 ms a token: 13 tokens; at 10% it was 6, and the
    # default kept 83-100% of its RTT-0 tokens/s at RTT 50 in three runs, bench/results/network_burst.md).
    burst_max: int = 16  # at most this many tokens a burst (each waits for the burst's end before it streams)
    burst_overhead: float = 0.05
    # A new session's trigger starts from the latest session's estimates (alpha, rates, draft-or-not) instead
    # of from scratch, so a far verifier's first rounds are already sized (bench/results/
    # network_burst.md: run G with, also for burst sizes then; run F without). Off: every session measures
    # afresh (and drafts first).
    share_estimates: bool = True

    def default_new_tokens(self) -> int:
        return min(self.default_max_new_tokens, self.max_new_tokens_limit)
