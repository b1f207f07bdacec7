"""Sampled decoding: specsplit's coupled draws and rejection sampling, side by side, against HF sampling.

    python bench/sampling.py [--temperatures 0.7,1.0] [--max-new-tokens 96] [--limit 6] [--draft half+ngram]

Per prompt and temperature (top-k off, top-p 1, seed = the prompt's index), on the same target, machine and prompt
set as bench/run.py (HF in a child process, the stack in this one; a half draft in a process of its own on these
cores, as ``specsplit generate`` runs it):

- ``hf_sampling``: HF ``generate(do_sample=True)`` of the target alone: the baseline a user has.
- ``hf_coupled``: HF ``generate`` of the target alone with the coupled draws for that seed (``run.CoupledDraws``):
  the tokens the coupled rows must equal, drawn by an implementation that shares nothing with the stack's.
- ``coupled``: specsplit, coupled draws (the default): streamed trees, the trigger, provisional drafting.
- ``rejection``: specsplit, ``rejection_sampling=True``: the draft's whole trees of draws from q, recursive rejection
  sampling (the only way sampled sessions ran before coupled draws).

Both are exact samplers of the target's distribution (tests/parity/test_lossless_sampling.py); this measures speed,
and checks the coupled tokens against ``hf_coupled`` token by token. Writes <out>/sampling.json and sampling.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see specsplit/__init__.py

import argparse
import contextlib
import json
import pathlib
import sys
import time
from dataclasses import replace

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from run import COLD_VERIFIER, HFWorker, chat_ids, geomean, load_prompts, wait_for_quiet  # noqa: E402

from specsplit.client import Client  # noqa: E402
from specsplit.launch import DraftProcess, colocated_threads, default_proposers, start_stack  # noqa: E402
from specsplit.models import load_model  # noqa: E402
from specsplit.sampling import SamplingParams  # noqa: E402

METHODS = ("coupled", "rejection")
PROCESS_DRAFTS = ("half", "half+ngram")  # drafts that run as a service process (as `specsplit generate` runs them)


def specsplit_run(client: Client, ids: list[int], max_new: int, temperature: float, seed: int, draft: str,
                  rejection: bool) -> dict:
    tokens, rounds, kept, start = [], 0, 0, time.perf_counter()
    for chunk in client.generate(prompt_token_ids=ids, max_new_tokens=max_new, temperature=temperature, seed=seed,
                                 draft=draft, rejection_sampling=rejection):
        tokens += chunk.token_ids
        rounds += chunk.stats is not None
        kept += chunk.stats.provisional_kept if chunk.stats else 0
    seconds = time.perf_counter() - start
    return {"token_ids": tokens, "tokens_per_s": len(tokens) / seconds, "tau": len(tokens) / max(rounds, 1),
            "provisional_kept": kept}


def stack_for(draft: str, target, threads: int, draft_threads: int, running: contextlib.ExitStack):
    if draft in PROCESS_DRAFTS:
        process = DraftProcess(["--draft", draft, "--threads", str(draft_threads), "--no-cache-reuse"])
        verifier = replace(COLD_VERIFIER, threads=colocated_threads(draft_threads))
        return running.enter_context(start_stack(target, [], verifier, processes=[process]))
    proposers = default_proposers(draft, None, "cpu", "float32", target=target)
    return running.enter_context(start_stack(target, proposers, replace(COLD_VERIFIER, threads=threads)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--limit", type=int, default=6, help="prompts, taken across kinds in turn")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of HF and of an in-process stack")
    parser.add_argument("--draft", default="half+ngram", help="the stack's drafter (half+ngram: the default's)")
    parser.add_argument("--draft-threads", type=int, default=1, help="half drafts: their process's torch threads")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"of {', '.join(METHODS)}")
    parser.add_argument("--prompts", type=pathlib.Path, default=HERE / "prompts.jsonl")
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    temps = [float(t) for t in args.temperatures.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    prompts = load_prompts(args.prompts, None, args.limit)
    target = load_model(None, "cpu", "float32")
    rows = []
    # Cold: every run computes its prompt, as HF does (with the verifier's prefix cache, all but the first would copy it).
    with contextlib.ExitStack() as running:
        hf = running.enter_context(contextlib.closing(HFWorker(args.threads)))
        client = running.enter_context(Client(stack_for(args.draft, target, args.threads, args.draft_threads,
                                                         running).address))
        warm = chat_ids(target.tokenizer, "Say hello.")
        hf.generate(warm, 8)
        for method in methods:  # both warmed up alike
            specsplit_run(client, warm, 8, 1.0, 0, args.draft, method == "rejection")
        for seed, p in enumerate(prompts):
            ids = chat_ids(target.tokenizer, p["prompt"])
            for t in temps:
                row = {"prompt_id": p["id"], "kind": p["kind"], "temperature": t, "seed": seed}
                wait_for_quiet(30)
                run = hf.generate(ids, args.max_new_tokens, do_sample=True, temperature=t, top_k=0, top_p=1.0)
                row["hf_sampling_tokens_per_s"] = len(run.token_ids) / run.seconds
                wait_for_quiet(30)
                run = hf.generate(ids, args.max_new_tokens, coupled=SamplingParams(t, seed=seed))
                row["hf_coupled_tokens_per_s"], reference = len(run.token_ids) / run.seconds, run.token_ids
                for method in methods:
                    wait_for_quiet(30)
                    got = specsplit_run(client, ids, args.max_new_tokens, t, seed, args.draft, method == "rejection")
                    row[method] = {k: v for k, v in got.items() if k != "token_ids"}
                    if method == "coupled":
                        row[method]["identical"] = got["token_ids"] == reference
                rows.append(row)
                print(f"{p['id']} T={t}: HF sampling {row['hf_sampling_tokens_per_s']:.1f} tok/s, "
                      + ", ".join(f"{m} {row[m]['tokens_per_s']:.1f} tok/s (tau {row[m]['tau']:.2f})" for m in methods)
                      + (f", identical {row['coupled']['identical']}" if "coupled" in methods else ""),
                      file=sys.stderr, flush=True)
    head = "| kind | temperature | prompts | HF sampling tok/s | " + " | ".join(
        f"{m} tok/s (tau) | {m} / HF" for m in methods) + (" | coupled = HF coupled |" if "coupled" in methods else " |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for kind in sorted({r["kind"] for r in rows}) + ["all"]:
        for t in temps:
            sel = [r for r in rows if (kind == "all" or r["kind"] == kind) and r["temperature"] == t]
            hf_rate = sum(r["hf_sampling_tokens_per_s"] for r in sel) / len(sel)
            cells = [f"{kind}", f"{t:g}", f"{len(sel)}", f"{hf_rate:.1f}"]
            for m in methods:
                cells += [f"{sum(r[m]['tokens_per_s'] for r in sel) / len(sel):.1f} "
                          f"({sum(r[m]['tau'] for r in sel) / len(sel):.2f})",
                          f"{geomean([r[m]['tokens_per_s'] / r['hf_sampling_tokens_per_s'] for r in sel]):.2f}x"]
            if "coupled" in methods:
                cells.append(f"{sum(r['coupled']['identical'] for r in sel)}/{len(sel)}")
            lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    meta = {"draft": args.draft, "threads": args.threads, "draft_threads": args.draft_threads,
            "max_new_tokens": args.max_new_tokens, "cpus": os.cpu_count(), "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sampling.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "sampling.md").write_text(
        f"# Sampled decoding: coupled draws vs rejection sampling vs HF sampling (SmolLM2-135M fp32, draft "
        f"{args.draft})\n\n`python bench/sampling.py {' '.join(argv if argv is not None else sys.argv[1:])}`; "
        "tok/s means over the prompts, speedups geometric means of per-prompt ratios to HF sampling; the last column: "
        "coupled outputs token-identical to HF decoding alone with the same coupled draws.\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
