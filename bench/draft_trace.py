"""Where the draft's time goes in a network bench run (``bench/network.py --draft-trace``).

The draft service runs with ``OTEL_TRACES_EXPORTER=console`` (``ENV``), so its log holds every ``specsplit.draft.forward``
span (``draft_service.rounds.GrowthRound``: phase, tokens, stopped) as JSON. Each forward is counted to the generation
whose wall-clock window holds its start (the driver records each generation's ``window``; the namespaces share the
host's clock), and each run and row gets ``draft_forwards``: per phase (``grow``, ``given``, ``span``,
``provisional``, and ``stopped`` for forwards the verdict stopped, whatever their phase) the forwards, their tokens
and their milliseconds. ``table`` puts them beside the committed tokens: what a committed token cost the draft in
each phase, and how much of the generation's wall time the draft spent in forwards.

The console exporter costs the traced draft some time (a span's JSON, written by a background thread on the draft's
core), so a traced run is for this breakdown, not for its tokens/s.
"""

from __future__ import annotations

import json
from datetime import datetime

ENV = {"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "specsplit-draft"}
PHASES = ("grow", "given", "span", "provisional", "stopped")


def _ns(stamp: str) -> int:
    """An exported span's ISO-8601 time (the console exporter's, microseconds, 'Z') -> ns since the epoch."""
    moment = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    return int(moment.timestamp()) * 1_000_000_000 + moment.microsecond * 1000


def read_forwards(log: str) -> list[dict]:
    """The draft forwards in a service log where console-exported spans (JSON objects) sit between log lines:
    [{start_ns, ms, phase, tokens}] in order of start, phase ``stopped`` for a stopped forward."""
    decoder, at, forwards = json.JSONDecoder(), 0, []
    while (at := log.find("{", at)) >= 0:
        try:
            span, end = decoder.raw_decode(log, at)
        except ValueError:
            at += 1
            continue
        at = end
        if not isinstance(span, dict) or span.get("name") != "specsplit.draft.forward":
            continue
        attributes = span.get("attributes", {})
        start = _ns(span["start_time"])
        forwards.append({
            "start_ns": start, "ms": (_ns(span["end_time"]) - start) / 1e6,
            "phase": "stopped" if attributes.get("specsplit.draft.stopped") else attributes["specsplit.draft.phase"],
            "tokens": attributes.get("specsplit.num_tokens", 0)})
    return sorted(forwards, key=lambda f: f["start_ns"])


def _tally(forwards: list[dict]) -> dict:
    tally = {}
    for forward in forwards:
        entry = tally.setdefault(forward["phase"], {"forwards": 0, "tokens": 0, "ms": 0.0})
        entry["forwards"] += 1
        entry["tokens"] += forward["tokens"]
        entry["ms"] += forward["ms"]
    return tally


def attribute(rows: list[dict], forwards: list[dict]) -> int:
    """Add ``draft_forwards`` to each run (of each row) with a ``window`` [start_ns, end_ns], from the forwards that
    started inside it, and the sum over its runs to each row. Returns how many forwards fell in no window (warm-ups,
    a generation's last round ending after its window closed)."""
    placed = 0
    for row in rows:
        of_row = []
        for run in row["runs"]:
            start, end = run.get("window", (0, -1))
            mine = [f for f in forwards if start <= f["start_ns"] <= end]
            run["draft_forwards"] = _tally(mine)
            of_row += mine
        row["draft_forwards"] = _tally(of_row)
        placed += len(of_row)
    return len(forwards) - placed


def table(rows: list[dict]) -> list[str]:
    """Markdown lines: per row with ``draft_forwards``, the draft's forward ms per committed token by phase, its
    forwards per committed token, and the share of the wall time it spent in forwards."""
    traced = [r for r in rows if r.get("draft_forwards")]
    if not traced:
        return []
    lines = ["", "### Where the draft's time goes (--draft-trace: the draft's forward spans)", "",
             "| config | " + " | ".join(f"{p} ms/token" for p in PHASES) + " | forwards / token | draft in forwards |",
             "|---|" + "--:|" * (len(PHASES) + 2)]
    for row in traced:
        tally, tokens = row["draft_forwards"], max(row["tokens"], 1)
        cells = [f"{tally[p]['ms'] / tokens:.2f}" if p in tally else "-" for p in PHASES]
        forwards = sum(e["forwards"] for e in tally.values())
        busy = sum(e["ms"] for e in tally.values()) / 1e3 / row["seconds"] if row["seconds"] else 0.0
        lines.append(f"| {row['config']} | " + " | ".join(cells) + f" | {forwards / tokens:.2f} | {busy:.0%} |")
    return lines
