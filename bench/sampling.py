"""τ and tokens/s of sampled decoding next to greedy: specsplit (n-gram draft) vs HF sampling.

    python bench/sampling.py [--temperatures 0,0.7,1.0] [--max-new-tokens 96] [--limit 6]

Same target, machine and prompt set as bench/run.py (HF in a child process, the embedded stack in
this one). Sampled outputs are not comparable token by token (their exactness is what
tests/unit/test_sampling.py and tests/parity/test_lossless_sampling.py check); this measures speed.
Writes <out>/sampling.json and <out>/sampling.md.
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

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from run import COLD_VERIFIER, HFWorker, chat_ids, geomean, load_prompts, wait_for_quiet  # noqa: E402

from specsplit.client import Client  # noqa: E402
from specsplit.launch import default_proposers, start_stack  # noqa: E402
from specsplit.models import load_model  # noqa: E402


def specsplit_run(client, prompt, max_new, temperature, seed):
    tokens, rounds, start = 0, 0, time.perf_counter()
    for chunk in client.generate(prompt, max_new_tokens=max_new, draft="ngram", temperature=temperature,
                                 seed=seed if temperature else None):
        tokens += len(chunk.token_ids)
        rounds += chunk.stats is not None
    return tokens, time.perf_counter() - start, rounds


def hf_run(hf, ids, max_new, temperature, seed):
    extra = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else {}
    run = hf.generate(ids, max_new, **extra)
    return len(run.token_ids), run.seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--temperatures", default="0,0.7,1.0")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--limit", type=int, default=6, help="prompts, taken across kinds in turn")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=pathlib.Path, default=HERE / "prompts.jsonl")
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    temps = [float(t) for t in args.temperatures.split(",")]
    prompts = load_prompts(args.prompts, None, args.limit)
    hf = HFWorker(args.threads)
    loaded = load_model(None, "cpu", "float32")
    rows = []
    # Cold: every run computes its prompt, as HF does (each prompt runs once per temperature: with the verifier's
    # prefix cache, all but the first would copy it).
    with start_stack(loaded, default_proposers("ngram", None, "cpu", "float32"), COLD_VERIFIER) as stack, \
            Client(stack.address) as client, contextlib.closing(hf):
        specsplit_run(client, "Say hello.", 8, 0.0, 0)
        hf_run(hf, chat_ids(loaded.tokenizer, "Say hello."), 8, 0.0, 0)  # both warmed up alike
        for p in prompts:
            ids = chat_ids(loaded.tokenizer, p["prompt"])
            for t in temps:
                wait_for_quiet(30)
                n_hf, s_hf = hf_run(hf, ids, args.max_new_tokens, t, 0)
                wait_for_quiet(30)
                n, s, rounds = specsplit_run(client, p["prompt"], args.max_new_tokens, t, 0)
                rows.append({"prompt_id": p["id"], "kind": p["kind"], "temperature": t, "hf_tokens_per_s": n_hf / s_hf,
                             "specsplit_tokens_per_s": n / s, "speedup": (n / s) / (n_hf / s_hf),
                             "tau": n / max(rounds, 1), "tokens": n})
                print(f"{p['id']} T={t}: HF {n_hf / s_hf:.1f} tok/s, specsplit {n / s:.1f} tok/s, "
                      f"tau {n / max(rounds, 1):.2f}", file=sys.stderr, flush=True)
    lines = ["| kind | temperature | prompts | tau (mean) | specsplit tok/s (mean) | HF tok/s (mean) | speedup (geomean) |",
             "|---|---|---|---|---|---|---|"]
    for kind in sorted({r["kind"] for r in rows}):
        for t in temps:
            sel = [r for r in rows if r["kind"] == kind and r["temperature"] == t]
            lines.append(f"| {kind} | {t:g} | {len(sel)} | {sum(r['tau'] for r in sel) / len(sel):.2f} | "
                         f"{sum(r['specsplit_tokens_per_s'] for r in sel) / len(sel):.1f} | "
                         f"{sum(r['hf_tokens_per_s'] for r in sel) / len(sel):.1f} | "
                         f"{geomean([r['speedup'] for r in sel]):.2f}x |")
    table = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sampling.json").write_text(json.dumps({"max_new_tokens": args.max_new_tokens, "rows": rows}, indent=1))
    (args.out / "sampling.md").write_text("# Sampling vs greedy (n-gram draft, SmolLM2-135M fp32, 2 threads)\n\n"
                                          "HF = generate(do_sample=True, temperature=T, top_k=0) (greedy at T=0).\n\n"
                                          + table)
    print(table)


if __name__ == "__main__":
    main()
