"""Does a verification slow the draft when both run on one machine? The draft's step alone and beside the target's.

    python bench/contention.py [--draft-dtype int4] [--verify-tokens 16] [--draft-cpu 0] [--verifier-cpu 1]

bench/network.py puts the edge and the cloud on two cores of one machine: they share its memory bus and last-level
cache, which an edge box and a cloud GPU do not. A float32 verify forward streams the whole target through them
(~540 MB of SmolLM2 weights, however few its tokens); where that slows the draft on the other core, whatever runs the
two at once (provisional drafting under a verification, pipelined trees) pays a cost that a real deployment would
not, and more so the more verifications a generation makes. This measures it: the half draft's one-token step
(``draft_dtypes.step_ms``: a 200-token cache, the median of --repeats) on --draft-cpu with --verifier-cpu idle, then
with a process there running the target's forward over --verify-tokens new tokens on a 200-token cache back to back;
--turns times each, in turns.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pathlib
import statistics
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

from draft_dtypes import step_ms  # noqa: E402
from draft_service import lean  # noqa: E402
from draft_service.dtypes import parse_draft_dtype  # noqa: E402
from specsplit import kvcache  # noqa: E402
from specsplit.models import load_model  # noqa: E402


def verify_forever(cpu: int, tokens: int, ready, stop) -> None:
    """The target's float32 forward over ``tokens`` new tokens on a 200-token cache, again and again, on ``cpu``, until
    ``stop``: a busy CPU verifier's work (the same weights and dtype, through the lean forward)."""
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    loaded = load_model(None, "cpu", "float32")
    ids = torch.randint(0, loaded.model.config.vocab_size, (1, 200 + tokens),
                        generator=torch.Generator().manual_seed(1))  # [1, 200 + tokens]
    with torch.inference_mode():
        target = lean.LeanLlama(loaded.model, torch.float32)  # (the verifier's weights and dtype)
        cache = target.new_cache()
        target(input_ids=ids[:, :200], cache=cache, logits_to_keep=1)
        ready.set()
        while not stop.is_set():
            target(input_ids=ids[:, 200:], cache=cache)
            kvcache.truncate(cache, 200)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--draft-dtype", default="int4", help="the half draft's weights (bench/draft_dtypes.py)")
    parser.add_argument("--verify-tokens", type=int, default=16, help="new tokens in each of the verifier's forwards")
    parser.add_argument("--draft-cpu", type=int, default=0, help="the draft's core (bench/network.py's edge: 0)")
    parser.add_argument("--verifier-cpu", type=int, default=1, help="the verifier's core (the cloud's: 1)")
    parser.add_argument("--repeats", type=int, default=60, help="timed draft steps a turn")
    parser.add_argument("--turns", type=int, default=3, help="turns of each (idle, busy)")
    args = parser.parse_args(argv)
    cpus = os.sched_getaffinity(0)
    if {args.draft_cpu, args.verifier_cpu} - cpus or args.draft_cpu == args.verifier_cpu:
        parser.error(f"--draft-cpu and --verifier-cpu must be two different cores of {sorted(cpus)}")
    os.sched_setaffinity(0, {args.draft_cpu})
    torch.set_num_threads(1)
    (dtype,) = parse_draft_dtype(args.draft_dtype)
    loaded = load_model(None, "cpu", "float32")
    with torch.inference_mode():
        drafts = {args.draft_dtype: lean.LeanLlama(loaded.model, dtype)}
        step_ms(drafts, args.repeats)  # (warm-up)
        idle, busy = [], []
        for _ in range(args.turns):
            idle.append(step_ms(drafts, args.repeats)[args.draft_dtype])
            ready, stop = multiprocessing.Event(), multiprocessing.Event()
            verifier = multiprocessing.Process(target=verify_forever,
                                               args=(args.verifier_cpu, args.verify_tokens, ready, stop))
            verifier.start()
            while not ready.wait(1.0):  # (it loads the target first)
                if not verifier.is_alive():
                    raise SystemExit(f"contention: the verifier process died (exit code {verifier.exitcode})")
            time.sleep(1.0)  # (its first forwards)
            busy.append(step_ms(drafts, args.repeats)[args.draft_dtype])
            if not verifier.is_alive():
                raise SystemExit(f"contention: the verifier process died (exit code {verifier.exitcode})")
            stop.set()
            verifier.join()
    median_idle, median_busy = statistics.median(idle), statistics.median(busy)
    print(f"draft ({args.draft_dtype}) step on CPU {args.draft_cpu}, median of {args.repeats} a turn, {args.turns} "
          f"turns; verifier: float32 forwards of {args.verify_tokens} tokens on CPU {args.verifier_cpu}")
    print(f"  its core idle:  {', '.join(f'{t:.1f}' for t in idle)} ms (median {median_idle:.1f})")
    print(f"  verifying:      {', '.join(f'{t:.1f}' for t in busy)} ms (median {median_busy:.1f})")
    print(f"  slowdown while the verifier works: {median_busy / median_idle:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
