#!/usr/bin/env python
"""A burst of sessions under one long system turn: what sharing its K/V between prompts in flight gives.

An application sends the same instructions (a system turn of a few hundred tokens) ahead of every user's message,
and sessions often arrive together. The verifier copies a prompt's start that another prompt shares instead of
computing it (``verifier_service/prefix.py``): from prompts kept after their prefill, and from a prompt still being
prefilled, whose chunks the others wait for. In a burst no prompt is done when the others arrive, so the second
way is the one that counts.

Two arms, taking turns (``--repeats`` times each), each a fresh stack (verifier and orchestrator in this process,
the n-gram draft, real gRPC on loopback): ``shared`` (the defaults) and ``off`` (``--prefix-cache-tokens 0``: every
prompt computed whole). n clients each start one session at once (the same system turn, a different bench prompt
as the user's message). Per session: prompt tokens, time to the first generated tokens at the client (TTFT), the
prompt tokens the verifier copied; per burst: the time until every session had its first tokens and until all were
done. Greedy; every session's tokens are checked against HF greedy of its prompt.

    python bench/burst.py                          # 8 sessions, 32 new tokens each, 2 repeats
    python bench/burst.py --sessions 4 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

from run import hf_generate, load_prompts  # noqa: E402 (bench/run.py)
from specsplit.client import Client  # noqa: E402
from specsplit.config import VerifierConfig  # noqa: E402
from specsplit.launch import default_proposers, start_stack  # noqa: E402
from specsplit.models import load_model  # noqa: E402

SYSTEM = (  # an application's instructions, sent ahead of every user's message
    "You are Juniper, the writing and study assistant of the Larkspur Community Library. You help visitors of every "
    "age with questions about books, research, homework, writing and everyday topics. Follow these rules in every "
    "answer. Be friendly, patient and clear; prefer short paragraphs and plain words over jargon. When a question is "
    "ambiguous, answer the most likely reading and say in one sentence what you assumed. When you explain a fact, "
    "give one concrete example. When you summarize, keep the main point first and the details after it, and never "
    "add claims that are not in the text you were given. When you edit code or prose, change only what was asked "
    "and keep the author's names, style and formatting. Do not give medical, legal or financial advice; suggest a "
    "qualified professional instead, and for urgent danger tell the visitor to call the emergency number. Do not "
    "ask for or repeat personal information such as addresses, phone numbers or library card numbers. If you do "
    "not know something, say so and suggest where in the library or its online catalogue the visitor could look. "
    "The library is open Monday to Saturday from nine in the morning to eight in the evening, and on Sunday from "
    "noon to five; study rooms can be booked at the front desk for up to two hours a day. Keep answers under two "
    "hundred words unless the visitor asks for more."
)
ARMS = ("off", "shared")


@dataclass
class Session:
    arm: str
    repeat: int
    prompt: str
    prompt_tokens: int
    new_tokens: int
    ttft_ms: float
    seconds: float
    prompt_ids: list[int]
    token_ids: list[int]
    identical: bool | None = None


def run_arm(arm: str, repeat: int, target, prompts: list[dict], args) -> tuple[list[Session], dict]:
    config = VerifierConfig(prefix_cache_tokens=0 if arm == "off" else VerifierConfig.prefix_cache_tokens)
    with start_stack(target, default_proposers("ngram", None, "cpu", "float32"), verifier_config=config) as stack:
        engine = stack.verifier_engine
        with Client(stack.address) as client:
            list(client.generate("Hi.", max_new_tokens=4))  # warm-up (shares only the template's first tokens)
        engine.clear_prefixes()
        gate = threading.Barrier(len(prompts) + 1)

        def one(p: dict) -> Session:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p["prompt"]}]
            tokens, prompt_ids, first = [], [], None
            with Client(stack.address) as client:
                gate.wait()
                start = time.perf_counter()
                for chunk in client.generate(messages=messages, max_new_tokens=args.max_new_tokens):
                    prompt_ids = prompt_ids or list(chunk.prompt_token_ids)
                    if chunk.token_ids and first is None:
                        first = time.perf_counter() - start
                    tokens += chunk.token_ids
                seconds = time.perf_counter() - start
            return Session(arm, repeat, p["id"], len(prompt_ids), len(tokens), round((first or seconds) * 1e3, 1),
                           round(seconds, 3), prompt_ids, tokens)

        copied, computed_before = engine.stats.prefix_tokens, engine.stats.prefill_ms
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(one, p) for p in prompts]
            gate.wait()
            start = time.perf_counter()
            sessions = [f.result() for f in futures]
            wall = time.perf_counter() - start
        burst = {"arm": arm, "repeat": repeat, "wall_s": round(wall, 3),
                 "all_first_tokens_ms": max(s.ttft_ms for s in sessions),
                 "ttft_p50_ms": statistics.median(s.ttft_ms for s in sessions),
                 "copied": engine.stats.prefix_tokens - copied,
                 "prefill_ms": round(engine.stats.prefill_ms - computed_before, 1)}
    print(f"{arm:6} #{repeat}: TTFT p50 {burst['ttft_p50_ms']:.0f} ms, all first tokens {burst['all_first_tokens_ms']:.0f}"
          f" ms, burst {wall:.2f} s, {burst['copied']} prompt tokens copied, prefill forwards "
          f"{burst['prefill_ms'] / 1e3:.2f} s", file=sys.stderr, flush=True)
    return sessions, burst


def markdown(bursts: list[dict], sessions: list[Session], args) -> str:
    def med(arm: str, key: str) -> float:
        return statistics.median(b[key] for b in bursts if b["arm"] == arm)

    lines = [f"SmolLM2-135M-Instruct, float32, CPU, {args.threads} thread(s), n-gram draft, greedy, "
             f"{len(args.prompt_ids)} sessions starting at once, each the same system turn ({args.system_tokens} "
             f"prompt tokens with the template) and a different bench prompt, max_new_tokens={args.max_new_tokens}, "
             f"{args.repeats} repeat(s) per arm taking turns; medians over the repeats.", "",
             "| arm | TTFT p50 ms | all first tokens ms | burst s | prompt tokens copied | prefill forwards s |",
             "|---|--:|--:|--:|--:|--:|"]
    for arm in ARMS:
        lines.append(f"| {arm} | {med(arm, 'ttft_p50_ms'):.0f} | {med(arm, 'all_first_tokens_ms'):.0f} | "
                     f"{med(arm, 'wall_s'):.2f} | {med(arm, 'copied'):.0f} | {med(arm, 'prefill_ms') / 1e3:.2f} |")
    same = all(s.identical for s in sessions)
    lines += ["", f"Prompt tokens per session: {', '.join(str(s.prompt_tokens) for s in sessions[:len(args.prompt_ids)])}."
              f" Every session identical to HF greedy of its prompt: {'yes' if same else 'NO'}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=8, help="sessions starting at once (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="the verifier's torch threads (default 1)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results" / "burst")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_model(None, "cpu", "float32")
    prompts = load_prompts(HERE / "prompts.jsonl", None, args.sessions)
    if len(prompts) < args.sessions:
        parser.error(f"bench/prompts.jsonl has {len(prompts)} prompts")
    args.prompt_ids = [p["id"] for p in prompts]
    sessions: list[Session] = []
    bursts: list[dict] = []
    for repeat in range(args.repeats):
        for arm in (ARMS if repeat % 2 == 0 else ARMS[::-1]):  # taking turns
            got, burst = run_arm(arm, repeat, target, prompts, args)
            sessions += got
            bursts.append(burst)
    references: dict[tuple, list[int]] = {}
    for s in sessions:  # HF greedy of each prompt, the target alone
        key = tuple(s.prompt_ids)
        if key not in references:
            references[key] = hf_generate(target, s.prompt_ids, args.max_new_tokens).token_ids
        s.identical = s.token_ids == references[key]
    system = target.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}])
    args.system_tokens = len(system["input_ids"] if hasattr(system, "keys") else system)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"sessions": args.sessions, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
            "threads": args.threads, "torch": torch.__version__, "cpus": os.cpu_count(), "system_tokens":
            args.system_tokens, "prefix_cache_tokens": VerifierConfig.prefix_cache_tokens}
    (args.out / "burst.json").write_text(json.dumps({"meta": meta, "bursts": bursts,
                                                     "sessions": [asdict(s) for s in sessions]}, indent=1))
    table = markdown(bursts, sessions, args)
    (args.out / "burst.md").write_text("# A burst of sessions under one long system turn\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
