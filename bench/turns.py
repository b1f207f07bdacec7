#!/usr/bin/env python
"""A conversation's turns through the real stack: what reusing the earlier turns' K/V gives.

A chat client sends the whole conversation again with each new message, so turn k's prompt is turn k-1's prompt,
its answer and a new message. The verifier keeps prompts' and ended sessions' K/V (``verifier_service/prefix.py``,
``--prefix-cache-tokens``) and a model draft starts a session that continues the latest ended one from its cache
(``--no-cache-reuse`` turns that off), so each turn computes only its new tokens instead of the whole conversation.

Three arms, taking turns (``--repeats`` times each): ``reuse`` (the defaults), ``off`` (the verifier's prefix
cache at 0 tokens, the draft started with --no-cache-reuse) and ``verifier`` (the verifier's reuse only: what the
draft's own prefill then costs), each with a fresh stack (verifier and
orchestrator in this process, a half draft in its own process, as ``specsplit generate`` runs them). Per turn:
prompt tokens, time to the first generated tokens (TTFT, at the client), the whole turn's time and the prompt
tokens the verifier copied instead of computing. Greedy; every turn's tokens are checked against HF greedy of that
turn's prompt, computed after the timed runs.

    python bench/turns.py                                    # 2 conversations x 4 turns, half+ngram, 2 repeats
    python bench/turns.py --draft ngram --turns 3 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

from run import hf_generate, load_prompts  # noqa: E402 (bench/run.py)
from specsplit.client import Client  # noqa: E402
from specsplit.config import VerifierConfig  # noqa: E402
from specsplit.launch import DraftProcess, default_proposers, start_stack  # noqa: E402
from specsplit.models import load_model  # noqa: E402

FOLLOW_UPS = ["Tell me more about the second point.", "Summarize your answers so far in two sentences.",
              "Give one concrete example.", "What would you advise a beginner?"]
ARMS = ("off", "verifier", "reuse")


@dataclass
class Turn:
    arm: str
    repeat: int
    conversation: str
    turn: int
    prompt_tokens: int
    new_tokens: int
    ttft_ms: float
    seconds: float
    copied: int  # prompt tokens the verifier copied from kept K/V
    prompt_ids: list[int]
    token_ids: list[int]
    identical: bool | None = None


def run_arm(arm: str, repeat: int, target, conversations: list[dict], args) -> list[Turn]:
    config = VerifierConfig(prefix_cache_tokens=0 if arm == "off" else VerifierConfig.prefix_cache_tokens)
    processes, proposers = [], []
    if args.draft.startswith("half"):
        flags = ["--draft", args.draft, "--threads", "1"] + ([] if arm == "reuse" else ["--no-cache-reuse"])
        processes = [DraftProcess(flags + (["--draft-dtype", args.draft_dtype] if args.draft_dtype else []))]
    else:
        proposers = default_proposers(args.draft, None, "cpu", "float32")
    turns: list[Turn] = []
    with start_stack(target, proposers, verifier_config=config, processes=processes) as stack, \
            Client(stack.address) as client:
        engine = stack.verifier_engine
        list(client.generate("Hi.", max_new_tokens=4, draft=args.draft))  # warm-up (its system turn stays kept)
        for conversation in conversations:
            messages = []
            for k in range(args.turns):
                messages.append({"role": "user", "content": conversation["prompt"] if k == 0 else FOLLOW_UPS[k - 1]})
                copied = engine.stats.prefix_tokens
                tokens, prompt_ids, first = [], [], None
                start = time.perf_counter()
                for chunk in client.generate(messages=messages, max_new_tokens=args.max_new_tokens, draft=args.draft):
                    prompt_ids = prompt_ids or list(chunk.prompt_token_ids)
                    if chunk.token_ids and first is None:
                        first = time.perf_counter() - start
                    tokens += chunk.token_ids
                seconds = time.perf_counter() - start
                text = target.tokenizer.decode(tokens, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": text})
                turns.append(Turn(arm, repeat, conversation["id"], k + 1, len(prompt_ids), len(tokens),
                                  round((first or seconds) * 1e3, 1), round(seconds, 3),
                                  engine.stats.prefix_tokens - copied, prompt_ids, tokens))
                t = turns[-1]
                print(f"{arm:5} #{repeat} {t.conversation} turn {t.turn}: prompt {t.prompt_tokens} tokens, TTFT "
                      f"{t.ttft_ms:.0f} ms, {t.new_tokens} tokens in {t.seconds:.2f} s, {t.copied} prompt tokens "
                      f"copied", file=sys.stderr, flush=True)
    return turns


def markdown(turns: list[Turn], args) -> str:
    lines = [f"SmolLM2-135M-Instruct, float32, CPU, draft {args.draft}, greedy, max_new_tokens={args.max_new_tokens}, "
             f"{args.turns} turns per conversation (turn 1 a bench prompt, then: "
             f"{'; '.join(FOLLOW_UPS[:args.turns - 1])}), {args.repeats} repeat(s) per arm taking turns; "
             "medians over the repeats.", "",
             "| conversation | turn | prompt tokens | TTFT ms: off / verifier / reuse | TTFT off / reuse | "
             "turn s: off / verifier / reuse | prompt tokens copied (reuse) | identical to HF greedy |",
             "|---|--:|--:|--:|--:|--:|--:|---|"]
    keys = sorted({(t.conversation, t.turn) for t in turns}, key=lambda k: ([t.conversation for t in turns].index(k[0]),
                                                                            k[1]))
    for conversation, k in keys:
        by = {arm: [t for t in turns if t.arm == arm and t.conversation == conversation and t.turn == k]
              for arm in ARMS}
        ttft = {arm: statistics.median(t.ttft_ms for t in by[arm]) for arm in ARMS}
        secs = {arm: statistics.median(t.seconds for t in by[arm]) for arm in ARMS}
        same = all(t.identical for arm in ARMS for t in by[arm])
        lines.append(f"| {conversation} | {k} | {by['reuse'][0].prompt_tokens} | "
                     f"{' / '.join(f'{ttft[arm]:.0f}' for arm in ARMS)} | {ttft['off'] / ttft['reuse']:.2f}x | "
                     f"{' / '.join(f'{secs[arm]:.2f}' for arm in ARMS)} | "
                     f"{statistics.median(t.copied for t in by['reuse']):.0f} | {'yes' if same else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", default="chat_guitar,chat_rain",
                        help="bench prompt ids that open the conversations (default %(default)s)")
    parser.add_argument("--turns", type=int, default=4, help=f"turns per conversation (at most {len(FOLLOW_UPS) + 1})")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draft", default="half+ngram", help="the drafter (default %(default)s; ngram: no model draft)")
    parser.add_argument("--draft-dtype", default="", help="half: the draft's step dtype (default: calibrated at start)")
    parser.add_argument("--threads", type=int, default=1, help="the verifier's torch threads (default 1)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results" / "turns")
    args = parser.parse_args(argv)
    if not 1 <= args.turns <= len(FOLLOW_UPS) + 1:
        parser.error(f"--turns must be 1..{len(FOLLOW_UPS) + 1}")
    torch.set_num_threads(args.threads)
    target = load_model(None, "cpu", "float32")
    wanted = args.conversations.split(",")
    by_id = {p["id"]: p for p in load_prompts(HERE / "prompts.jsonl", None, None)}
    missing = [c for c in wanted if c not in by_id]
    if missing:
        parser.error(f"unknown prompt id(s) {', '.join(missing)}; see bench/prompts.jsonl")
    conversations = [by_id[c] for c in wanted]
    turns: list[Turn] = []
    for repeat in range(args.repeats):
        for arm in (ARMS if repeat % 2 == 0 else ARMS[::-1]):  # taking turns
            turns += run_arm(arm, repeat, target, conversations, args)
    references: dict[tuple, list[int]] = {}
    for t in turns:  # HF greedy of each turn's prompt, the target alone
        key = tuple(t.prompt_ids)
        if key not in references:
            references[key] = hf_generate(target, t.prompt_ids, args.max_new_tokens).token_ids
        t.identical = t.token_ids == references[key][:len(t.token_ids)] and \
            (len(t.token_ids) == args.max_new_tokens or len(t.token_ids) == len(references[key]))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"draft": args.draft, "max_new_tokens": args.max_new_tokens, "turns": args.turns, "repeats": args.repeats,
            "threads": args.threads, "torch": torch.__version__, "cpus": os.cpu_count(),
            "prefix_cache_tokens": VerifierConfig.prefix_cache_tokens}
    (args.out / "turns.json").write_text(json.dumps({"meta": meta, "turns": [asdict(t) for t in turns]}, indent=1))
    table = markdown(turns, args)
    (args.out / "turns.md").write_text("# A conversation's turns: reusing the earlier turns' K/V\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
