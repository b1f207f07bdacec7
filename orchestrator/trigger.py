"""When to stop drafting and send the tree for verification: the tree-confidence trigger and its α rules.

The draft streams its tree as it grows; after every draft forward the orchestrator computes the
tree-cumulative confidence T = max over the live branches (those the last forward extended) of the
branch confidence (product of the draft's probabilities along the branch) and verifies once T < α.
How α moves is the policy:

- ``EdgeLLMThreshold`` (LLMCad/EdgeLLM): α starts at 0.01; after a verification with N_all drafted
  tokens on the best-matching branch, N_correct of them accepted: all correct → α ← α/2, else
  α ← (N_all − N_correct) / N_all.
- ``GoodputThreshold``: the chance that a branch of confidence T is accepted whole is modelled as
  T^γ, with γ fitted to outcomes (Σ c_i^γ over the followed branch's node confidences = tokens
  accepted; γ < 1: the draft is better than its probabilities say, γ > 1: worse). One more draft forward
  on the best branch gains about T^γ expected tokens for ``step_ms``; it pays while that beats the
  committed tokens per ms the session achieves (round time measured end to end, so network round trips
  and verify forwards are in it). So α = (rate · step_ms)^(1/γ): a slow network or verifier lowers the
  rate, and trees grow deeper. It also decides whether to draft at all: target-only rounds (no tree)
  have their own measured rate, and the round type with the higher one is used (switching only for a
  5% better rate), the other probed once after ``probe_every`` rounds (the gap doubling, up to ``probe_max``,
  while probes confirm the choice; a probe of target-only rounds is skipped while drafting is ``decisive``-ly
  faster than they were, the gap doubling on up to ``probe_max_decisive``), so a draft that does not pay (a
  weak draft next to a fast verifier) costs no more than plain decoding. With pipelined verification
  (provisional drafting that follows the committed path) a tree is verified once it holds what the draft
  makes during one verification (``pipeline_nodes``: those forwards run while the verifier works).
- ``FixedSize``: verify once the tree has ``size`` nodes (the comparison baseline).

Each also says how long a copied span (prompt lookup's, verified as it is) goes out: ``span_nodes``. All
three are pure and driven by ``observe(RoundOutcome)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from orchestrator.pipeline_size import Stretches
from orchestrator.span_length import SpanChances, VerifyCost, span_nodes
from specsplit.lookup import LOOKUP_MAX

ALPHA_MIN = 1e-6  # α never reaches 0 (then T < α could never fire and only the node budget would)
# Provisional drafting continues the sent branch; its tokens count only if the verifier accepts that whole
# branch. Below this chance they are almost always dropped, and waiting for the draft's last provisional
# forward delays the next round (measured with the trained draft_lm, accepted whole ~20% of the time:
# provisional generation cost 5-10% of tokens/s, bench/results/network_draft_lm.md).
PROVISIONAL_MIN_CHANCE = 0.3
# Pipelined verification (OrchestratorConfig.pipeline): while at least this share of drafted rounds' provisional
# drafting follows the committed path (RoundOutcome.pipelined_next), the goodput trigger verifies a tree once it
# holds what the draft makes during one verification (GoodputThreshold.pipeline_nodes), letting the draft supply
# the next tree while the verifier works, instead of pricing each draft forward as if the verifier waited for it
# (the α rule).
PIPELINE_MIN_SHARE = 0.5
# A tree that, accepted whole, would leave at most this many of the request's tokens grows on to take them (that many
# more draft forwards, ~20 ms each on a CPU) instead of leaving them to one more round: a verification and a network
# round trip for a token or two (measured on a Zen 4 EPYC, bench/results/network_zen4_cold: 20 of 64 generations of
# 96 tokens ended with such a round, 55-277 ms).
FINISH_NODES = 2


def tree_confidence(confidence: list[float], live: list[int]) -> float:
    """T = max branch confidence over the live branches' leaves (``live``: node indices); 1.0 for no nodes."""
    return max((confidence[n] for n in live), default=1.0)


@dataclass(frozen=True)
class RoundOutcome:
    num_drafted: int  # N_all: drafted tokens on the branch acceptance followed (the deepest when none accepted)
    num_accepted: int  # N_correct: of those, accepted
    confidences: tuple[float, ...]  # [N_all] branch confidence at each node of that branch, root down
    committed: int  # tokens committed this round (accepted + recovered/bonus)
    round_ms: float  # wall time of the round at the orchestrator: drafting until the trigger + verify incl. network
    draft_steps: int  # draft forwards until the trigger
    draft_ms: float  # draft forward time until the trigger, as the draft measured it
    plain: bool = False  # nothing was drafted: the target decoded alone (a decode burst: committed >= 1)
    pipelined_next: bool = False  # provisional drafting followed the committed path: what it made past it is kept
    verify_ms: float = 0.0  # the verification call as the orchestrator saw it (network included)
    copied: bool = False  # the tree was a span prompt lookup copied, not the draft's: says nothing of the draft
    provisional_steps: int = 0  # draft forwards during the verification (provisional drafting) that arrived in time
    provisional_ms: float = 0.0  # their time as the draft measured it
    nodes: int = 0  # the verified tree's nodes (0: none, a target-only round)
    after_prefill: bool = False  # the call waited for the session's prefill too: verify_ms is not a verification's


def leaves_stub(num_nodes: int, max_nodes: int, remaining: int) -> bool:
    """Whether a tree of ``num_nodes``, accepted whole (plus the bonus token), would leave 1 to ``FINISH_NODES`` of the
    request's ``remaining`` tokens to another round, while the request's end, not the node budget, bounds
    ``max_nodes`` (remaining - 1: the bonus token is the last): then the tree should grow on to ``max_nodes``."""
    return max_nodes == remaining - 1 and 0 < max_nodes - num_nodes <= FINISH_NODES


@dataclass
class FixedSize:
    size: int = 16
    alpha: float = 0.0  # not used: kept so every trigger reports an α
    drafting: bool = True  # the kind of round preferred: always drafted (see GoodputThreshold.drafting)

    def should_verify(self, confidence: float, num_nodes: int, fresh: bool = False, kept: bool = False) -> bool:
        return num_nodes >= self.size

    def provisional_worth(self, branch_confidence: float) -> bool:
        return True  # no model of acceptance: always draft provisionally

    def verifies_grown(self, branch_confidence: float) -> bool:
        return False  # the size is the size

    def span_nodes(self, limit: int) -> int:
        return min(self.size, limit)  # a copied span is a tree too

    def wants_draft(self) -> bool:
        return True

    def observe(self, outcome: RoundOutcome) -> None:
        pass

    def note_step(self, step_ms: float) -> None:
        pass

    def new_session(self) -> None:
        pass


@dataclass
class EdgeLLMThreshold:
    alpha: float = 0.01  # the paper's starting value
    drafting: bool = True  # the kind of round preferred: always drafted (see GoodputThreshold.drafting)

    def should_verify(self, confidence: float, num_nodes: int, fresh: bool = False, kept: bool = False) -> bool:
        return confidence < self.alpha

    def provisional_worth(self, branch_confidence: float) -> bool:
        return True  # the paper's rule has no model of acceptance: always draft provisionally

    def verifies_grown(self, branch_confidence: float) -> bool:
        return False  # the paper's rule: verify once T < α

    def span_nodes(self, limit: int) -> int:
        return min(LOOKUP_MAX, limit)  # the paper copies no spans: prompt lookup's own length

    def wants_draft(self) -> bool:
        return True  # the paper's rule has no cost model: always draft

    def note_step(self, step_ms: float) -> None:
        pass

    def new_session(self) -> None:
        pass

    def observe(self, outcome: RoundOutcome) -> None:
        n_all, n_correct = outcome.num_drafted, outcome.num_accepted
        if n_all <= 0 or outcome.copied:
            return
        if n_correct >= n_all:
            self.alpha = max(self.alpha / 2, ALPHA_MIN)
        else:
            self.alpha = max((n_all - n_correct) / n_all, ALPHA_MIN)


@dataclass
class GoodputThreshold:
    alpha: float = 0.01  # before any measurement: EdgeLLM's start
    ema: float = 0.3  # weight of a new measurement
    rate: float = 0.0  # committed tokens per ms, decayed (0: not measured yet)
    step_ms: float = 0.0  # one draft forward, ms, decayed
    gamma: float = 1.0  # P(branch accepted) = confidence^gamma, decayed fit (geometric mean)
    gamma_range: tuple[float, float] = (0.02, 8.0)
    fitted: bool = False  # gamma has seen an outcome
    # Drafted vs target-only rounds: decayed sums of committed tokens and of round ms for each kind, so each
    # kind's rate is tokens over time (a mean of per-round ratios would let a few rejected rounds swing it).
    drafted: tuple[float, float] = (0.0, 0.0)  # (tokens, ms)
    plain: tuple[float, float] = (0.0, 0.0)  # (tokens, ms)
    decay: float = 0.95  # per round of that kind
    drafting: bool = True  # the kind of round preferred now
    switch_margin: float = 0.05  # the other kind must be this much faster to be preferred (estimates are noisy)
    warmup: int = 4  # drafted rounds before the first target-only probe
    probe_every: int = 16  # rounds of the better round type between probes of the other, at first
    probe_max: int = 64  # each probe that confirms the choice doubles the gap, up to this (a flip resets it)
    probe_gap: int = 0  # the gap now (0: probe_every)
    since_probe: int = 0  # rounds since the last probe (or since the start)
    # A due probe of target-only rounds is skipped, as if it had confirmed drafting, while drafting measures at
    # least this much faster than target-only rounds did (until the gap reaches probe_max_decisive: then it runs).
    # A probe costs most where drafting pays most: it breaks the pipeline and, on a slow network, is a long decode
    # burst (measured at RTT 100 ms with the half draft: a 16-token burst of 1.1 s where drafting commits ~40
    # tokens/s, then a round restarting the pipeline; on a Zen 4 EPYC at RTT 50 ms: a 9-token burst of 590 ms where
    # drafting commits ~55 tokens/s, ~0.4 s lost, against ~6 s of drafted rounds in 64 rounds of ~6 tokens).
    decisive: float = 0.5
    probe_max_decisive: int = 512  # the longest gap while probes are skipped that way (then one runs)
    # Decayed share of drafted rounds whose provisional drafting followed the committed path (make_trigger starts it
    # at PIPELINE_MIN_SHARE when pipelining is on, so the first tree is verified at once and the draft goes on).
    pipelined: float = 0.0
    verify_ms: float = 0.0  # a verification call incl. network, decayed
    # A draft forward during a verification (provisional drafting), decayed: what pipeline_nodes divides by. Not
    # step_ms: with pipelining every round may be seeded by kept tokens, so no growth forward is ever timed (measured:
    # step_ms stayed unmeasured through a whole RTT-50 run and pipelined trees stayed at 1 node), and where draft and
    # verifier share cores a forward under a verification is slower than one between them.
    verify_step_ms: float = 0.0
    # The next drafted round is the first since target-only rounds or since the session started: the draft
    # first catches up on the tokens it skipped (or waits for its prompt's prefill), a cost steady drafting
    # never pays, so that round is not measured and a probe of drafting lasts one round more. (Measured: the
    # half draft's probes after 16-64 target-only rounds spent ~580 ms each catching up, and goodput never
    # drafted again on a CPU where drafting ran 1.37x target-only.)
    resync: bool = False
    cost: VerifyCost = field(default_factory=VerifyCost)  # verification ms against tree nodes (copied spans' length)
    spans: SpanChances = field(default_factory=SpanChances)  # how right copied spans have been
    stretches: Stretches = field(default_factory=Stretches)  # how far pipelined trees grow past pipeline_nodes

    def should_verify(self, confidence: float, num_nodes: int, fresh: bool = False, kept: bool = False) -> bool:
        """T < α; but while drafted rounds' provisional drafting usually follows the committed path (pipelined:
        the draft drafts the branch on during each verification, and what it made is the next tree's start),
        once the tree has ``pipeline_nodes`` nodes (the α rule prices a draft forward as if the verifier waited
        for it), or sooner once its best branch is unlikely to be accepted whole (not ``likely_whole``):
        drafting on from a token the target will probably reject is waste, or once the nodes still missing
        would cost more waiting than they bring (``_waiting_pays``). ``kept``: the tree is last round's kept
        provisional tokens and the draft has not run this round yet (growing it costs the draft's catch-up
        forward too). ``fresh``: the round had no kept provisional tokens (a session's first round, or after
        a rejection): the verifier waits for every node of such a tree, so it is verified at half
        ``pipeline_nodes``, and the draft makes the rest of the next tree during that verification. (Measured at
        RTT 100 ms: growing the whole ~11 nodes first put goodput's first tokens 330 ms behind fixed-4's,
        bench/results/network_half_avx512 run 2.) Other trees grow to ``pipeline_nodes`` times the stretch
        ``stretches`` scored best (``orchestrator.pipeline_size``).

        (Tried on the AVX2 CPU of README "With the half draft": the α rule past ``pipeline_nodes``. With draft and
        verifier on their own cores it ran within that machine's noise of this rule; sharing two cores
        (``specsplit generate --draft half``), trees grew long while a core idled: chat 0.97x of HF greedy
        against 1.15x with this rule. On a Zen 5 EPYC, float16 draft step 14 ms, two runs each at RTT 0 / 50 / 100 ms:
        verifying kept provisional tokens at once whatever their number ran 0.94x / 0.99x / 0.98x of this rule, at
        one node short of ``pipeline_nodes`` 0.99x / 1.00x / 1.01x; the α rule for pipelined trees too (one run)
        ~0.9-0.96x. On a Zen 4 EPYC, pipelined trees grown to twice ``pipeline_nodes``, four runs taking turns at RTT
        20 / 50 ms: 0.96x, 1.01x / 0.92x, 0.97x of fixed-16 against 1.00x, 1.03x / 1.02x, 1.00x for this rule; at RTT 0,
        1.5x ``pipeline_nodes`` 1.01x, 0.96x and 2.5x without ``_waiting_pays`` 1.00x, 0.97x against 0.89x-1.04x for this
        rule over six runs. Nothing beyond noise: the pipelined rounds run at the draft's pace whichever way (in one run
        at RTT 0 a chat answer took the same time with 4 or 18 rounds; README "Why no rule beats a fixed size with this
        draft").)"""
        if self.pipelined >= PIPELINE_MIN_SHARE:
            size = self.pipeline_nodes()
            if fresh:
                return num_nodes >= math.ceil(size / 2) or not self.likely_whole(confidence)
            stretched = self.stretches.size(size)
            missing = stretched - num_nodes
            if stretched > size:  # (past the balance point the measured scores decide, not _waiting_pays's model)
                return missing <= 0 or not self.likely_whole(confidence)
            return (missing <= 0 or not self.likely_whole(confidence)
                    or not self._waiting_pays(num_nodes, missing, missing + (1 if kept else 0)))
        return confidence < self.alpha

    def _waiting_pays(self, num_nodes: int, missing: int, forwards: int) -> bool:
        """Whether a pipelined tree of ``num_nodes`` should wait ``forwards`` more draft forwards (the verifier idle
        meanwhile) for the ``missing`` nodes of ``pipeline_nodes``, or go now: a round, accepted whole, commits
        num_nodes + 1 tokens for a verification call of ``verify_ms``; waiting gives ``missing`` more. Goes
        now unless the waiting round's rate beats it. The draft seldom makes quite ``pipeline_nodes`` during a
        verification (it starts after the call does, and its last forward is still running when the verdict comes),
        so a pipelined round that waited for them every time left the verifier idle for a catch-up and a growth
        forward a round (measured on a Zen 3 EPYC, bench/results/network_zen3_triggers: trees of 7 nodes from 5-6
        kept tokens, ~100 ms of each ~400 ms round waiting for the draft)."""
        # (missing > 0: pipeline_nodes() > 1, so the call and a draft forward are both measured)
        waited_ms = self.verify_ms + forwards * self._pipelined_step_ms()
        return (num_nodes + 1) * waited_ms < (num_nodes + missing + 1) * self.verify_ms

    def pipeline_nodes(self) -> int:
        """A pipelined tree's size: as many tokens as the draft makes during one verification (its call time
        over a draft forward's under a verification; a growth forward's until one is measured), so that neither
        side waits long for the other. Before both are measured: 1."""
        step_ms = self._pipelined_step_ms()
        if self.verify_ms <= 0 or step_ms <= 0:
            return 1
        return max(1, math.ceil(self.verify_ms / step_ms))

    def _pipelined_step_ms(self) -> float:
        """A draft forward during a verification (a growth forward's time until one is measured; 0: neither)."""
        return self.verify_step_ms or self.step_ms

    def likely_whole(self, branch_confidence: float) -> bool:
        """The branch is likely to be accepted whole: its chance, branch_confidence^γ (the model fitted in
        ``observe``; before any outcome: assume so), is at least PROVISIONAL_MIN_CHANCE."""
        return not self.fitted or branch_confidence ** self.gamma >= PROVISIONAL_MIN_CHANCE

    def provisional_worth(self, branch_confidence: float) -> bool:
        """Draft provisionally from the sent branch while it is verified. While pipelined, whenever the branch's
        chance c of being accepted whole pays for it: accepted, the draft's forwards during the verification are
        the next tree (``pipeline_nodes`` forwards it need not run later); rejected, they are dropped, and the next
        round waits for the forward still running, half a forward on average (an idle draft would not make it
        wait). So c · n ≥ (1 - c) / 2 with n = ``pipeline_nodes``. Otherwise only if the branch is ``likely_whole``
        (a draft that is seldom right: its provisional tokens are almost always dropped).

        (Seen on a Zen 4 EPYC with the half draft, chat at RTT 0, every draft forward timed in a one-off run: with
        the likely-whole rule alone the draft stopped after one forward under a pipelined tree of 7 nodes that the
        target then took whole, idle for 84 ms; fixed sizes, always drafting on, never idle that way. Over three runs
        of four chat prompts at RTT 0-100 ms (10 RTT-runs, 8 of them with ``probe_max_decisive`` against the old
        probe gap too) the goodput trigger ran 1.006x pooled against its earlier rules: within the noise.)"""
        if not self.fitted or self.pipelined < PIPELINE_MIN_SHARE:
            return self.likely_whole(branch_confidence)
        chance = branch_confidence ** self.gamma
        return chance * (2 * self.pipeline_nodes() + 1) >= 1

    def verifies_grown(self, branch_confidence: float) -> bool:
        """Whether a step the draft has already grown past the point where ``should_verify`` fired joins the tree
        (it costs no wait; left out, it would be verified one round trip later): while pipelined (the draft is
        reliable) and the branch is still likely to be accepted whole (``likely_whole``). Such steps pile up in a
        session's first round: the draft grows it while the verifier caches the prompt
        (``orchestrator.drafts._open_first_round``) and the trigger reads it once the verifier is ready."""
        return self.pipelined >= PIPELINE_MIN_SHARE and self.likely_whole(branch_confidence)

    def span_nodes(self, limit: int) -> int:
        """How much of a copied span (at most ``limit`` tokens) to verify: as long as its expected tokens per
        verification ms still grow (``orchestrator.span_length``)."""
        return span_nodes(limit, self.spans.chances(), self.cost.fit())

    def _rates(self) -> tuple[float, float] | None:
        """(drafted, target-only) rounds' committed tokens per ms; None until both kinds were measured."""
        (dt, dms), (pt, pms) = self.drafted, self.plain
        return (dt / dms, pt / pms) if dms > 0 and pms > 0 else None

    def _prefer_drafting(self) -> bool:
        rates = self._rates()
        if rates is None:
            return True
        drafted, plain = rates
        if self.drafting:
            return plain <= drafted * (1 + self.switch_margin)
        return drafted > plain * (1 + self.switch_margin)

    def wants_draft(self) -> bool:
        """Draft this round, or let the target decode alone: the round type with the higher measured rate,
        the other one once after ``probe_gap`` rounds (target-only first probed after ``warmup``)."""
        if self.drafted[1] <= 0:
            return True  # measure drafting first
        due = self.since_probe >= (self.warmup if self.plain[1] <= 0 else (self.probe_gap or self.probe_every))
        if due and self.drafting and self._decisive():
            self.since_probe = 0  # skipped: counted as a probe that confirmed drafting
            self._lengthen_probe_gap(self.probe_max_decisive)
            return True
        return self.drafting != due

    def _lengthen_probe_gap(self, cap: int | None = None) -> None:
        """Double the gap, up to ``cap`` (probe_max); never shorten it (a probe after a gap that skipped probes
        lengthened past probe_max confirms the choice: the gap stays)."""
        gap = self.probe_gap or self.probe_every
        self.probe_gap = max(min(2 * gap, cap or self.probe_max), gap)

    def _decisive(self) -> bool:
        """Drafting is so much faster than target-only rounds were that a probe could not flip the choice (and the
        probe gap is still short of probe_max_decisive)."""
        rates = self._rates()
        if rates is None or rates[1] <= 0 or (self.probe_gap or self.probe_every) >= self.probe_max_decisive:
            return False
        drafted, plain = rates
        return drafted >= (1 + self.decisive) * plain

    def new_session(self) -> None:
        self.resync = True
        self.stretches.discard()  # (copied from the session before, maybe mid-round)

    def observe(self, outcome: RoundOutcome) -> None:
        if outcome.verify_ms > 0 and not outcome.after_prefill and (outcome.nodes or outcome.committed == 1):
            self.cost.observe(outcome.nodes, outcome.verify_ms)  # (not a decode burst: many forwards in one call)
        if outcome.copied or outcome.plain or outcome.after_prefill or self.resync:
            self.stretches.discard()  # not a pipelined round (after_prefill, resync: a session's first)
        else:
            self.stretches.observe(outcome.committed, outcome.round_ms, outcome.pipelined_next)
        if outcome.copied:  # neither kind of round; the draft skipped its tokens (or ran them in one forward)
            self.spans.observe(outcome.nodes, outcome.num_accepted)
            self.resync = True
            return
        self.spans.interrupt()
        if not outcome.plain and self.resync:
            self.resync = False
            return  # not measured (see resync); a due probe stays due
        self.resync = outcome.plain
        probed = (not outcome.plain) != self.drafting
        self.since_probe = 0 if probed else self.since_probe + 1
        if outcome.round_ms > 0:
            tokens, ms = self.plain if outcome.plain else self.drafted
            kind = (self.decay * tokens + outcome.committed, self.decay * ms + outcome.round_ms)
            self.plain, self.drafted = (kind, self.drafted) if outcome.plain else (self.plain, kind)
            before, self.drafting = self.drafting, self._prefer_drafting()
            if probed:  # a probe that confirms the choice: probe half as often; one that flips it: as at first
                if self.drafting == before:
                    self._lengthen_probe_gap()
                else:
                    self.probe_gap = self.probe_every
        if outcome.plain:
            return
        self.pipelined = (1 - self.ema) * self.pipelined + self.ema * outcome.pipelined_next
        if outcome.round_ms > 0 and outcome.committed > 0:
            self.rate = self._mix(self.rate, outcome.committed / outcome.round_ms)
        if outcome.draft_steps > 0 and outcome.draft_ms > 0:
            self.step_ms = self._mix(self.step_ms, outcome.draft_ms / outcome.draft_steps)
        if outcome.verify_ms > 0:
            self.verify_ms = self._mix(self.verify_ms, outcome.verify_ms)
        if outcome.provisional_steps > 0 and outcome.provisional_ms > 0:
            self.verify_step_ms = self._mix(self.verify_step_ms, outcome.provisional_ms / outcome.provisional_steps)
        if outcome.confidences:
            fit = fit_gamma(outcome.confidences, outcome.num_accepted, self.gamma_range)
            # γ is a scale (an exponent): averaged geometrically, so one rejected round of a draft far better than
            # its probabilities (γ ~0.02) moves it to ~0.1, not to ~2.4 (measured with the half draft: the
            # arithmetic mean made the next trees one node long).
            self.gamma = math.exp((1 - self.ema) * math.log(self.gamma) + self.ema * math.log(fit))
            self.fitted = True
        self._set_alpha()

    def note_step(self, step_ms: float) -> None:
        """A draft forward's time as it happens. The first one measured sets α at once: before it α is the
        starting guess, and a draft that is always right would grow its first measured tree to the node
        budget (measured: 48 nodes, 3.5 s of half-draft steps on a CPU where the verifier wanted 16)."""
        if self.step_ms <= 0 < step_ms:
            self.step_ms = step_ms
            self._set_alpha()

    def _set_alpha(self) -> None:
        if self.rate > 0 and self.step_ms > 0:
            self.alpha = min(max((self.rate * self.step_ms) ** (1.0 / self.gamma), ALPHA_MIN), 1.0)

    def _mix(self, old: float, new: float) -> float:
        return new if old <= 0 else (1 - self.ema) * old + self.ema * new


def fit_gamma(confidences: list[float], accepted: int, bounds: tuple[float, float]) -> float:
    """γ with Σ_i confidences[i]^γ = accepted (the sum falls as γ grows), by bisection within ``bounds``."""
    lo, hi = bounds

    def expected(g: float) -> float:
        return sum(max(c, 1e-12) ** g for c in confidences)

    if expected(lo) <= accepted:
        return lo  # even at the smallest γ the draft did better than predicted
    if expected(hi) >= accepted:
        return hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected(mid) > accepted else (lo, mid)
    return (lo + hi) / 2


TRIGGERS = ("goodput", "edgellm", "fixed")


def make_trigger(kind: str, fixed_size: int = 16, pipeline: bool = False):
    """pipeline: kept provisional tokens can be verified at once (OrchestratorConfig.pipeline, provisional on)."""
    if kind == "goodput":
        return GoodputThreshold(pipelined=PIPELINE_MIN_SHARE if pipeline else 0.0)
    if kind == "edgellm":
        return EdgeLLMThreshold()
    if kind == "fixed":
        return FixedSize(fixed_size)
    raise ValueError(f"unknown trigger {kind!r}; choose one of {', '.join(TRIGGERS)}")
