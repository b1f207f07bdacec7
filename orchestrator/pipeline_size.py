"""How far a pipelined tree grows past the balance point: measured, not modelled.

While pipelined, the draft drafts the next tree during each verification, so the goodput trigger sizes a pipelined
tree to what the draft makes in one verification (``GoodputThreshold.pipeline_nodes``, the balance point: neither
side waits for the other). A model of two busy sides says growing past it cannot pay when the draft is the slower
side; measured, it often does: on an AMX Xeon at RTT 50 ms with the half draft, fixed trees of 16 ran 1.11x the
goodput trigger's ~11-node pipelined rounds after the first tokens (56.2 against 50.7 tokens/s, three runs pooled,
bench/results/network_xeon_stretch), while on a Zen 4 EPYC trees twice the balance point ran 0.92x-1.01x of fixed-16
where the balance point ran 1.00x-1.03x. What a round costs besides its draft forwards (the verdict's trip back, the
next round's start) differs between machines, so each stretch of the balance point is tried on rounds of the
session's own traffic and the faster one kept: ``Stretches``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Stretches:
    """Pipelined trees of the balance point's size times a stretch. Each stretch's rate (committed tokens over round
    ms, decayed over the rounds it sized) is measured; the fastest sizes the next round, and every ``probe_every``th
    round another (in turn) is measured again, so a choice follows the traffic and the machine's pace."""

    choices: tuple[float, ...] = (1.0, 1.5, 2.0)
    decay: float = 0.9  # weight of a stretch's earlier rounds at each new one
    probe_every: int = 4  # rounds between probes of a stretch other than the fastest
    now: float = 1.0  # the stretch sizing the round being drafted
    sized: bool = False  # ``now`` sized the round in flight (it is measured when its outcome comes)
    rates: dict[float, tuple[float, float]] = field(default_factory=dict)  # stretch -> decayed (tokens, ms)
    since_probe: int = 0
    probes: int = 0  # probes so far (which other stretch the next one tries)

    def size(self, balance: int) -> int:
        """The round in flight's pipelined tree size, from the balance point's."""
        self.sized = True
        return max(1, math.ceil(balance * self.now))

    def observe(self, committed: int, round_ms: float) -> None:
        """A drafted round's outcome: measured for ``now`` if ``now`` sized it; then the next round's stretch."""
        if not self.sized:
            return
        self.sized = False
        if round_ms > 0:
            tokens, ms = self.rates.get(self.now, (0.0, 0.0))
            self.rates[self.now] = (self.decay * tokens + committed, self.decay * ms + round_ms)
        self.now = self._next()

    def discard(self) -> None:
        """The round in flight was not a pipelined round (a copied span, target-only): not measured."""
        self.sized = False

    def _next(self) -> float:
        untried = [c for c in self.choices if c not in self.rates]
        if untried:
            return untried[0]
        best = max(self.choices, key=lambda c: self.rates[c][0] / self.rates[c][1])
        others = [c for c in self.choices if c != best]
        self.since_probe += 1
        if others and self.since_probe >= self.probe_every:
            self.since_probe = 0
            self.probes += 1
            return others[self.probes % len(others)]
        return best
