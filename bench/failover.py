"""Failover and KV-restore timings on the default target (SmolLM2-135M-Instruct, fp32, CPU).

    python bench/failover.py [--context 1000] [--repeats 3] [--threads 1] [--out bench/results]

1. restore: a session holding CONTEXT committed tokens on a verifier (this process, real gRPC, a private
   redis-server): re-prefill vs. the orchestrator's restore path (Redis GET of an offloaded blob +
   ImportSession), for fp32 and fp16 blobs; the one-time offload cost (ExportSession + Redis SET); and
   whether a restored session continues token-identically.
2. failover: two `specsplit serve verifier` processes and an orchestrator process; a client generates
   (target-only, so every round is one token), and the replica holding the session is killed with
   SIGKILL. Failover time = from the kill to the next token the client receives (prefill of the
   committed tokens on the other replica + one verify), for a short and a CONTEXT-token session.
Writes <out>/failover.json and prints a markdown table.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see specsplit/__init__.py

import argparse
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

from specsplit.client import Client  # noqa: E402
from specsplit.models import load_model, load_tokenizer  # noqa: E402
from specsplit.rpc import RemoteVerifier  # noqa: E402
from specsplit.store import RedisStore  # noqa: E402
from specsplit.tree import TokenTree  # noqa: E402

TEXT = (HERE / "prompts.jsonl").read_text()


def context_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    store = RedisStore(url, retry_s=10)
    store.ping()
    return proc, url


def greedy_steps(verifier: RemoteVerifier, session_id: str, length: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        verdict, _ = verifier.verify(session_id, TokenTree.empty(), length + len(out), 0, timeout=60)
        out.extend(verdict.committed_token_ids)
    return out


def bench_restore(context: int, repeats: int) -> dict:
    from specsplit.launch import start_verifier

    loaded = load_model(None, "cpu", "float32")
    ids = context_ids(loaded.tokenizer, context)
    server = start_verifier(loaded)
    verifier = RemoteVerifier(server.address)
    redis_proc, url = start_redis()
    store = RedisStore(url)
    result: dict = {"context_tokens": context}
    try:
        verifier.prefill("warmup", ids[:64], timeout=60)
        verifier.release("warmup", timeout=5)
        prefill_ms = []
        for r in range(repeats):
            start = time.perf_counter()
            verifier.prefill(f"p{r}", ids, timeout=300)
            prefill_ms.append((time.perf_counter() - start) * 1e3)
        result["prefill_ms"] = statistics.median(prefill_ms)
        reference = greedy_steps(verifier, "p1", len(ids), 16)  # how a prefilled session continues
        for dtype in ("", "float16"):
            name = dtype or "float32"
            offload_ms, restore_ms = [], []
            for r in range(repeats):
                start = time.perf_counter()
                blob = verifier.export_session("p0", len(ids), timeout=60, dtype=dtype)
                store.put_kv(f"kv-{name}", len(ids), blob)
                offload_ms.append((time.perf_counter() - start) * 1e3)
                start = time.perf_counter()
                _, fetched = store.get_kv(f"kv-{name}")
                verifier.import_session(f"i{name}{r}", ids, fetched, timeout=300)
                restore_ms.append((time.perf_counter() - start) * 1e3)
            continued = greedy_steps(verifier, f"i{name}0", len(ids), 16)
            result[name] = {"blob_mb": len(blob) / 2**20, "offload_ms": statistics.median(offload_ms),
                            "restore_ms": statistics.median(restore_ms), "identical_next_16": continued == reference}
    finally:
        server.stop(0)
        server.core.close()  # the verifier's model thread
        redis_proc.terminate()
        redis_proc.wait()
    return result


class Service:
    def __init__(self, service: str, *args: str, threads: int):
        env = dict(os.environ, HF_HUB_OFFLINE="1", SPECSPLIT_THREADS=str(threads))
        self.proc = subprocess.Popen([sys.executable, "-m", "specsplit.cli", "serve", service, "--listen",
                                      "127.0.0.1:0", *args], stderr=subprocess.PIPE, text=True, env=env)

    def address(self) -> str:
        line = self.proc.stderr.readline()
        if "serving on" not in line:
            raise RuntimeError(line + self.proc.stderr.read())
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()
        return line.rsplit(" ", 1)[1].strip()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def one_failover(orch: str, verifiers: list[str], prompt_ids: list[int]) -> tuple[float, float, int]:
    """Generate, kill -9 the replica holding the session; (ms kill -> next token, ms per token before, killed)."""
    infos = [RemoteVerifier(a) for a in verifiers]
    arrivals, killed_at, holder = [], None, None
    gap_after_kill = None
    with Client(orch) as client:
        for chunk in client.generate(prompt_token_ids=prompt_ids, max_new_tokens=40, draft="none"):
            now = time.perf_counter()
            if not chunk.token_ids:
                continue
            arrivals.append(now)
            if killed_at is None and len(arrivals) == 12:
                holder = next(i for i, v in enumerate(infos) if v.info(timeout=5).num_sessions)
                killed_at = time.perf_counter()
                SERVICES[holder].kill()
            elif killed_at is not None and gap_after_kill is None and now - killed_at > 0.005:
                gap_after_kill = (now - killed_at) * 1e3  # (a token already in flight at the kill is skipped)
    per_token = statistics.median(b - a for a, b in zip(arrivals[2:11], arrivals[3:12])) * 1e3
    return gap_after_kill, per_token, holder


SERVICES: list[Service] = []


def bench_failover(context: int, repeats: int, threads: int) -> list[dict]:
    SERVICES[:] = [Service("verifier", threads=threads), Service("verifier", threads=threads)]
    verifiers = [s.address() for s in SERVICES]
    orch = Service("orchestrator", "--verifiers", ",".join(verifiers), threads=1)
    orch_address = orch.address()
    tokenizer = load_tokenizer(None)
    rows = []
    try:
        for length in (64, context):
            ids = context_ids(tokenizer, length)
            times, per_token = [], []
            for _ in range(repeats):
                ms, tok_ms, killed = one_failover(orch_address, verifiers, ids)
                times.append(ms)
                per_token.append(tok_ms)
                SERVICES[killed] = Service("verifier", "--listen", verifiers[killed], threads=threads)
                SERVICES[killed].address()
                time.sleep(1.5)  # the orchestrator's health check sees it back
            rows.append({"prompt_tokens": length, "failover_ms": statistics.median(times), "all_ms": times,
                         "ms_per_token_before": statistics.median(per_token)})
    finally:
        for service in [*SERVICES, orch]:
            service.kill()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per verifier")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    restore = bench_restore(args.context, args.repeats)
    failover = bench_failover(args.context, args.repeats, args.threads)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "failover.json").write_text(json.dumps({"restore": restore, "failover": failover}, indent=2))
    n = restore["context_tokens"]
    print(f"\nKV restore vs re-prefill, {n}-token SmolLM2-135M session (CPU fp32, {args.threads} thread(s)):\n")
    print("| path | ms | blob MiB | continues token-identically |\n|---|---|---|---|")
    print(f"| re-prefill | {restore['prefill_ms']:.0f} | - | yes |")
    for name in ("float32", "float16"):
        r = restore[name]
        print(f"| restore {name} (Redis GET + ImportSession) | {r['restore_ms']:.0f} | {r['blob_mb']:.1f} | "
              f"{'yes' if r['identical_next_16'] else 'no'} |")
        print(f"| offload {name} (ExportSession + Redis SET, once) | {r['offload_ms']:.0f} | | |")
    print("\nFailover (kill -9 of the replica holding the session -> next token at the client):\n")
    print("| committed tokens | failover ms (median) | all runs | ms per token before |\n|---|---|---|---|")
    for row in failover:
        print(f"| ~{row['prompt_tokens'] + 12} | {row['failover_ms']:.0f} | "
              f"{', '.join(f'{t:.0f}' for t in row['all_ms'])} | {row['ms_per_token_before']:.0f} |")


if __name__ == "__main__":
    main()
