"""The draft's forward spans (draft_service.rounds.GrowthRound) as the console exporter writes them, read back from a
service log and counted to generations by bench/draft_trace.py (``network.py --draft-trace``)."""

import io
import pathlib
import sys
import time

import torch
from opentelemetry import trace
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

from draft_service.drafter import GrowthControl
from draft_service.lean import ForwardInterrupted
from draft_service.rounds import GrowthRound
from specsplit.growth import GrowthPolicy
from tiny import span_exporter

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import draft_trace  # noqa: E402

VOCAB = 64


def traced_round() -> None:
    """A round of a toy model (t -> t + 1) that copies a 2-token span at the root, grows to 4 nodes (the span's
    forward gave the third node's row), drafts three provisional tokens and is closed during its fourth provisional
    forward, which stops."""
    control = GrowthControl()
    calls = []

    def forward(tree, nodes, stop=None):
        calls.append(nodes)
        if control.verifying is not None and len(calls) == 7:  # the fourth provisional forward: the round ends
            control.close()
        if stop is not None and stop():
            raise ForwardInterrupted
        logits = torch.full((len(nodes), VOCAB), -10.0)  # [F, V]
        for row, node in enumerate(nodes):
            logits[row, 1 if node < 0 else (tree.token_ids[node] + 1) % VOCAB] = 10.0
        return logits

    round_ = GrowthRound(forward, lambda n: None, lookup=lambda path: [1, 2] if not path else [])
    with trace.get_tracer(__name__).start_as_current_span("test.round"):
        for step in round_.run([], 4, GrowthPolicy(), control, provisional_max=8):
            if step.done:
                control.verify(4)
    assert [len(nodes) for nodes in calls] == [1, 2, 1, 1, 1, 1, 1]  # root row, span, growth, 4 provisional


def test_forwards_are_read_back_from_a_log_and_counted_to_their_generation():
    span_exporter()  # (the SDK's tracer provider, set once for the test process)
    console = io.StringIO()
    processor = SimpleSpanProcessor(ConsoleSpanExporter(out=console))
    trace.get_tracer_provider().add_span_processor(processor)
    try:
        window = [time.time_ns()]
        traced_round()
        time.sleep(0.05)  # (the draft waiting for the next round)
        traced_round()
        window.append(time.time_ns())
        traced_round()  # outside every window: a warm-up
    finally:
        processor.shutdown()
    log = "INFO draft: serving on 10.77.0.1:50053 {not json\n" + console.getvalue() + "INFO draft: stopping\n"

    forwards = draft_trace.read_forwards(log)
    phases = [f["phase"] for f in forwards]
    assert phases == 3 * ["span", "grow", "provisional", "provisional", "provisional", "stopped"]  # (root row: none)
    assert [f["tokens"] for f in forwards[:6]] == [2, 1, 1, 1, 1, 1]
    assert all(f["ms"] >= 0 for f in forwards)
    assert len({f["round"] for f in forwards}) == 3 and len({f["round"] for f in forwards[:6]}) == 1

    rows = [{"config": "goodput+prov", "tokens": 14, "seconds": (window[1] - window[0]) / 1e9,
             "runs": [{"window": window}, {}]}]  # (a run from before --draft-trace has no window)
    assert draft_trace.attribute(rows, forwards) == 6  # the warm-up's
    tally = rows[0]["draft_forwards"]
    assert {phase: entry["forwards"] for phase, entry in tally.items()} == {
        "span": 2, "grow": 2, "provisional": 6, "stopped": 2}
    assert tally["span"]["tokens"] == 4 and rows[0]["runs"][1]["draft_forwards"] == {}
    waits = rows[0]["draft_waits"]
    assert waits["between"] == 1 and waits["between_ms"] >= 50 and 0 <= waits["within_ms"] < waits["between_ms"]
    [line] = [line for line in draft_trace.table(rows) if line.startswith("| goodput+prov")]
    cells = line.split(" | ")
    assert cells[2] == "-" and float(cells[-1].rstrip(" |")) >= 50  # no "given" forward; the wait between the rounds
