"""What specsplit counts for dashboards: OpenTelemetry metrics, through the API only.

Every instrument is defined here, once; the orchestrator and the verifier record into them. Nothing is exported
unless ``OTEL_METRICS_EXPORTER`` asks (``specsplit.telemetry``): until then the API's no-op meter makes each
record call a few hundred nanoseconds. Units follow OpenTelemetry's conventions (``ms``, ``{token}``).

Orchestrator: generations ended (by ``finish_reason``), rounds, committed / drafted / accepted draft tokens (so
acceptance and tau are ratios of counters), round duration and time to first token.
Verifier: forward duration, rows (sessions) and tokens per forward, sessions held, requests refused at capacity.
Draft: each streamed round's draft forwards, by what they were for (``draft_service.rounds.GrowthRound``).
"""

from __future__ import annotations

import time

from opentelemetry import metrics

_meter = metrics.get_meter("specsplit")

generations = _meter.create_counter("specsplit.generations", unit="{generation}",
                                    description="generations ended, by finish_reason")
rounds = _meter.create_counter("specsplit.rounds", unit="{round}", description="draft/verify rounds, by drafter")
committed_tokens = _meter.create_counter("specsplit.tokens.committed", unit="{token}",
                                         description="tokens committed and streamed to clients")
draft_tokens = _meter.create_counter("specsplit.draft.tokens", unit="{token}",
                                     description="draft tree nodes sent for verification")
accepted_tokens = _meter.create_counter("specsplit.draft.tokens.accepted", unit="{token}",
                                        description="draft tokens the target accepted")
round_duration = _meter.create_histogram("specsplit.round.duration", unit="ms",
                                         description="one round, drafting (what was not overlapped) and verification")
time_to_first_token = _meter.create_histogram("specsplit.time_to_first_token", unit="ms",
                                              description="a new generation's start to its first committed tokens")

forward_duration = _meter.create_histogram("specsplit.verifier.forward.duration", unit="ms",
                                           description="one batched forward of the target")
batch_rows = _meter.create_histogram("specsplit.verifier.batch.rows", unit="{session}",
                                     description="sessions (verifications, prompt chunks, decode steps) per forward")
batch_tokens = _meter.create_histogram("specsplit.verifier.batch.tokens", unit="{token}",
                                       description="tokens per forward")
sessions = _meter.create_up_down_counter("specsplit.verifier.sessions", unit="{session}",
                                         description="sessions whose K/V the verifier holds")
refused = _meter.create_counter("specsplit.verifier.refused", unit="{request}",
                                description="new sessions refused with RESOURCE_EXHAUSTED, by reason")

draft_forward_duration = _meter.create_histogram(
    "specsplit.draft.forward.duration", unit="ms",
    description="one draft forward in a streamed round, by phase (grow, given, span, provisional) and stopped")


def record_round(stats, start: float) -> None:
    """One orchestrator round (``specsplit.stream.RoundStats``) that began at ``start`` (perf_counter), by drafter."""
    attributes = {"drafter": stats.drafter}
    rounds.add(1, attributes)
    committed_tokens.add(stats.num_committed, attributes)
    draft_tokens.add(stats.num_draft_tokens, attributes)
    accepted_tokens.add(stats.num_accepted, attributes)
    round_duration.record((time.perf_counter() - start) * 1e3, attributes)
