"""Many sessions at once against one verifier: batched verification vs one request at a time vs plain
batched decoding with HF generate.

    python bench/concurrency.py [--sessions 1,2,4,8,16] [--max-new-tokens 64] [--threads 2] [--waves 1]

For each concurrency n, the first n prompts of bench/prompts.jsonl (interleaved across kinds) run at the
same time: n threads, each a specsplit.Client streaming from the services (verifier, n-gram draft,
orchestrator; real gRPC on loopback; the verifier in one child process, draft and orchestrator in
another, the clients in this one, as deployed), once with the batching verifier and once with
max_batch=1; and once as a single left-padded HF generate(do_sample=False) over the same n chat prompts
(in a third child process, so each process has one OpenMP team). Greedy, fp32, all on one machine: the
target (verifiers, HF generate) on --device (cpu by default; cuda on a GPU box), the edge side on its CPU.
The methods take turns, never overlap.

With --waves W, W groups of n prompts (cycling through the file) wait in one queue and each of the n
clients takes the next request as soon as its session ends, so n sessions stay in flight until the
queue runs dry and a finished session's place is taken at once, as on a serving system; HF runs the
same W groups as W batched generates, one after another (static batching, as a user of generate
would). One wave shows a single burst, where the slowest session sets the wall time; more waves show
sustained serving.

Aggregate tokens/s = all new tokens / wall time from the first request to the last token (prefill
included). Per-token latency = inter-token latency after the first token: a chunk of k tokens arriving
dt after the previous one gives each of its tokens dt / k (HF: each decoding step's duration).
Writes <out>/concurrency.json and <out>/concurrency.md (concurrency_waves<W>.* for W > 1).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see specsplit/__init__.py

import argparse
import json
import multiprocessing
import os
import pathlib
import queue
import sys
import threading
import time
from dataclasses import asdict

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

from concurrency_report import Result, Session, device_name, markdown, summarise, verifier_overrides  # noqa: E402
from run import chat_ids, load_prompts, machine_busy_s, wait_for_quiet  # noqa: E402
from specsplit.client import Client  # noqa: E402
from specsplit.config import VerifierConfig  # noqa: E402
from specsplit.launch import default_proposers  # noqa: E402
from specsplit.models import load_model, load_tokenizer  # noqa: E402

METHODS = ["batched", "one_at_a_time", "hf_batched"]
LEAN = "batched_lean"  # with --cuda-graphs: the batching verifier without them too, side by side in the same run


# -- specsplit ---------------------------------------------------------------------------------------
def one_client(address: str, requests: queue.SimpleQueue, max_new: int, start: threading.Barrier, out: list) -> None:
    """One of the n concurrent clients: takes the next (index, prompt) from the shared queue as soon as its
    last session ended, until the queue is empty; out[index] = that session."""
    with Client(address) as client:
        start.wait()
        while True:
            try:
                j, prompt = requests.get_nowait()
            except queue.Empty:
                break
            begin = last = time.perf_counter()
            tokens: list[int] = []
            latencies: list[float] = []
            ttft, rounds, drafted, decoded = 0.0, 0, 0, 0
            for chunk in client.generate(prompt, max_new_tokens=max_new, draft="ngram"):
                now = time.perf_counter()
                if chunk.stats is not None:
                    rounds += 1
                    drafted += chunk.stats.num_draft_tokens
                    decoded += chunk.stats.num_decoded
                if chunk.token_ids:
                    if not tokens:
                        ttft = now - begin
                    else:
                        latencies += [(now - last) / len(chunk.token_ids)] * len(chunk.token_ids)
                    tokens += chunk.token_ids
                    last = now
            out[j] = Session(tokens, ttft, latencies, rounds, drafted, last - begin, decoded)


class StackWorker:
    """The services in child processes, as they would be deployed: the verifiers (batching, and
    max_batch=1) in one process, the edge side (n-gram draft + orchestrator for each) in ``edge_procs``
    others (client i talks to edge process i % edge_procs: as many edge boxes, each its own interpreter)."""

    def __init__(self, threads: int, model_cpus: str = "", edge_cpus: str = "", device: str = "cpu",
                 dtype: str = "float32", edge_procs: int = 1, config: dict | None = None):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_verifier_main, args=(child, threads, model_cpus, device, dtype, config),
                                daemon=True)
        self.proc.start()
        verifiers = self.conn.recv()  # {"batched": address, "one_at_a_time": address}
        self.edges = []  # (process, pipe) per edge process
        for _ in range(edge_procs):
            conn, child = ctx.Pipe()
            edge = ctx.Process(target=_edge_main, args=(child, verifiers, edge_cpus), daemon=True)
            edge.start()
            self.edges.append((edge, conn))
        self.addresses = {}  # method -> orchestrator address per edge process
        for _, conn in self.edges:
            for method, address in conn.recv().items():
                self.addresses.setdefault(method, []).append(address)

    def stats(self, method: str) -> tuple:
        """The method's verifier's forwards, rows, all processes' CPU seconds, thinks, summed think ms,
        padded tokens, forward ms, ticks, prefill ms (the prompt chunks' share of the forward ms), prompt tokens
        copied from kept prompts, forwards replayed as CUDA graphs."""
        self.conn.send(method)
        for _, conn in self.edges:
            conn.send("cpu")
        stats = self.conn.recv()
        return stats[:2] + (stats[2] + sum(conn.recv() for _, conn in self.edges),) + stats[3:]

    def clear_prefixes(self) -> None:
        """The verifiers forget their kept prompts: every run reuses only what its own sessions share."""
        self.conn.send("clear")
        self.conn.recv()

    def close(self) -> None:
        for edge, conn in self.edges:
            conn.send(None)
            edge.join(timeout=30)
        self.conn.send(None)
        self.proc.join(timeout=30)


def pin(cpus: str) -> None:
    """Keep this process on the CPUs listed ("0", "0,1", "2-3"; "" = anywhere)."""
    if cpus:
        chosen = set()
        for part in cpus.split(","):
            lo, _, hi = part.partition("-")
            chosen.update(range(int(lo), int(hi or lo) + 1))
        os.sched_setaffinity(0, chosen)


def _verifier_main(conn, threads: int, cpus: str = "", device: str = "cpu", dtype: str = "float32",
                   config: dict | None = None) -> None:
    from specsplit.launch import start_verifier

    pin(cpus)
    torch.set_num_threads(threads)
    loaded = load_model(None, device, dtype)
    servers = {"batched": start_verifier(loaded, config=VerifierConfig(**(config or {}))),
               "one_at_a_time": start_verifier(loaded, config=VerifierConfig(**{**(config or {}), "max_batch": 1}))}
    if (config or {}).get("cuda_graphs"):
        servers[LEAN] = start_verifier(loaded, config=VerifierConfig(**{**config, "cuda_graphs": False}))
    conn.send({name: server.address for name, server in servers.items()})
    while (method := conn.recv()) is not None:
        if method == "clear":  # a run starts with no kept prompts (none from the warm-up or an earlier run)
            for server in servers.values():
                server.core.clear_prefixes()
            conn.send(True)
            continue
        stats = servers[method].core.stats
        conn.send((stats.forwards, stats.rows, sum(os.times()[:2]), stats.thinks, stats.think_ms, stats.tokens,
                   stats.forward_ms, stats.ticks, stats.prefill_ms, stats.prefix_tokens, stats.graphed))
    for server in servers.values():
        server.stop(1.0)
        server.core.close()


def _edge_main(conn, verifiers: dict[str, str], cpus: str = "") -> None:
    from specsplit.launch import start_draft, start_orchestrator

    pin(cpus)
    tokenizer = load_tokenizer(None)
    servers = []
    addresses = {}
    for method, verifier in verifiers.items():
        draft = start_draft(default_proposers("ngram", None, "cpu", "float32")[0])
        orchestrator = start_orchestrator(verifier, [draft.address], tokenizer)
        servers += [orchestrator, draft]
        addresses[method] = orchestrator.address
    conn.send(addresses)
    while conn.recv() is not None:
        conn.send(sum(os.times()[:2]))
    for server in servers:
        server.stop(1.0)


def waves_of(prompts: list, n: int, waves: int) -> list[list]:
    """Wave w is prompts[w*n : (w+1)*n] (cycling through the list); the clients take requests wave by wave."""
    return [[prompts[(w * n + i) % len(prompts)] for i in range(n)] for w in range(waves)]


def run_specsplit(method: str, stacks: StackWorker, waves: list[list[dict]], max_new: int) -> Result:
    n = len(waves[0])
    stacks.clear_prefixes()
    forwards, rows, stack_cpu, thinks, think_ms, _, forward_ms, _, prefill_ms, prefix, graphed = stacks.stats(method)
    requests: queue.SimpleQueue = queue.SimpleQueue()  # wave by wave: request j = w * n + i
    for j, request in enumerate(r for wave in waves for r in wave):
        requests.put((j, request["prompt"]))
    out: list = [None] * (n * len(waves))
    start = threading.Barrier(n + 1)
    addresses = stacks.addresses[method]
    threads = [threading.Thread(target=one_client, args=(addresses[i % len(addresses)], requests, max_new, start, out))
               for i in range(n)]
    for t in threads:
        t.start()
    busy, cpu = machine_busy_s(), sum(os.times()[:2])
    start.wait()
    begin = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - begin
    forwards_after, rows_after, stack_cpu_after, thinks_after, think_ms_after, _, forward_ms_after, _, prefill_ms_after, \
        prefix_after, graphed_after = stacks.stats(method)
    own = sum(os.times()[:2]) - cpu + stack_cpu_after - stack_cpu
    other = max(0.0, machine_busy_s() - busy - own) / wall
    rows_per_forward = (rows_after - rows) / max(forwards_after - forwards, 1)
    sessions = out  # wave by wave
    rounds = sum(s.rounds for s in sessions)
    result = summarise(method, n, sessions, wall, other, sum(s.draft_tokens for s in sessions) / rounds,
                       sum(len(s.token_ids) for s in sessions) / rounds, rows_per_forward)
    result.think_ms = round((think_ms_after - think_ms) / max(thinks_after - thinks, 1), 1)
    result.verifier_busy = round((forward_ms_after - forward_ms) / 1e3 / wall, 2)
    result.prefill_share = round((prefill_ms_after - prefill_ms) / max(forward_ms_after - forward_ms, 1e-9), 2)
    result.prefix_tokens = prefix_after - prefix
    result.graphed_share = round((graphed_after - graphed) / max(forwards_after - forwards, 1), 2)
    return result


# -- HF generate, batched with left padding (in a child process) -------------------------------------
class StepClock(StoppingCriteria):
    """A stopping criterion that only records when each decoding step finished."""

    def __init__(self):
        super().__init__()
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def hf_batched(loaded, batch_ids: list[list[int]], max_new: int) -> tuple[list[list[int]], list[float], float]:
    """Token ids per row (to EOS inclusive), step end times, start time."""
    tok = loaded.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(map(len, batch_ids))
    device = loaded.model.device
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch_ids], device=device)  # [n, width] left-padded
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch_ids], device=device)  # [n, width]
    clock = StepClock()
    with torch.inference_mode():
        begin = time.perf_counter()
        out = loaded.model.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                                    pad_token_id=pad, stopping_criteria=StoppingCriteriaList([clock]))
    eos = set(loaded.model.generation_config.eos_token_id if isinstance(
        loaded.model.generation_config.eos_token_id, list) else [loaded.model.generation_config.eos_token_id])
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows, clock.times, begin


def _hf_worker_main(conn, threads: int, cpus: str = "", device: str = "cpu", dtype: str = "float32") -> None:
    pin(cpus)
    torch.set_num_threads(threads)
    loaded = load_model(None, device, dtype)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        busy, cpu = machine_busy_s(), sum(os.times()[:2])
        rows, times, begin = hf_batched(loaded, *msg)
        wall = time.perf_counter() - begin
        other = max(0.0, machine_busy_s() - busy - (sum(os.times()[:2]) - cpu)) / wall
        conn.send((rows, times, begin, other))


def run_hf(conn, waves: list[list[list[int]]], max_new: int) -> Result:
    """One left-padded generate per wave, back to back (static batching: a wave waits for its longest row)."""
    out, wall, others = [], 0.0, []
    for ids in waves:
        conn.send((ids, max_new))
        rows, times, begin, other = conn.recv()
        for row in rows:
            steps = times[:len(row)]
            latencies = [b - a for a, b in zip(steps, steps[1:])]
            out.append(Session(row, steps[0] - begin if steps else 0.0, latencies, seconds=steps[-1] - begin if steps else 0.0))
        wall += (times[-1] if times else begin) - begin  # the wave's generate ends with its last step
        others.append(other)
    return summarise("hf_batched", len(waves[0]), out, wall, max(others), 0.0, 1.0, float(len(waves[0])))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sessions", default="1,2,4,8,16", help="concurrency levels")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--waves", type=int, default=1,
                        help="sessions each client runs back to back (1: n sessions at once and done; more: a new "
                             "session replaces each finished one, as in serving)")
    parser.add_argument("--model-cpus", default="",
                        help="CPUs of the processes that run the target (the verifiers, HF generate), e.g. 0; '' = "
                             "anywhere. With --edge-cpus, the edge side (clients, orchestrator, draft) cannot slow the "
                             "verifier's forwards, as on separate machines")
    parser.add_argument("--edge-cpus", default="", help="CPUs of the clients, orchestrator and draft, e.g. 1")
    parser.add_argument("--device", default="cpu",
                        help="where the target runs (the verifiers and HF generate): cpu, cuda, cuda:1; the edge side "
                             "(clients, orchestrator, n-gram draft) stays on the CPU")
    parser.add_argument("--dtype", default="float32", help="the target's dtype (float32 is what the greedy references use)")
    parser.add_argument("--edge-procs", type=int, default=1,
                        help="edge processes (each an n-gram draft + orchestrator per method); client i uses process "
                             "i %% N. More than 1 keeps one Python interpreter's lock from pacing every session's round")
    parser.add_argument("--max-batch-tokens", type=int, default=0,
                        help="the verifiers' VerifierConfig.max_batch_tokens (0: its default)")
    parser.add_argument("--prefill-chunk", type=int, default=0,
                        help="the verifiers' VerifierConfig.prefill_chunk (0: its default)")
    parser.add_argument("--prefix-cache-tokens", type=int, default=None,
                        help="the verifiers' VerifierConfig.prefix_cache_tokens (0: no prompt reuse; default: its default)")
    parser.add_argument("--hf-forward", action="store_true",
                        help="the verifiers run the model's own forward, not the lean one (VerifierConfig.lean_forward)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="the verifiers replay verification ticks as CUDA graphs (VerifierConfig.cuda_graphs); a "
                             "batching verifier without them runs too, its tok/s in the table's last columns")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every method this many times per concurrency, taking turns, and report each method's "
                             "median run: the machine's speed drifts by 10-20%% between minutes")
    parser.add_argument("--prompts", type=pathlib.Path, default=HERE / "prompts.jsonl")
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    parser.add_argument("--wait-idle", type=float, default=20.0,
                        help="before each run, wait up to this many seconds for other processes to go quiet")
    args = parser.parse_args(argv)
    args.sessions = [int(s) for s in args.sessions.split(",")]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, None, None)
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    pin(args.edge_cpus)  # the clients
    worker = ctx.Process(target=_hf_worker_main, args=(child, args.threads, args.model_cpus, args.device, args.dtype),
                         daemon=True)
    worker.start()
    conn.recv()
    tokenizer = load_tokenizer(None)
    ids = [chat_ids(tokenizer, p["prompt"]) for p in prompts[:max(args.sessions) * args.waves]]
    references = [run_hf(conn, [[i]], args.max_new_tokens).token_ids[0] for i in ids]  # each prompt alone
    print(f"references done; prompt tokens {[len(i) for i in ids]}", file=sys.stderr, flush=True)
    results: list[Result] = []
    stacks = StackWorker(args.threads, args.model_cpus, args.edge_cpus, args.device, args.dtype, args.edge_procs,
                         verifier_overrides(args))
    methods = METHODS + ([LEAN] if args.cuda_graphs else [])
    for method in methods:  # warm-up (with CUDA graphs: every prompt of the largest run, so the KV store has grown
        # to its length and the graphs of most shapes are captured, as in a server that has been up a while)
        if method != "hf_batched":
            run_specsplit(method, stacks, [prompts[:max(args.sessions) if args.cuda_graphs else 2]],
                          args.max_new_tokens // 2 if args.cuda_graphs else 8)
    for n, repeat, method in ((n, r, m) for n in args.sessions for r in range(args.repeats) for m in methods):
        time.sleep(1.0)  # let the previous method's OpenMP team go idle
        wait_for_quiet(args.wait_idle)
        if method == "hf_batched":
            result = run_hf(conn, waves_of(ids, n, args.waves), args.max_new_tokens)
        else:
            result = run_specsplit(method, stacks, waves_of(prompts, n, args.waves), args.max_new_tokens)
        result.repeat = repeat
        results.append(result)
        print(f"n={n} #{repeat} {method}: {result.tokens_per_s:.1f} tok/s, p50 {result.p50_ms:.0f} ms, "
              f"p95 {result.p95_ms:.0f} ms, tree {result.mean_tree:.1f}, rows/fwd "
              f"{result.rows_per_forward:.1f}, think {result.think_ms:.0f} ms, verifier busy {result.verifier_busy:.0%} "
              f"(prefill {result.prefill_share:.0%}, {result.prefix_tokens} prompt tokens copied, graphed "
              f"{result.graphed_share:.0%}), other load "
              f"{result.other_load:.2f}", file=sys.stderr, flush=True)
    stacks.close()
    conn.send(None)
    worker.join(timeout=30)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"cpus": os.cpu_count(), "model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "device": args.device,
            "device_name": device_name(args.device), "threads": args.threads,
            "max_new_tokens": args.max_new_tokens, "waves": args.waves, "repeats": args.repeats, "model_cpus": args.model_cpus,
            "edge_cpus": args.edge_cpus, "torch": torch.__version__, "prompts": str(args.prompts),
            "edge_procs": args.edge_procs, "verifier": asdict(VerifierConfig(**verifier_overrides(args))),
            "prompt_tokens": [len(i) for i in ids]}
    name = ("concurrency" + (f"_{args.device.split(':')[0]}" if args.device != "cpu" else "")
            + (f"_waves{args.waves}" if args.waves > 1 else "") + ("_split" if args.model_cpus else ""))
    (args.out / f"{name}.json").write_text(json.dumps(
        {"meta": meta, "references": references, "results": [asdict(r) for r in results]}, indent=1))
    table = markdown(results, references, args)
    (args.out / f"{name}.md").write_text("# Concurrent sessions: batched verification\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
