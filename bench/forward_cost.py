"""What one verifier forward costs: HF's own decode step vs the packed forward through the model vs the lean one
vs the lean one replayed as a CUDA graph (``verifier_service.graphs``; off a GPU its fixed-shape batch runs eagerly).

Each packed forward verifies ``--rows`` sessions' rows of ``--tokens`` tokens (root + a chain) on ``--cache``-token
caches, as a scheduler tick does; the three kinds take turns, ``--repeats`` times, and the medians are reported.
``--model proxy`` is SmolLM2's shape (30 layers, 9 query / 3 K/V heads) at hidden 72 with random weights: every
operation is tiny, so a forward costs what the host spends issuing operations -- what paces a small target on a
GPU, measurable on any CPU. ``--model smollm2`` is the real target (on ``--device``; CUDA is synchronised before
each clock read). Example, on a GPU box: ``python bench/forward_cost.py --model smollm2 --device cuda``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from specsplit.kvcache import cache_kwarg, new_cache  # noqa: E402
from specsplit.tree import TokenTree  # noqa: E402
from verifier_service.batching import group_overhead_for, pack_rows, prefill_row, verify_row  # noqa: E402
from verifier_service.graphs import GraphedForward  # noqa: E402
from verifier_service.lean import LeanPackedLlama  # noqa: E402
from verifier_service.slots import SlotStore, packed_forward, use_packed_attention  # noqa: E402
from proxy import proxy_model  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", choices=["proxy", "smollm2"], default="proxy")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--rows", default="1,4,16", help="sessions per packed forward")
    parser.add_argument("--tokens", type=int, default=4, help="tokens per row (root + tree)")
    parser.add_argument("--cache", type=int, default=200, help="cached tokens per session")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write the medians here as json")
    args = parser.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",")]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.model == "proxy":
        model = proxy_model().to(device)
    else:
        from specsplit.models import load_model

        model = load_model(None, str(device), "float32").model
    use_packed_attention(model)
    cache_arg, lean = cache_kwarg(model), LeanPackedLlama(model)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    kinds = {}
    with torch.no_grad():
        cache = new_cache(model)
        model(input_ids=torch.arange(10, 10 + args.cache, device=device)[None], use_cache=True, **{cache_arg: cache})
        step = torch.tensor([[5]], device=device)

        def hf_step():
            model(input_ids=step, use_cache=True, logits_to_keep=1, **{cache_arg: cache})
            cache.crop(-1)

        kinds["HF decode step (1 token)"] = hf_step
        chain = TokenTree.chain(list(range(6, 6 + args.tokens - 1)))
        graphs: dict[int, GraphedForward] = {}

        def fail(why: str):
            raise SystemExit(why)
        for n in args.rows:
            stores = [SlotStore(max_slots=max(args.rows)), SlotStore(max_slots=max(args.rows)),
                      SlotStore(max_slots=max(args.rows), scratch=True)]
            prompt = list(range(10, 10 + args.cache))
            for store in stores:
                lean(store, pack_rows([prefill_row(s, 0, prompt) for s in range(n)], model.dtype, device))
            rows = [verify_row(s, args.cache, 5, chain) for s in range(n)]
            packed = pack_rows(rows, model.dtype, device, group_overhead_for(device))
            graphed = GraphedForward(lean, max(args.rows), device, model.dtype)  # one per store: graphs follow it
            keep = list(range(packed.num_tokens))
            kinds[f"{n} rows x {args.tokens}: through the model"] = (
                lambda store=stores[0], packed=packed, keep=keep: packed_forward(model, store, packed, cache_arg, keep))
            kinds[f"{n} rows x {args.tokens}: lean"] = (
                lambda store=stores[1], packed=packed, keep=keep: lean(store, packed, keep))
            graphs[n] = graphed
            kinds[f"{n} rows x {args.tokens}: graphed"] = (
                lambda store=stores[2], rows=rows, keep=keep, graphed=graphed: graphed(store, rows, keep) or fail(
                    f"the graphed forward did not run {len(rows)} rows (failed: {graphed.failed})"))
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for repeat in range(args.repeats + 3):
            for name, run in kinds.items():
                sync()
                start = time.perf_counter()
                run()
                sync()
                if repeat >= 3:  # warm-up
                    times[name].append((time.perf_counter() - start) * 1e3)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"{args.model} on {device}, {args.threads} thread(s), {args.cache}-token caches, median of {args.repeats}:")
    for name, ms in medians.items():
        print(f"  {name}: {ms:.2f} ms")
    print("  graphed: " + ", ".join(f"{n} rows {g.captures} capture(s), {g.replays} replays"
                                    + (" (CUDA graphs)" if g.capture else " (no GPU: fixed batches run eagerly)")
                                    for n, g in graphs.items()))
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "median_ms": medians},
                                       indent=1))


if __name__ == "__main__":
    main()
