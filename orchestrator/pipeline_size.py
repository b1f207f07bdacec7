"""How far a pipelined tree grows past the balance point: measured, not modelled.

While pipelined, the draft drafts the next tree during each verification, so the goodput trigger sizes a pipelined
tree to what the draft makes in one verification (``GoodputThreshold.pipeline_nodes``, the balance point: neither
side waits for the other). A model of two busy sides says growing past it cannot pay when the draft is the slower
side; measured, it sometimes does: on an AMX Xeon at RTT 50 ms with the half draft, fixed trees of 16 ran 1.11x the
goodput trigger's ~11-node pipelined rounds after the first tokens (56.2 against 50.7 tokens/s, three runs pooled,
bench/results/network_xeon_stretch), while on a Zen 4 EPYC trees twice the balance point ran 0.92x-1.01x of fixed-16
where the balance point ran 1.00x-1.03x. What a round costs besides its draft forwards (the verdict's trip back, the
next round's start) differs between machines, so each stretch of the balance point is tried on rounds of the
session's own traffic and the faster one kept: ``Stretches``. (On a Zen 4 EPYC, each stretch pinned, one run at RTT 0 /
50 ms: 1 ran 1.05x / 0.97x of fixed-16, 2 1.01x / 0.90x, 3 1.01x / 0.84x; the measured choice, scored as below, ran
1.02x / 1.00x / 1.01x / 0.98x of the best fixed size at RTT 0 / 20 / 50 / 100 over four runs,
bench/results/network_zen4_level.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Stretches:
    """Pipelined trees of the balance point's size times a stretch. Each stretch is scored by the tokens its rounds
    committed over the tokens the session's recent rounds' rate (the level, whichever stretch sized them) would have
    committed in the same time, decayed over the rounds it sized; the best scored sizes the next round, and every
    ``probe_every``th round another (in turn) is measured again, so a choice follows the traffic and the machine's pace.

    Scored against the level, not by its own rate: what a session writes changes a round's rate far more than the
    stretch does (a code edit's pipelined rounds commit 32 tokens where a chat answer's commit 12), and a stretch
    measured only now and then would be judged by the text it happened to meet. (Measured with rates alone, on a Zen 4
    EPYC at RTT 50 ms: the probe that met the first code edit scored 61 tokens/s against the chat-era 51 of the
    stretch that had led, and kept the lead through the code edits on rates from their text alone.) A rejected branch
    costs its stretch the fresh round after it too: longer trees are rejected more often."""

    choices: tuple[float, ...] = (1.0, 1.5, 2.0)
    decay: float = 0.9  # weight of a stretch's earlier rounds at each new one
    level_decay: float = 0.6  # weight of the earlier rounds in the level (a few rounds: it follows the text)
    probe_every: int = 4  # rounds between probes of a stretch other than the best
    now: float = 1.0  # the stretch sizing the round being drafted
    sized: bool = False  # ``now`` sized the round in flight (it is measured when its outcome comes)
    level: tuple[float, float] = (0.0, 0.0)  # decayed (tokens, ms) of the latest measured rounds
    scores: dict[float, tuple[float, float]] = field(default_factory=dict)  # stretch -> decayed (tokens, at level)
    owed: float | None = None  # the stretch the next round is measured for though it did not size it (see observe)
    since_probe: int = 0
    probes: int = 0  # probes so far (which other stretch the next one tries)

    def size(self, balance: int) -> int:
        """The round in flight's pipelined tree size, from the balance point's."""
        self.sized = True
        return max(1, math.ceil(balance * self.now))

    def score(self, stretch: float) -> float:
        """Tokens a stretch's rounds committed per token the level expected of them (1: as fast as the rest)."""
        tokens, expected = self.scores[stretch]
        return tokens / expected if expected > 0 else 1.0

    def observe(self, committed: int, round_ms: float, pipelined_next: bool = True) -> None:
        """A drafted round's outcome: measured for ``now`` if ``now`` sized it, then the next round's stretch. A round
        whose provisional drafting went off the committed path (``pipelined_next`` false: a branch rejected) leaves
        the next round to start fresh, the verifier waiting for the draft to grow its tree: that round is measured
        for the same stretch, as part of what its rejection cost."""
        stretch = self.now if self.sized else self.owed
        if stretch is None:
            return
        self.owed = None if pipelined_next else stretch
        if round_ms > 0:
            level_tokens, level_ms = self.level
            expected = round_ms * level_tokens / level_ms if level_ms > 0 else committed  # (the first: par)
            tokens, at_level = self.scores.get(stretch, (0.0, 0.0))
            self.scores[stretch] = (self.decay * tokens + committed, self.decay * at_level + expected)
            self.level = (self.level_decay * level_tokens + committed, self.level_decay * level_ms + round_ms)
        if self.sized:
            self.sized = False
            self.now = self._next()

    def discard(self) -> None:
        """The round in flight was not a pipelined round (a copied span, target-only): not measured."""
        self.sized = False
        self.owed = None

    def _next(self) -> float:
        untried = [c for c in self.choices if c not in self.scores]
        if untried:
            return untried[0]
        best = max(self.choices, key=self.score)
        others = [c for c in self.choices if c != best]
        self.since_probe += 1
        if others and self.since_probe >= self.probe_every:
            self.since_probe = 0
            self.probes += 1
            return others[self.probes % len(others)]
        return best
