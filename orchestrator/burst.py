"""How many tokens a round without a draft tree asks the verifier to decode alone: the decode burst.

A target-only round (``--draft none``, a draft the goodput trigger found not to pay, a failed draft)
commits the target's next token. Sent one token per Verify, every token pays a network round trip:
at RTT 50 ms next to a ~50 ms target step that halves tokens/s. A Verify with ``decode_steps`` has the
verifier decode that many more tokens itself, one scheduler tick each, batched with everyone else's
work, and answer once (``verifier_service.engine``): the round trip is paid once per burst.

A burst's tokens reach the client only when the burst ends, so bursts are as short as the network
allows: the smallest k for which the measured time outside the verifier (the caller's wall time of a
Verify less the verifier's own verify_ms: network, serialization, gRPC queues) is at most ``overhead``
of the round, i.e. outside / (outside + k · step) <= overhead, capped at ``max_tokens``. Next to the
verifier (~2 ms outside, ~50 ms a step on CPU) that is one token a Verify, as without bursts. Each
session measures afresh, and before it has measured anything it asks for one token: with no draft, its
first token streams after one step, not after a whole burst. (Doubling bursts from there, like TCP's
slow start, was measured and dropped: its short early bursts made target-only rounds look slow to the
goodput trigger, which then kept drafting; 0.78x / 0.64x tokens/s at RTT 50 / 100 with the eagle draft,
bench/results/network_burst_eagle_slowstart.md.)

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

    def tokens(self, remaining: int) -> int:
        """Tokens the next target-only round should commit (>= 1, <= remaining)."""
        if self.fixed or self.outside_ms is None or self.step_ms is None or self.step_ms <= 0:
            return 1
        k = math.ceil(self.outside_ms * (1 - self.overhead) / (self.overhead * self.step_ms))
        return max(1, min(k, self.max_tokens, remaining))

    def observe(self, call_ms: float, verify_ms: float, committed: int, plain: bool) -> None:
        """One Verify: the caller's wall time of it, the verifier's, the tokens it committed, and whether it
        was target-only (a drafted round's verify_ms stands in for a step until a target-only one is seen)."""
        if call_ms > 0:
            self.outside_ms = self._mix(self.outside_ms, max(call_ms - verify_ms, 0.0))
        if plain and committed > 0:
            self.step_ms = self._mix(self.step_ms, verify_ms / committed)
        elif self.step_ms is None and verify_ms > 0:
            self.step_ms = verify_ms  # a tree's forward: dearer than a step, so the first bursts are short

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ema) * old + self.ema * new
