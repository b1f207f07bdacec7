"""Prompt lookup: what followed the same words earlier in a session's own tokens (a code edit's unchanged lines).

Pure and model-free, so any side may run it: the n-gram draft service, a model draft that copies spans
(half+ngram) and the orchestrator's lookup rounds.
"""

from __future__ import annotations

LOOKUP_MIN_NGRAM = 3  # a copied span follows a suffix n-gram at least this long (shorter ones match by chance)
LOOKUP_MAX_NGRAM = 4  # prompt lookup's usual 3-4
LOOKUP_MAX = 16  # longest span copied at once by default (the orchestrator's copies: the trigger's span_nodes)
LOOKUP_PROB = 0.9  # the draft probability a copied token is sent with
# A span is verified without the draft while this decayed share of looked-up span tokens was right (code edits:
# most; chat: chance matches, mostly wrong, each breaking the draft's pipeline).
COPY_MIN_HITS = 0.5
COPY_EMA = 0.5  # weight of the latest span in that share
# A model draft that copies spans (half+ngram) keeps the prefix of a span its own next tokens agree with, found by
# one draft forward over the span. While its recent spans were mostly agreed (that decayed share >= COPY_MIN_HITS)
# the forward takes the whole span; otherwise it takes the first SPAN_PROBE tokens, then the rest only if the model
# agreed with all of them. (Measured on a Zen 4 EPYC, half draft, chat: a forward over a 16-token span cost 80-160
# ms, four to eight draft steps, and kept one or two tokens in four of six spans; under a verification, the next
# round waited for it.)
SPAN_PROBE = 2
# Rounds after a copied span that find none let the target decode alone (an edit point between copied spans is
# a token or two) rather than have the draft first catch up on every copied token (measured: 700-870 ms for a
# 1-3 token model round after ~64 copied tokens, 1-thread float32 catch-up on an AVX2 CPU) ...
COPY_BRIDGE_ROUNDS = 2
# ... when there is that much to catch up on: at least this many committed tokens the draft has not seen. A chance
# match (chat) rejected near its start leaves the draft a token or two behind: it goes on at once (measured across
# a 20 ms network: two target-only rounds of 5-7 tokens, 250-400 ms each, after such a span).
COPY_BRIDGE_BEHIND = LOOKUP_MAX


class NgramIndex:
    """Positions after every n-gram (n in [n_min, n_max]) of a growing token sequence."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.follow: dict[tuple[int, ...], list[int]] = {}  # n-gram -> start indices of what followed it

    def extend(self, new_tokens: list[int]) -> None:
        for token in new_tokens:
            self.tokens.append(token)
            end = len(self.tokens)  # the n-grams ending at end-1 are followed by index `end`
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.follow.setdefault(tuple(self.tokens[end - n : end]), []).append(end)

    def continuations(self, max_len: int, max_branches: int, context: list[int] | None = None) -> list[list[int]]:
        """Distinct continuations of the longest suffix n-gram seen before, most recent occurrence first.

        context: whose suffix to look up (default: the indexed tokens themselves); e.g. the indexed tokens
        followed by drafted ones, which are not indexed."""
        end = len(self.tokens)
        context = self.tokens if context is None else context
        for n in range(min(self.n_max, len(context)), self.n_min - 1, -1):
            starts = self.follow.get(tuple(context[len(context) - n :]), [])
            paths: list[list[int]] = []
            for start in reversed(starts):
                if start >= end:
                    continue  # the suffix itself: nothing followed it yet
                path = self.tokens[start : start + max_len]
                if path and not any(p[: len(path)] == path for p in paths):
                    paths.append(path)
                if len(paths) == max_branches:
                    break
            if paths:
                return paths
        return []


class SpanLookup:
    """One copied span at a time: an index kept up with a session's committed tokens."""

    def __init__(self, min_ngram: int = LOOKUP_MIN_NGRAM, max_ngram: int = LOOKUP_MAX_NGRAM, max_len: int = LOOKUP_MAX):
        self.min_ngram, self.max_ngram, self.max_len = max(min_ngram, 1), max(max_ngram, min_ngram, 1), max_len
        self.index = NgramIndex(self.min_ngram, self.max_ngram)

    def span(self, token_ids: list[int], drafted: list[int] = (), max_len: int | None = None) -> list[int]:
        """The most recent continuation of the longest suffix n-gram of ``token_ids`` + ``drafted`` (drafted
        tokens are looked up, not indexed), at most ``max_len`` tokens (default: this lookup's); [] when nothing
        matches."""
        if self.index.tokens != token_ids[: len(self.index.tokens)]:  # history rewritten: rebuild
            self.index = NgramIndex(self.min_ngram, self.max_ngram)
        self.index.extend(token_ids[len(self.index.tokens):])
        paths = self.index.continuations(self.max_len if max_len is None else max_len, 1, list(token_ids) + list(drafted))
        return paths[0] if paths else []


def use_span(span: list[int], ahead: list[int], hits: float) -> bool:
    """Whether a round verifies the looked-up ``span`` as its tree instead of the draft's: with no kept
    provisional tokens (``ahead``), while spans have mostly been right (``hits`` >= COPY_MIN_HITS); with some,
    when the span goes further along them (the draft's own tokens then vouch for its start)."""
    if ahead:
        return len(span) > len(ahead) and span[: len(ahead)] == ahead
    return bool(span) and hits >= COPY_MIN_HITS


def use_bridge(since_copy: int, behind: int) -> bool:
    """Whether a round with no span to copy and no kept provisional tokens lets the target decode alone rather than
    call the draft: ``since_copy`` rounds after a copied span, with the draft ``behind`` by that many committed
    tokens (see COPY_BRIDGE_ROUNDS, COPY_BRIDGE_BEHIND)."""
    return since_copy < COPY_BRIDGE_ROUNDS and behind >= COPY_BRIDGE_BEHIND


def span_hits(hits: float, span: list[int], committed: list[int]) -> float:
    """``hits`` updated with how much of ``span`` the target committed (as far as both go): whether the span was
    verified or not, this is known for free once the round's tokens are committed."""
    n = min(len(span), len(committed))
    return span_share(hits, next((i for i in range(n) if span[i] != committed[i]), n), n)


def span_share(hits: float, agreed: int, checked: int) -> float:
    """The decayed share of span tokens found right, after a span of which the first ``agreed`` of ``checked`` were."""
    return hits + COPY_EMA * (agreed / max(checked, 1) - hits)
