"""How much of a copied span to verify: the goodput model of prompt lookup's spans.

A copied span (a code edit's unchanged lines, ``specsplit.lookup``) is verified as it is, not a tree the draft grew
(the draft at most drafts on from its end meanwhile), so what it costs is the verification: one call whose time
grows with the tree's nodes (a fixed part for the call, the network and the target's pass over its cache, and a part
per node, ``VerifyCost``), and past the first token the target disagrees with, the rest of the span is waste. Its
first token is right with one chance while the copy is on track (the round before was a span accepted whole) and
with another after anything else (an edit point is often just behind), each later token with a chance of its own
(``SpanChances``). With p0 and p those chances, a span of n nodes commits 1 + p0 (1 - p^n) / (1 - p) tokens in
expectation (the accepted prefix, then the target's own token) for a call of fixed + per_node · n ms; ``span_nodes``
cuts the span at the n with the most tokens per ms.

Where a verification's cost hardly grows with its nodes (a GPU verifier, a slow network) that is the whole span;
where it does (a CPU verifier: 44 ms for one token, 105 ms for 16 and 140 ms for 32 measured on a 2-core Xeon) a
long span pays only while the copy is likely to hold. Pure and driven by outcomes, like the triggers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VerifyCost:
    """A verification call's ms against its tree's nodes: decayed least squares of ms = fixed + per_node · nodes."""

    decay: float = 0.9  # weight of the earlier calls at each new one
    # Σw, Σw·n, Σw·n², Σw·ms, Σw·n·ms over the calls seen (w: decayed weight; n: nodes)
    sums: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)

    def observe(self, nodes: int, ms: float) -> None:
        w, n1, n2, y, ny = (self.decay * s for s in self.sums)
        self.sums = (w + 1, n1 + nodes, n2 + nodes * nodes, y + ms, ny + nodes * ms)

    def fit(self) -> tuple[float, float] | None:
        """(fixed ms, ms per node); None before any call. Calls all of one size say nothing of the per-node part:
        it is taken as 0 then (longer is free until a longer call is measured)."""
        w, n1, n2, y, ny = self.sums
        if w <= 0:
            return None
        spread = w * n2 - n1 * n1  # w² · the variance of n
        per_node = max((w * ny - n1 * y) / spread, 0.0) if spread > 1e-6 * max(w * n2, 1.0) else 0.0
        return max((y - per_node * n1) / w, 0.0), per_node


@dataclass
class SpanChances:
    """Decayed (hits, trials) of copied spans' tokens: the first while on track, the first otherwise, each later one."""

    decay: float = 0.9  # weight of the earlier spans at each new one
    on_track: tuple[float, float] = (0.9, 1.0)  # first token after a span accepted whole (prior: mostly right)
    after_break: tuple[float, float] = (0.5, 1.0)  # first token after any other round (prior: a coin)
    later: tuple[float, float] = (0.9, 1.0)  # a later token, the one before it right (prior: mostly right)
    tracking: bool = False  # the last round was a copied span accepted whole

    def observe(self, nodes: int, accepted: int) -> None:
        """A verified span of ``nodes`` tokens, the first ``accepted`` of them right."""
        if nodes <= 0:
            return
        first = self.on_track if self.tracking else self.after_break
        first = (self.decay * first[0] + (accepted > 0), self.decay * first[1] + 1)
        self.on_track, self.after_break = (first, self.after_break) if self.tracking else (self.on_track, first)
        if accepted > 0:  # later tokens were checked up to the first wrong one (none past the span's end)
            checked = accepted - 1 + (accepted < nodes)
            self.later = (self.decay * self.later[0] + accepted - 1, self.decay * self.later[1] + checked)
        self.tracking = accepted >= nodes

    def interrupt(self) -> None:
        """A round that was not a copied span: the next span starts off track."""
        self.tracking = False

    def chances(self) -> tuple[float, float]:
        """(p0, p): the next span's first token right, each later one right given the one before."""
        (h0, t0), (h, t) = self.on_track if self.tracking else self.after_break, self.later
        return h0 / t0, h / t


def span_nodes(limit: int, chances: tuple[float, float], cost: tuple[float, float] | None) -> int:
    """The length, 1 to ``limit``, at which a copied span commits the most tokens per verification ms (``limit``
    before any verification was timed, or for a span with no length to choose)."""
    if cost is None or limit <= 1:
        return max(limit, 0)
    (p0, p), (fixed, per_node) = chances, cost
    best, best_rate, expected, reach = 1, -1.0, 0.0, p0  # reach: chance the n-th token is right
    for n in range(1, limit + 1):
        expected += reach  # Σ_{k<=n} p0 p^(k-1): the expected accepted prefix of n nodes
        reach *= p
        rate = (1 + expected) / max(fixed + per_node * n, 1e-9)
        if rate > best_rate * (1 + 1e-9):  # ties: the shorter span
            best, best_rate = n, rate
    return best
