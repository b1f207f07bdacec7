"""The concurrency benchmark's results and report: a Session per client request, a Result per method and
concurrency, and concurrency.md's table, written from what ``bench/concurrency.py`` measured."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch


@dataclass
class Session:
    token_ids: list[int]
    ttft_s: float  # request to first token
    token_latencies_s: list[float]  # per token after the first (see bench/concurrency.py's docstring)
    rounds: int = 0
    draft_tokens: int = 0
    seconds: float = 0.0  # request to last token
    decoded: int = 0  # tokens the target decoded alone in bursts (after a tree's verdict, or with no tree)


@dataclass
class Result:
    method: str
    sessions: int  # concurrency: clients at once
    tokens: int
    wall_s: float
    tokens_per_s: float
    p50_ms: float  # per-token latency
    p95_ms: float
    ttft_p50_ms: float
    mean_tree: float  # drafted tokens per round (specsplit only)
    tau: float  # tokens committed per round (specsplit only)
    rows_per_forward: float  # verifier forwards' mean rows (specsplit only)
    other_load: float  # cores other processes kept busy during the run
    think_ms: float = 0.0  # mean time from the verifier's answer to the session's next Verify (specsplit only)
    repeat: int = 0  # which of the --repeats runs
    verifier_busy: float = 0.0  # fraction of the wall time the verifier spent in forwards (specsplit only)
    prefill_share: float = 0.0  # of that forward time, the prompt chunks' share (specsplit only)
    prefix_tokens: int = 0  # prompt tokens the verifier copied from kept prompts instead of computing (specsplit only)
    graphed_share: float = 0.0  # of the verifier's forwards, those replayed as CUDA graphs (specsplit only)
    session_s: list[float] = field(default_factory=list)  # each session's request to last token, s (the queue's order)
    decoded: int = 0  # tokens decoded alone in bursts, all sessions (specsplit only)
    token_ids: list[list[int]] = field(default_factory=list)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarise(method, concurrency: int, sessions: list[Session], wall, other, mean_tree, tau,
              rows_per_forward) -> Result:
    tokens = sum(len(s.token_ids) for s in sessions)
    lat = [x for s in sessions for x in s.token_latencies_s]
    return Result(method, concurrency, tokens, round(wall, 3), round(tokens / wall, 2),
                  round(percentile(lat, 0.5) * 1e3, 1), round(percentile(lat, 0.95) * 1e3, 1),
                  round(statistics.median(s.ttft_s for s in sessions) * 1e3, 1), round(mean_tree, 2),
                  round(tau, 2), round(rows_per_forward, 2), round(other, 2),
                  session_s=[round(s.seconds, 3) for s in sessions], decoded=sum(s.decoded for s in sessions),
                  token_ids=[s.token_ids for s in sessions])


def median_runs(results: list[Result]) -> dict[tuple[str, int], Result]:
    """(method, sessions) -> the run with the median tokens/s over the repeats (the lower middle for even)."""
    runs: dict[tuple[str, int], list[Result]] = {}
    for r in results:
        runs.setdefault((r.method, r.sessions), []).append(r)
    return {key: sorted(rs, key=lambda r: r.tokens_per_s)[(len(rs) - 1) // 2] for key, rs in runs.items()}


def markdown(results: list[Result], references: list[list[int]], args) -> str:
    by = median_runs(results)
    repeats = max(r.repeat for r in results) + 1
    lean = any(r.method == "batched_lean" for r in results)  # (--cuda-graphs: the batching verifier without them)
    where = (f"; target processes (verifiers, HF) on CPU {args.model_cpus}, clients/orchestrator/draft on CPU "
             f"{args.edge_cpus or 'any'}") if args.model_cpus else ""
    where += f"; {args.edge_procs} edge processes" if args.edge_procs > 1 else ""
    where += "".join(f"; verifier {k}={v}" for k, v in verifier_overrides(args).items())
    on = "CPU" if args.device == "cpu" else f"{args.device} ({device_name(args.device)}) for the target, the edge side on CPU"
    lines = [f"SmolLM2-135M-Instruct, {args.dtype}, {on}, {args.threads} torch threads{where}, greedy, max_new_tokens="
             f"{args.max_new_tokens}, n-gram draft; n concurrent clients taking {args.waves} wave(s) of n requests from one queue, "
             f"each the next request as soon as its session ends (wave w = prompts w*n .. w*n+n-1 of "
             f"{args.prompts.name}, cycling); HF: one left-padded "
             "generate per wave, back to back. tok/s = aggregate; latency = per-token (after the first token), ms."
             + (f" Each method ran {repeats} times, taking turns; the table shows each method's median run, the "
                "last column every run's ratios in order." if repeats > 1 else ""), "",
             "| sessions | batched tok/s | one-at-a-time tok/s | HF batched tok/s | batched / one-at-a-time "
             "| batched / HF | batched p50 / p95 | one-at-a-time p50 / p95 | HF p50 / p95 | batched TTFT p50 "
             "| mean tree (batched / 1-at-a-time) | rows per forward | verifier busy | prefill share (batched / 1-at-a-time) "
             "| identical to HF greedy | prompt tokens copied (batched / 1-at-a-time) |"
             + (" batched / one-at-a-time, batched / HF, each repeat |" if repeats > 1 else "")
             + (" batched without CUDA graphs tok/s | with / without |" if lean else ""),
             "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|" + ("---|" if repeats > 1 else "")
             + ("--:|--:|" if lean else "")]
    for n in args.sessions:
        b, o, h = by[("batched", n)], by[("one_at_a_time", n)], by[("hf_batched", n)]
        total = len(b.token_ids)
        checked = [b, o] + ([by["batched_lean", n]] if lean else [])
        same = sum(all(r.token_ids[j] == references[j % len(references)] for r in checked) for j in range(total))
        busy = " (busy)" if max(r.other_load for r in checked + [h]) > 0.25 else ""
        lines.append(f"| {n}{busy} | {b.tokens_per_s:.1f} | {o.tokens_per_s:.1f} | {h.tokens_per_s:.1f} | "
                     f"{b.tokens_per_s / o.tokens_per_s:.2f}x | {b.tokens_per_s / h.tokens_per_s:.2f}x | "
                     f"{b.p50_ms:.0f} / {b.p95_ms:.0f} | {o.p50_ms:.0f} / {o.p95_ms:.0f} | "
                     f"{h.p50_ms:.0f} / {h.p95_ms:.0f} | {b.ttft_p50_ms:.0f} | {b.mean_tree:.1f} / {o.mean_tree:.1f} | "
                     f"{b.rows_per_forward:.1f} | {b.verifier_busy:.0%} | {b.prefill_share:.0%} / {o.prefill_share:.0%} | "
                     f"{same}/{total} | {b.prefix_tokens} / {o.prefix_tokens} |"
                     + (f" {each_repeat(results, n)} |" if repeats > 1 else "")
                     + (f" {by['batched_lean', n].tokens_per_s:.1f} | "
                        f"{b.tokens_per_s / by['batched_lean', n].tokens_per_s:.2f}x |" if lean else ""))
    lines += ["", "identical: batched and one-at-a-time tokens (and without CUDA graphs, where run) all equal to HF "
              "generate of that prompt alone. "
              "(busy): other processes kept more than a quarter core busy during a run (see other_load in the JSON). verifier busy: the batched verifier's forward time / wall time. prefill share: the prompt "
              "chunks' part of the verifier's forward time (each row's cost share of its forward). prompt tokens copied: "
              "the verifier copied their K/V from an earlier prompt of the same run that began the same way (every run "
              "starts with none kept; verifier_service/prefix.py)."]
    return "\n".join(lines) + "\n"


def each_repeat(results: list[Result], n: int) -> str:
    """'b/o, b/h' per repeat at concurrency n, e.g. '2.71, 1.90; 2.40, 1.85'."""
    run = {(r.method, r.repeat): r.tokens_per_s for r in results if r.sessions == n}
    repeats = sorted({r for _, r in run})
    return "; ".join(f"{run['batched', r] / run['one_at_a_time', r]:.2f}, {run['batched', r] / run['hf_batched', r]:.2f}"
                     for r in repeats)


def verifier_overrides(args) -> dict:
    """The VerifierConfig fields the command line set (both verifiers; one-at-a-time adds max_batch=1)."""
    overrides = {k: v for k, v in (("max_batch_tokens", args.max_batch_tokens), ("prefill_chunk", args.prefill_chunk))
                 if v}
    if args.hf_forward:
        overrides["lean_forward"] = False
    if args.cuda_graphs:
        overrides["cuda_graphs"] = True
    if args.prefix_cache_tokens is not None:
        overrides["prefix_cache_tokens"] = args.prefix_cache_tokens
    return overrides


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") and torch.cuda.is_available() else device
