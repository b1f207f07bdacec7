"""How many tokens a round without a draft tree asks the verifier to decode alone: the decode burst.

A target-only round (``--draft none``, a draft the goodput trigger found not to pay, a failed draft)
commits the target's next token. Sent one token per Verify, every token pays a network round trip:
at RTT 50 ms next to a ~50 ms target step that halves tokens/s. A Verify with ``decode_steps`` has the
verifier decode that many more tokens itself, one scheduler tick each, batched with everyone else's
work, and answer once (``verifier_service.engine``): the round trip is paid once per burst.

A burst's tokens reach the client only when the burst ends, so bursts are as short as the network
allows: the smallest k for which the measured time outside the verifier's work (the caller's wall time of
a Verify less the verifier's ``busy_ms``, the time its model worked meanwhile: the network, serialization,
and the verifier idling) is at most ``overhead`` of the round, i.e. outside / (outside + k · step) <= overhead,
capped at ``max_tokens``; a step is the model's working time per token. Next to a verifier (~2 ms outside,
~50 ms a step on CPU) that is one token a Verify, as without bursts. A batching verifier's ticks wait for the
sessions on their way back (``batch_wait_ms``), so every round trip also idles everyone's next tick: a cost of
the round like the network (sized by verify_ms, which holds that idling, bursts stayed 1-3 tokens and 8 sessions
on a host-bound verifier ran at 0.86-0.92x of HF's batched decoding; by busy_ms, 1.03-1.06x: README, "A host-bound
verifier on two cores"). Time spent on other sessions' ticks is work, not overhead: a verifier serving requests one at a time
idles seldom, and bursts there stay as short as before. Each
session measures afresh, and before it has measured anything it asks for one token: with no draft, its
first token streams after one step, not after a whole burst. (Doubling bursts from there, like TCP's
slow start, was measured and dropped: its short early bursts made target-only rounds look slow to the
goodput trigger, which then kept drafting; 0.78x / 0.64x tokens/s at RTT 50 / 100 with the eagle draft,
bench/results/network_burst_eagle_slowstart.md.)

A drafted round of the budget controller (lookup drafts: n-gram, Medusa; any draft with --trigger budget) may end in a
burst too: when the round's own wall time (draft, round trip, the verifier's queue and forward) per token it is
expected to commit is more than a target-only token costs (``step_ms``), its Verify asks for the same burst after the
tree's verdict (``steps_after_tree``). That is a session whose draft is seldom right (or slow) next to a verifier
whose forwards are short beside everything else a round costs: a GPU, or any verifier across a slow network. There
a drafted round commits
about one token per round trip, slower than the target decoding alone (on an H200, 8 sessions with the n-gram draft
took 1.77 s for their 64 tokens each: ~27 ms a token for the last one to finish, against ~20 ms a step for HF's
batched decoding of the same prompts; bench/results/concurrency_h200_eager). The tree still gets its chance
first, in the same request; a draft that is usually right commits more per round than a burst token costs, and gets
no burst.

Bursts never change a greedy session's tokens (each step is the target's argmax), nor a sampled session's
(coupled draws come from the seed and the position; rejection sampling's from the seed and the committed length).
What they change is how many rounds a session takes, and a seeded session sampled by rejection sampling *with a
draft* must not let timings decide that (its next trees, hence its draws, depend on the round sequence): it keeps
one token a round (``fixed``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class BurstSizer:
    max_tokens: int = 16  # tokens a burst at most (each waits for the burst's end before it streams)
    overhead: float = 0.05  # the round trip's share of a burst round at most
    fixed: bool = False  # always one token a round (a seeded sampled session with a draft)
    ema: float = 0.3  # weight of a new measurement
    outside_ms: float | None = None  # a Verify's time outside the verifier, decayed
    step_ms: float | None = None  # the verifier's time per committed token of a target-only round, decayed
    drafted_ms: float | None = None  # a drafted round's wall time less its burst steps, decayed

    def tokens(self, remaining: int) -> int:
        """Tokens the next target-only round should commit (>= 1, <= remaining)."""
        if self.fixed or self.outside_ms is None or self.step_ms is None or self.step_ms <= 0:
            return 1
        k = math.ceil(self.outside_ms * (1 - self.overhead) / (self.overhead * self.step_ms))
        return max(1, min(k, self.max_tokens, remaining))

    def steps_after_tree(self, expected_accepted: float, remaining: int) -> int:
        """Decode steps a drafted round's Verify asks for after the tree's verdict: a burst's, if a target-only token
        (``step_ms``) costs less than the drafted round's wall time per token it should commit (1 +
        ``expected_accepted``); else 0. Nothing until both are measured."""
        if self.fixed or self.step_ms is None or self.drafted_ms is None:
            return 0
        if self.step_ms * (1.0 + expected_accepted) >= self.drafted_ms:
            return 0
        return self.tokens(remaining) - 1

    def observe_drafted(self, round_ms: float, decoded: int) -> None:
        """A drafted round's wall time at the orchestrator (draft, Verify call, bookkeeping) and the tokens its
        burst decoded after the tree's verdict (their steps are taken out: what is left is the drafted round's)."""
        if round_ms > 0:
            steps_ms = decoded * self.step_ms if self.step_ms is not None else 0.0
            self.drafted_ms = self._mix(self.drafted_ms, max(round_ms - steps_ms, round_ms / (1 + decoded)))

    def observe(self, call_ms: float, verify_ms: float, committed: int, plain: bool, decoded: int = 0,
                busy_ms: float = 0.0) -> None:
        """One Verify: the caller's wall time of it, the verifier's, the tokens it committed, whether it was
        target-only, (a drafted one) how many it decoded alone after the tree's verdict, and the verifier's working
        time meanwhile (``busy_ms``; 0 from a verifier that does not say). A drafted round's time stands in for a
        step until a burst is seen (its tree's forward is dearer than a step, so the first bursts are short); with a
        burst after its tree, its ticks (the tree's counted as one step) measure a step."""
        work_ms = busy_ms or verify_ms  # the model working meanwhile (an older verifier: its time); idling is overhead
        if call_ms > 0:
            self.outside_ms = self._mix(self.outside_ms, max(call_ms - work_ms, 0.0))
        if plain and committed > 0:
            self.step_ms = self._mix(self.step_ms, work_ms / committed)
        elif decoded > 0 and work_ms > 0:
            self.step_ms = self._mix(self.step_ms, work_ms / (1 + decoded))
        elif self.step_ms is None and work_ms > 0:
            self.step_ms = work_ms

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ema) * old + self.ema * new
