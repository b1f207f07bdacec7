"""The half draft's candidate precisions on this machine: one draft step's time and greedy agreement with the target.

    python bench/draft_dtypes.py [--dtypes float32,float16,bfloat16,int8,int4] [--threads 1] [--tokens 64]

Each dtype is a lean draft copy of SmolLM2 (``draft_service.lean.LeanLlama``; int8 and int4 weights:
``draft_service/quantized.py``, CPU only).
Step: one token on a 200-token cache, the median of --repeats, the dtypes taking turns. Agreement: the float32
target's greedy answer (--tokens tokens) to every --every-th prompt of bench/prompts.jsonl, then each copy teacher-forced
over prompt + answer in one forward: the share of answer positions where its argmax is the target's token (what a
draft chain needs to be accepted). The draft never changes the output; this is the chance it is right.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

from draft_service import lean  # noqa: E402
from draft_service.dtypes import QUANTIZED, STEP_DTYPES, parse_draft_dtype  # noqa: E402
from specsplit import kvcache  # noqa: E402
from specsplit.models import load_model  # noqa: E402


def step_ms(drafts: dict, repeats: int) -> dict:
    """{name: median ms of a one-token step on a 200-token cache}, the copies taking turns."""
    ids = torch.randint(0, 49152, (1, 201), generator=torch.Generator().manual_seed(0))  # [1, 201]
    caches = {}
    for name, draft in drafts.items():
        caches[name] = draft.new_cache()
        draft(input_ids=ids[:, :200], cache=caches[name], logits_to_keep=1)
    times: dict = {name: [] for name in drafts}
    for _ in range(repeats):
        for name, draft in drafts.items():
            kvcache.truncate(caches[name], 200)
            start = time.perf_counter()
            draft(input_ids=ids[:, 200:], cache=caches[name])
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def agreement(loaded, drafts: dict, prompts: list[dict], tokens: int) -> dict:
    """{name: share of the target's greedy answer tokens that the copy's argmax matches, teacher-forced}."""
    hits = {name: 0 for name in drafts}
    total = 0
    for prompt in prompts:
        ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": prompt["prompt"]}],
                                                   add_generation_prompt=True, return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]  # [1, P]
        full = loaded.model.generate(ids, max_new_tokens=tokens, do_sample=False)  # [1, P + N]
        answer = full[0, ids.shape[1]:]  # [N] the target's tokens
        total += len(answer)
        for name, draft in drafts.items():
            logits = draft(input_ids=full[:, :-1]).logits[0, ids.shape[1] - 1:]  # [N, V]
            hits[name] += int((logits.argmax(-1) == answer).sum())
    return {name: hits[name] / total for name in drafts}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--dtypes", default="float32,float16,bfloat16,int8,int4", help="the copies to compare")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (a draft's own)")
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per dtype")
    parser.add_argument("--tokens", type=int, default=64, help="answer tokens per prompt for agreement")
    parser.add_argument("--prompts", type=pathlib.Path, default=HERE / "prompts.jsonl")
    parser.add_argument("--every", type=int, default=2, help="agreement over every N-th prompt (1: all of them)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtypes = {}
    for name in args.dtypes.split(","):
        (dtype,) = parse_draft_dtype(name)
        if dtype in QUANTIZED and dtype not in STEP_DTYPES:  # the draft service's own test of what runs here
            print(f"{name}: skipped (no {name} matmul in torch {torch.__version__})")
            continue
        dtypes[name] = dtype
    loaded = load_model(None, "cpu", "float32")
    with torch.inference_mode():
        drafts = {name: lean.LeanLlama(loaded.model, dtype) for name, dtype in dtypes.items()}
        steps = step_ms(drafts, args.repeats)
        prompts = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()][::args.every]
        agree = agreement(loaded, drafts, prompts, args.tokens)
    print(f"{len(prompts)} prompts x {args.tokens} tokens, {args.threads} thread(s), torch {torch.__version__}")
    for name in drafts:
        print(f"{name:>9}: step {steps[name]:6.1f} ms, agreement with the float32 target {agree[name]:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
