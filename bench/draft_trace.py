"""Where the draft's time goes in a network bench run (``bench/network.py --draft-trace``).

The draft service runs with ``OTEL_TRACES_EXPORTER=console`` (``ENV``), so its log holds every
``specsplit.draft.forward`` span (``draft_service.rounds.GrowthRound``: phase, tokens, stopped) as JSON. Each forward is
counted to the generation whose wall-clock window holds its start (the driver records each generation's ``window``; the
namespaces share the host's clock), and each run and row gets ``draft_forwards``: per phase (``grow``, ``given``,
``span``, ``provisional``, and ``stopped`` for forwards the verdict stopped, whatever their phase) the forwards, their
tokens and their milliseconds, and ``draft_waits``: the time between one forward's end and the next one's start, within
a round (the same ``specsplit.draft.grow`` span) and between rounds. ``table`` puts them beside the committed tokens:
what a committed token cost the draft in each phase, how much of the generation's wall time the draft spent in forwards,
and how long it waited between rounds.

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
    [{start_ns, ms, phase, tokens, round}] in order of start, phase ``stopped`` for a stopped forward, round its round's
    span id."""
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
            "tokens": attributes.get("specsplit.num_tokens", 0), "round": span.get("parent_id")})
    return sorted(forwards, key=lambda f: f["start_ns"])


def _tally(forwards: list[dict]) -> dict:
    tally = {}
    for forward in forwards:
        entry = tally.setdefault(forward["phase"], {"forwards": 0, "tokens": 0, "ms": 0.0})
        entry["forwards"] += 1
        entry["tokens"] += forward["tokens"]
        entry["ms"] += forward["ms"]
    return tally


def _waits(forwards: list[dict]) -> dict:
    """One generation's forwards (in order) -> ms between consecutive forwards within a round and between rounds, and
    how many times the draft went from one round to the next."""
    waits = {"within_ms": 0.0, "between_ms": 0.0, "between": 0}
    for last, forward in zip(forwards, forwards[1:]):
        gap = (forward["start_ns"] - last["start_ns"]) / 1e6 - last["ms"]
        if forward["round"] == last["round"]:
            waits["within_ms"] += gap
        else:
            waits["between_ms"] += gap
            waits["between"] += 1
    return waits


def attribute(rows: list[dict], forwards: list[dict]) -> int:
    """Add ``draft_forwards`` and ``draft_waits`` to each run (of each row) with a ``window`` [start_ns, end_ns], from
    the forwards that started inside it, and the sums over its runs to each row. Returns how many forwards fell in no
    window (warm-ups, a generation's last round ending after its window closed)."""
    placed = 0
    for row in rows:
        of_row = []
        for run in row["runs"]:
            start, end = run.get("window", (0, -1))
            mine = [f for f in forwards if start <= f["start_ns"] <= end]
            run["draft_forwards"], run["draft_waits"] = _tally(mine), _waits(mine)
            of_row += mine
        row["draft_forwards"] = _tally(of_row)
        row["draft_waits"] = {key: sum(run["draft_waits"][key] for run in row["runs"])
                              for key in ("within_ms", "between_ms", "between")}
        placed += len(of_row)
    return len(forwards) - placed


def table(rows: list[dict]) -> list[str]:
    """Markdown lines: per row with ``draft_forwards``, the draft's forward ms per committed token by phase, its
    forwards per committed token, the share of the wall time it spent in forwards, its waits between forwards within a
    round per committed token and its mean wait from one round's last forward to the next round's first."""
    traced = [r for r in rows if r.get("draft_forwards")]
    if not traced:
        return []
    lines = ["", "### Where the draft's time goes (--draft-trace: the draft's forward spans)", "",
             "| config | " + " | ".join(f"{p} ms/token" for p in PHASES)
             + " | forwards / token | draft in forwards | waits in rounds ms/token | wait between rounds ms |",
             "|---|" + "--:|" * (len(PHASES) + 4)]
    for row in traced:
        tally, tokens = row["draft_forwards"], max(row["tokens"], 1)
        cells = [f"{tally[p]['ms'] / tokens:.2f}" if p in tally else "-" for p in PHASES]
        forwards = sum(e["forwards"] for e in tally.values())
        busy = sum(e["ms"] for e in tally.values()) / 1e3 / row["seconds"] if row["seconds"] else 0.0
        waits = row["draft_waits"]
        between = f"{waits['between_ms'] / waits['between']:.1f}" if waits["between"] else "-"
        lines.append(f"| {row['config']} | " + " | ".join(cells) + f" | {forwards / tokens:.2f} | {busy:.0%} | "
                     f"{waits['within_ms'] / tokens:.2f} | {between} |")
    return lines
