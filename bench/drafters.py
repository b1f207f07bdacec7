"""Drafter benchmark: every way specsplit can draft for the target, side by side, by prompt kind.

    python bench/drafters.py [--limit 3] [--max-new-tokens 128] [--threads 2]
    python bench/drafters.py --eagle DIR --medusa DIR --draft-lm DIR      # artifacts other than the shipped ones
    python bench/drafters.py --random-init --limit 1 --max-new-tokens 32  # smoke: untrained artifacts

Greedy decoding with the default target (SmolLM2-135M-Instruct, fp32, CPU). Methods:

- ``hf_greedy``: HF ``generate(do_sample=False)`` of the target alone (a child process): the baseline.
- ``hf_assisted``: HF assisted generation with the distilled draft LM (``assistant_model=``).
- ``hf_assisted_half``: HF assisted generation with the target itself as ``assistant_model``, in the float dtype the
  half draft measures fastest for a step here (draft_service/dtypes.py; an HF model holds no int8 weights).
- ``half``: the target as the draft (``--draft half``) at the dtype its calibration picks (``--draft-dtype`` names
  one), in its own draft-service process with
  ``--draft-threads`` threads (as the embedded ``specsplit generate`` runs it, and as an edge box would);
  ``half+ngram``: the same, copying prompt-lookup spans first.
- ``ngram``, ``eagle``, ``eagle+ngram``, ``medusa``, ``medusa+ngram``, ``draft_lm`` (``--draft model`` with an HF
  model directory built from the draft_lm artifact), ``none``: the embedded specsplit stack (real gRPC
  on loopback), one stack holding every drafter; the request's ``draft`` picks one.

Per prompt and method: tau (tokens committed per verification round), acceptance by depth (of the
rounds whose tree reached depth k, the share that accepted at least k draft tokens), tokens/s and
speedup vs hf_greedy, draft ms per drafted round, feature bytes per round, and whether the output is
token-identical to hf_greedy. Every timed generation computes its whole prompt, as HF generate does (the verifier
keeps no prefix cache, drafts reuse no ended session's cache: ``run.COLD_VERIFIER``). Artifacts default to the
shipped ones for the target (a method whose artifact is missing is skipped, and the report says so). Writes
<out>/drafters.json and drafters.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see specsplit/__init__.py

import argparse
import contextlib
import json
import multiprocessing
import pathlib
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

from draft_service.dtypes import calibrate  # noqa: E402
from run import COLD_VERIFIER, chat_ids, geomean, hf_generate, load_prompts  # noqa: E402 (bench/run.py)
from specsplit.client import Client  # noqa: E402
from specsplit.config import DraftConfig, OrchestratorConfig  # noqa: E402
from specsplit.heads import (FeatureDrafter, Manifest, MedusaHeads, build_draft_lm, draft_lm_manifest_config,  # noqa: E402
                             load_artifact, read_manifest, save_artifact)
from specsplit.launch import DraftProcess, colocated_threads, make_proposer, start_stack  # noqa: E402
from specsplit.models import load_model, target_identity  # noqa: E402
from verifier_service.medusa import find_artifact, load_medusa  # noqa: E402

SPECSPLIT = ["ngram", "eagle", "eagle+ngram", "medusa", "medusa+ngram", "draft_lm", "half", "half+ngram", "none"]
METHODS = ["hf_greedy", "hf_assisted", "hf_assisted_half", *SPECSPLIT]
HF_METHODS = ("hf_assisted", "hf_assisted_half")
DRAFT_PROCESSES = ("half", "half+ngram")  # methods whose draft runs as a service process on these cores
WARMUP_PROMPT = "Say hello."


@dataclass
class Result:
    """One prompt x one method."""

    prompt_id: str
    kind: str
    method: str
    tokens: int
    seconds: float
    tokens_per_s: float
    speedup: float  # vs hf_greedy on the same prompt
    rounds: int  # verification rounds (HF: target forwards)
    tau: float  # tokens committed per round
    accept_by_depth: list[float] = field(default_factory=list)  # [k-1]: P(accepted >= k | tree depth >= k)
    draft_ms_per_round: float = 0.0  # mean draft_ms over rounds that drafted
    feature_bytes_per_round: float = 0.0
    identical: bool = True  # token ids equal to hf_greedy's
    verify_ms_per_round: float = 0.0  # mean verify_ms (call time: the verifier's forward + the wire) over rounds that drafted


# -- HF in a child process (one OpenMP team per process) ---------------------------------------------
class HFWorker:
    def __init__(self, threads: int, assistant_dir: str | None, half_assistant: bool = False):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_hf_main, args=(child, threads, assistant_dir, half_assistant), daemon=True)
        self.proc.start()
        self.conn.recv()

    def generate(self, ids: list[int], max_new: int, assistant: str = ""):
        """assistant: "" (plain greedy), "hf_assisted" (the draft LM) or "hf_assisted_half" (the target at the
        half draft's step dtype)."""
        self.conn.send((ids, max_new, assistant))
        return self.conn.recv()  # (token_ids, seconds, forwards)

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=30)


def _hf_main(conn, threads: int, assistant_dir: str | None, half_assistant: bool) -> None:
    torch.set_num_threads(threads)
    loaded = load_model(None, "cpu", "float32")
    half = None
    if half_assistant:  # the same step dtype the half draft picks on this machine (draft_service/dtypes.py)
        models, calibration = calibrate(load_model(None, "cpu", "float32").model, threads, lean_forward=False)
        half = models[calibration.step_dtype]
    assistants = {"hf_assisted": load_model(assistant_dir, "cpu", "float32").model if assistant_dir else None,
                  "hf_assisted_half": half}
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        ids, max_new, assistant = msg
        extra = {"assistant_model": assistants[assistant]} if assistant else {}
        run = hf_generate(loaded, ids, max_new, **extra)
        conn.send((run.token_ids, run.seconds, run.rounds))


# -- artifacts --------------------------------------------------------------------------------------
def random_artifacts(target, directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """Untrained artifacts for the target (a smoke test of the plumbing, not of drafting quality)."""
    identity, fingerprint = target_identity(target), target.fingerprint
    model = target.model
    drafter = FeatureDrafter.init_from_target(model)
    heads = MedusaHeads(model.config.hidden_size, 3)
    lm = build_draft_lm(model.config, 2, model.get_input_embeddings().weight, target=model)
    out = {}
    for kind, module, config in (("eagle", drafter, drafter.manifest_config()),
                                 ("medusa", heads, heads.manifest_config()),
                                 ("draft_lm", lm, draft_lm_manifest_config(lm))):
        out[kind] = save_artifact(directory / kind, module, Manifest(kind, f"random-{kind}", identity, fingerprint, config))
    return out


def draft_lm_dir(artifact: pathlib.Path, target, directory: pathlib.Path) -> pathlib.Path:
    """An HF model directory (weights + the target's tokenizer) from a draft_lm artifact."""
    model = target.model
    lm, _ = load_artifact(artifact, model.get_input_embeddings().weight, model.model.norm.weight)
    lm.save_pretrained(directory)
    target.tokenizer.save_pretrained(directory)
    return directory


def find_artifacts(args, target, tmp: pathlib.Path) -> dict[str, pathlib.Path | None]:
    if args.random_init:
        return random_artifacts(target, tmp / "random")
    identity, fingerprint = target_identity(target), target.fingerprint
    return {kind: (pathlib.Path(given) if given else find_artifact(kind, identity, fingerprint))
            for kind, given in (("eagle", args.eagle), ("medusa", args.medusa), ("draft_lm", args.draft_lm))}


# -- one generation through the stack ----------------------------------------------------------------
def specsplit_run(client: Client, ids: list[int], max_new: int, draft: str) -> dict:
    tokens, stats = [], []
    start = time.perf_counter()
    for chunk in client.generate(prompt_token_ids=ids, max_new_tokens=max_new, draft=draft):
        tokens.extend(chunk.token_ids)
        if chunk.stats is not None:
            stats.append(chunk.stats)
    return {"tokens": tokens, "seconds": time.perf_counter() - start, "stats": stats}


def accept_by_depth(stats) -> list[float]:
    deepest = max((s.tree_depth for s in stats), default=0)
    rates = []
    for k in range(1, deepest + 1):
        reached = [s for s in stats if s.tree_depth >= k]
        rates.append(sum(s.num_accepted >= k for s in reached) / len(reached))
    return rates


def result_of(p: dict, method: str, tokens: list[int], seconds: float, rounds: int, base: list[int],
              base_s: float, stats=()) -> Result:
    n, rounds = len(tokens), max(rounds, 1)
    drafted = [s for s in stats if s.num_draft_tokens]
    return Result(p["id"], p["kind"], method, n, seconds, n / seconds, base_s / seconds, rounds, n / rounds,
                  accept_by_depth(stats),
                  statistics.mean(s.draft_ms for s in drafted) if drafted else 0.0,
                  sum(s.feature_bytes for s in stats) / rounds if stats else 0.0,
                  tokens == base, statistics.mean(s.verify_ms for s in drafted) if drafted else 0.0)


def bench_prompt(p: dict, methods: list[str], target, hf: HFWorker, clients: dict[str, Client], args) -> list[Result]:
    """clients: each specsplit method's stack (see ``main``)."""
    ids = chat_ids(target.tokenizer, p["prompt"])
    base, base_s, base_rounds = hf.generate(ids, args.max_new_tokens)
    results = [result_of(p, "hf_greedy", base, base_s, base_rounds, base, base_s)]
    for method in methods:
        if method in HF_METHODS:
            tokens, seconds, rounds = hf.generate(ids, args.max_new_tokens, assistant=method)
            results.append(result_of(p, method, tokens, seconds, rounds, base, base_s))
            continue
        draft = "model" if method == "draft_lm" else method
        run = specsplit_run(clients[method], ids, args.max_new_tokens, draft)
        results.append(result_of(p, method, run["tokens"], run["seconds"], len(run["stats"]), base, base_s,
                                 run["stats"]))
    print(f"{p['id']}: " + ", ".join(f"{r.method} {r.tokens_per_s:.1f} tok/s tau {r.tau:.2f}"
                                    f"{'' if r.identical else ' (DIFFERS)'}" for r in results), file=sys.stderr)
    return results


# -- reporting --------------------------------------------------------------------------------------
def markdown(results: list[Result], methods: list[str], skipped: dict[str, str], args, artifacts) -> str:
    lines = [f"SmolLM2-135M-Instruct, fp32, CPU, {args.threads} torch threads (half, half+ngram: the verifier on "
             f"{colocated_threads(args.draft_threads)} beside their {args.draft_threads}-thread draft process), greedy, "
             f"max_new_tokens="
             f"{args.max_new_tokens}. Speedup = tok/s / HF greedy tok/s on the same prompt (geometric mean over "
             "prompts); tau = tokens per verification round; accept@k = of the rounds whose tree reached depth k, "
             "the share that accepted >= k draft tokens.", ""]
    lines += ["Artifacts: " + ", ".join(f"{k}={v}" for k, v in artifacts.items()) +
              (" (random-init: plumbing smoke, not drafting quality)" if args.random_init else ""), ""]
    if skipped:
        lines += ["Skipped: " + "; ".join(f"{m} ({why})" for m, why in skipped.items()), ""]
    lines += ["| kind | method | prompts | speedup | tok/s | tau | accept@1..4 | draft ms/round | verify ms/round "
              "| feature bytes/round | identical |", "|---|---|--:|--:|--:|--:|---|--:|--:|--:|---|"]
    kinds = list(dict.fromkeys(r.kind for r in results))
    for kind in kinds + ["all"]:
        for method in ["hf_greedy", *methods]:
            sel = [r for r in results if r.method == method and kind in ("all", r.kind)]
            if not sel:
                continue
            depth = []
            for k in range(4):
                vals = [r.accept_by_depth[k] for r in sel if len(r.accept_by_depth) > k]
                depth.append(f"{statistics.mean(vals):.2f}" if vals else "-")
            lines.append(f"| {kind} | {method} | {len(sel)} | {geomean([r.speedup for r in sel]):.2f}x | "
                         f"{statistics.mean(r.tokens_per_s for r in sel):.1f} | {statistics.mean(r.tau for r in sel):.2f} | "
                         f"{' '.join(depth)} | {statistics.mean(r.draft_ms_per_round for r in sel):.1f} | "
                         f"{statistics.mean(r.verify_ms_per_round for r in sel):.1f} | "
                         f"{statistics.mean(r.feature_bytes_per_round for r in sel):.0f} | "
                         f"{'yes' if all(r.identical for r in sel) else 'NO'} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (HF child and stack each)")
    parser.add_argument("--limit", type=int, default=0, help="at most this many prompts, taken across kinds in turn")
    parser.add_argument("--kinds", default="", help="comma-separated prompt kinds to keep")
    parser.add_argument("--methods", default=",".join(METHODS[1:]), help="comma-separated methods besides hf_greedy")
    parser.add_argument("--prompts", type=pathlib.Path, default=HERE / "prompts.jsonl")
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    parser.add_argument("--eagle", help="eagle artifact dir (default: the shipped one for the target)")
    parser.add_argument("--medusa", help="medusa artifact dir (default: the shipped one for the target)")
    parser.add_argument("--draft-lm", help="draft_lm artifact dir (default: the shipped one for the target)")
    parser.add_argument("--random-init", action="store_true", help="untrained artifacts built here (smoke test)")
    parser.add_argument("--top-k", type=int, default=DraftConfig.model_top_k, help="eagle/model tree: children per node")
    parser.add_argument("--depth", type=int, default=DraftConfig.model_depth, help="eagle/model tree: depth")
    parser.add_argument("--draft-threads", type=int, default=1, help="half: torch threads of its draft process")
    parser.add_argument("--draft-dtype", default="", help="half: the draft's step dtype (float16, bfloat16, float32, int8; "
                        "default: the fastest timed at start)")
    parser.add_argument("--trigger", default=OrchestratorConfig.trigger, choices=["goodput", "edgellm", "fixed", "budget"],
                        help="when model and eagle drafts are verified: streamed trees on a trigger, or budget "
                             "(whole trees sized by the acceptance/cost controller)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, [k for k in args.kinds.split(",") if k], args.limit)
    target = load_model(None, "cpu", "float32")
    methods = [m for m in args.methods.split(",") if m]
    config = DraftConfig(model_top_k=args.top_k, model_depth=args.depth, reuse_ended=False)  # cold: see COLD_VERIFIER
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        artifacts = find_artifacts(args, target, tmp)
        names = {k: (f"{read_manifest(v).name} ({v})" if v else None) for k, v in artifacts.items()}
        for kind, needs in (("eagle", ("eagle", "eagle+ngram")), ("medusa", ("medusa", "medusa+ngram")),
                            ("draft_lm", ("draft_lm", "hf_assisted"))):
            if artifacts.get(kind) is None:
                for m in needs:
                    if m in methods:
                        methods.remove(m)
                        skipped[m] = f"no {kind} artifact for this target"
        proposers = [make_proposer("ngram", config=config)]
        if "eagle" in methods or "eagle+ngram" in methods:
            proposers += [make_proposer(k, config=config, artifact=artifacts["eagle"]) for k in ("eagle", "eagle+ngram")]
        lm_dir = None
        if artifacts.get("draft_lm") is not None:
            lm_dir = draft_lm_dir(artifacts["draft_lm"], target, tmp / "draft_lm_hf")
            if "draft_lm" in methods:
                proposers.append(make_proposer("model", str(lm_dir), "cpu", "float32", config))
        medusa = load_medusa(artifacts["medusa"], target) if artifacts.get("medusa") is not None else None
        hf = HFWorker(args.threads, str(lm_dir) if lm_dir and "hf_assisted" in methods else None,
                      half_assistant="hf_assisted_half" in methods)
        dtype = ["--draft-dtype", args.draft_dtype] if args.draft_dtype else []
        process_methods = [m for m in DRAFT_PROCESSES if m in methods]
        processes = [DraftProcess(["--draft", m, "--threads", str(args.draft_threads), "--no-cache-reuse", *dtype])
                     for m in process_methods]
        results: list[Result] = []
        orchestrator_config = OrchestratorConfig(trigger=args.trigger)
        with contextlib.ExitStack() as running:
            # The verifier runs on --threads, as HF greedy does; the half drafts, in processes of their own on these
            # cores, have a stack of their own whose verifier gets the cores their draft leaves (as `specsplit
            # generate` runs them). One stack for all would give every method that verifier's thread count.
            stack = running.enter_context(start_stack(target, proposers, replace(COLD_VERIFIER, threads=args.threads),
                                                      medusa=medusa, orchestrator_config=orchestrator_config))
            clients = dict.fromkeys(methods, running.enter_context(Client(stack.address)))
            if processes:
                beside = replace(COLD_VERIFIER, threads=colocated_threads(args.draft_threads))
                half_stack = running.enter_context(start_stack(target, [], beside, processes=processes,
                                                               orchestrator_config=orchestrator_config))
                clients.update(dict.fromkeys(process_methods, running.enter_context(Client(half_stack.address))))
            running.enter_context(contextlib.closing(hf))
            warm = chat_ids(target.tokenizer, WARMUP_PROMPT)
            hf.generate(warm, 8)
            for method in methods:
                if method in HF_METHODS:
                    hf.generate(warm, 8, assistant=method)
                else:
                    specsplit_run(clients[method], warm, 8, "model" if method == "draft_lm" else method)
            for i, p in enumerate(prompts):
                print(f"[{i + 1}/{len(prompts)}] ", end="", file=sys.stderr)
                results += bench_prompt(p, methods, target, hf, clients, args)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": target.name, "target_identity": target_identity(target), "threads": args.threads,
            "draft_threads": args.draft_threads, "half_verifier_threads": colocated_threads(args.draft_threads), "draft_dtype": args.draft_dtype or "auto",
            "max_new_tokens": args.max_new_tokens, "random_init": args.random_init, "artifacts": names,
            "skipped": skipped, "torch": torch.__version__, "cpus": os.cpu_count(),
            "tree": {"top_k": args.top_k, "depth": args.depth}, "trigger": args.trigger}
    (args.out / "drafters.json").write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]},
                                                       indent=1))
    table = markdown(results, methods, skipped, args, names)
    (args.out / "drafters.md").write_text("# specsplit drafter benchmark\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
