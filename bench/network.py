"""Edge and cloud on separate hosts with a real network in between: trigger and provisional generation vs RTT.

What it builds (as root): two network namespaces joined by a veth pair,

    ss-edge 10.77.0.1  --veth--  ss-cloud 10.77.0.2
    draft service(s) + this     verifier service + one delaying TCP relay per RTT
    script's orchestrator       (bench/relay.py: RTT/2 each way; the kernel here has no tc netem)

with the verifier, the draft and the orchestrator in three separate processes (``specsplit serve``
for the services). The orchestrator reaches the verifier through the relay of the RTT under test, so
every Prefill and Verify pays a true TCP round trip. Without root or ``ip netns`` it falls back to the
same processes and relays on loopback and says so in its output and results.

For each RTT it runs every configuration on the same prompts (greedy, or --temperature; every output is
checked token by token against HF greedy of the target, or HF decoding with the same coupled draws), each configuration first warmed up, untimed, on a prompt of
its own (--warmup-tokens; 0 measures cold starts, the adaptive triggers' learning included). Every timed
prompt is new to every configuration: the verifier keeps no prefix cache and the draft reuses no earlier
session's cache, so each pays its prompt's prefill on both (--warm-caches: each is cached for every
configuration alike, so the times are those of a conversation's next turn, or of a GPU verifier whose
prefill is short):

    fixed-N     verify when the streamed tree has N nodes (--fixed-sizes; the best of them is "best fixed")
    edgellm     verify when tree confidence T < alpha, EdgeLLM's alpha rule
    goodput     verify when T < alpha, alpha from measured draft, verify and network costs
    each with provisional generation off (+0) and on (+prov: kept provisional tokens are verified at once
    as the next tree, pipelined; +seed: they only seed the next tree, grown on until the trigger fires),
    plus one n-gram row (code-edit prompt);
    budget+0 (--configs): whole trees sized by the orchestrator's budget controller, not streamed;
    none (--configs): no draft, the target decoding alone on the cloud (what serving without specsplit's
    draft gives); any config@bN (--configs): at most N tokens per decode burst (@b1: one token a
    request, as before bursts) instead of the orchestrator's default (OrchestratorConfig.burst_max);
    rejection (--configs, with --temperature): rejection sampling, the draft's whole trees of draws.

Results merge into <out>/network.json (one entry per RTT, so RTTs can be run one at a time) and
<out>/network.md and <out>/network.png (tokens/s against RTT) are rewritten from all of it. Each
configuration's row: tokens/s, the mean time to the first tokens, tokens/s after them, tau, verifications
per 100 tokens, wasted draft tokens, kept provisional tokens, tokens decoded in target-only bursts.

    sudo python bench/network.py --rtts 0,20,50,100                   # everything (long on a CPU)
    python bench/network.py --rtts 50 --max-new-tokens 48 --prompts chat_guitar,sum_bees
    python bench/network.py --rtts 50 --configs goodput+prov,fixed-8+0   # a subset
    python bench/network.py --rtts 50 --draft-trace                    # + where the draft's time goes, by phase
    python bench/network.py --report-only                             # redraw md/png from the json

The draft is the target itself (default): a full-acceptance control, not a realistic draft cost; or
a trained one, --draft-model DIR (a draft LM) or --drafter eagle. Edge and cloud are separate machines:
each host's processes get their own core (--edge-cpus 0 --cloud-cpus 1, 1 torch thread each), so
drafting and verification really run at the same time.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see specsplit/__init__.py

import argparse
import json
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
ROOT = HERE.parent
WARMUP_PROMPT = "Describe a walk through a forest in autumn."  # --warmup-tokens; not in bench/prompts.jsonl
sys.path.insert(0, str(ROOT))

import draft_trace  # noqa: E402
from hosts import CLOUD_NS, EDGE_NS, Hosts, delete_namespaces, make_namespaces  # noqa: E402
import procstat  # noqa: E402
from network_report import TRIGGERS, parse_config, report, summarize  # noqa: E402
from specsplit.config import OrchestratorConfig  # noqa: E402
from specsplit.sampling import SamplingParams  # noqa: E402

VERIFIER_PORT, DRAFT_PORT, NGRAM_PORT, RELAY_PORT0 = 50052, 50053, 50054, 50060


# -- configurations ---------------------------------------------------------------------------------
def all_configs(fixed_sizes: list[int]) -> list[str]:
    names = [f"fixed-{n}" for n in fixed_sizes] + list(TRIGGERS)
    return [f"{n}+{p}" for n in names for p in ("0", "prov")] + ["ngram"]


def orchestrator_config(name: str, provisional_max: int, draft_timeout_s: float):
    # A shared, overloaded CPU can make one draft forward take seconds: a longer draft timeout than the
    # service default keeps such stalls from turning into target-only rounds (counted as target_only_rounds).
    base, prov, burst = parse_config(name)
    common = {"draft_timeout_s": draft_timeout_s, **({"burst_max": burst} if burst else {})}
    if base in ("ngram", "none", "rejection"):
        return OrchestratorConfig(trigger="budget", **common)
    common.update(provisional_max=provisional_max if prov in ("prov", "seed") else 0, pipeline=prov != "seed")
    if base.startswith("fixed-"):
        return OrchestratorConfig(trigger="fixed", fixed_tree_nodes=int(base[6:]), **common)
    return OrchestratorConfig(trigger=base, **common)


def draft_choice(name: str, drafter: str) -> str:
    base = parse_config(name)[0]
    return base if base in ("ngram", "none") else drafter


def sampling_of(name: str, temperature: float, seed: int) -> SamplingParams:
    """A configuration's sampling (--temperature > 0: coupled draws, or rejection sampling for the rejection row)."""
    return SamplingParams(temperature, seed=seed, rejection=parse_config(name)[0] == "rejection") if temperature else \
        SamplingParams()


# -- the driver (orchestrator + client, on the edge) ------------------------------------------------
def load_prompts(ids: list[str]) -> list[dict]:
    by_id = {p["id"]: p for p in map(json.loads, (HERE / "prompts.jsonl").read_text().splitlines())}
    return [by_id[i] for i in ids]


def drive(args) -> None:
    """Runs inside the edge host: HF greedy references, then every configuration at every RTT."""
    import torch

    torch.set_num_threads(args.threads)
    from orchestrator.generation import GenerationRequest, Orchestrator
    from run import hf_generate
    from specsplit.models import load_model
    from specsplit.rpc import RemoteDraft, RemoteVerifier

    target = load_model(args.target_model, "cpu", "float32")
    tokenizer = target.tokenizer
    prompts = load_prompts(args.prompts.split(","))
    code = load_prompts([args.code_prompt])[0]

    def ids_of(p):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    references = {}  # HF greedy, or HF decoding with the coupled draws of the prompt's seed (its index)
    for seed, p in enumerate(prompts + [code]):
        ids = ids_of(p)
        coupled = SamplingParams(args.temperature, seed=seed) if args.temperature else None
        references[p["id"]] = (ids, hf_generate(target, ids, args.max_new_tokens, coupled=coupled).token_ids)
    del target

    verifiers = json.loads(args.verifier_for_rtt)
    busy_pids = json.loads(args.busy_pids)  # {"draft"/"ngram"/"verifier"/"relay-<rtt>": pid}; orchestrator: this one
    warm_ids = ids_of({"prompt": WARMUP_PROMPT})
    results = []
    for rtt in args.rtts:
        # Configurations take turns prompt by prompt, so a change in the machine's load hits them alike.
        orchs, warmers, runs = {}, {}, {name: [] for name in args.config_list}
        for name in args.config_list:
            config = orchestrator_config(name, args.provisional_max, args.draft_timeout)
            draft_address = args.ngram if name == "ngram" else args.draft
            orch = Orchestrator([RemoteVerifier(verifiers[str(rtt)])], [RemoteDraft(draft_address)], tokenizer, config)
            orch.verifier_info  # connect (TCP + HTTP/2 setup through the relay) before timing
            orch.pick_draft(draft_choice(name, args.drafter))
            orchs[name] = orch
            if args.warm_caches:
                warmers[name] = Orchestrator([RemoteVerifier(verifiers[str(rtt)])], [RemoteDraft(draft_address)],
                                             tokenizer, config)
            if args.warmup_tokens:  # untimed (see --warmup-tokens); every configuration alike
                warm = GenerationRequest(prompt_token_ids=warm_ids,
                                         max_new_tokens=args.warmup_tokens, draft=draft_choice(name, args.drafter))
                for _ in orch.generate(warm):
                    pass
        for i, p in enumerate(prompts):  # (i: the prompt's seed when sampled; the code prompt's is len(prompts))
            order = args.config_list[i % len(args.config_list):] + args.config_list[:i % len(args.config_list)]
            for name in order:
                if name == "ngram" and i > 0:
                    continue  # one code-edit prompt for the n-gram row
                prompt = code if name == "ngram" else p
                prompt_ids, expected = references[prompt["id"]]
                request = GenerationRequest(prompt_token_ids=prompt_ids, max_new_tokens=args.max_new_tokens,
                                            draft=draft_choice(name, args.drafter),
                                            sampling=sampling_of(name, args.temperature, len(prompts) if name == "ngram" else i))
                if args.warm_caches:  # untimed: the prompt's K/V cached on the verifier and the draft, by an
                    for _ in warmers[name].generate(replace(request, max_new_tokens=2)):  # orchestrator of its own
                        pass                                  # (the configuration's trigger learns nothing from it)
                pids = {"draft": busy_pids["ngram" if name == "ngram" else "draft"], "verifier": busy_pids["verifier"],
                        "orchestrator": os.getpid(), "relay": busy_pids.get(f"relay-{rtt}")}  # (None: not read)
                cpu_before = procstat.read(pids)
                window = [time.time_ns()]  # (wall clock: the draft's exported spans are stamped with it)
                start = time.perf_counter()
                chunks, at = [], []  # at: ms since the start when each chunk arrived
                for chunk in orchs[name].generate(request):
                    chunks.append(chunk)
                    at.append((time.perf_counter() - start) * 1e3)
                elapsed = time.perf_counter() - start
                window.append(time.time_ns())
                cpu_ms = procstat.used(cpu_before, procstat.read(pids))  # each service process's CPU time
                stats = [c.stats for c in chunks if c.stats is not None]
                timeline = [[round(ms), c.stats.drafter, c.stats.num_draft_tokens, c.stats.num_accepted,
                             c.stats.num_committed, c.stats.provisional_kept, round(c.stats.draft_ms), round(c.stats.verify_ms)]
                            for c, ms in zip(chunks, at) if c.stats is not None]
                tokens = [t for c in chunks for t in c.token_ids]
                first = next(((c, ms) for c, ms in zip(chunks, at) if c.token_ids), None)  # the first tokens' chunk
                runs[name].append({
                    "prompt": prompt["id"], "tokens": len(tokens), "seconds": elapsed, "rounds": len(stats),
                    # time to the first tokens (prefill, the first round, the round trips), and how many came then
                    "first_token_ms": first[1] if first else elapsed * 1e3,
                    "first_tokens": len(first[0].token_ids) if first else 0,
                    "drafted": sum(s.num_draft_tokens for s in stats), "accepted": sum(s.num_accepted for s in stats),
                    "wasted": sum(s.wasted for s in stats), "provisional_kept": sum(s.provisional_kept for s in stats),
                    "identical": None if request.sampling.rejection else tokens == expected,
                    "target_only_rounds": sum(s.drafter == "none" for s in stats),  # fallbacks, goodput's plain rounds
                    "decoded": sum(s.num_decoded for s in stats),  # tokens the verifier decoded alone in bursts
                    # per round: [ms at its chunk, drafter, tree nodes, accepted, committed, provisional kept, draft ms,
                    # verifier ms]
                    "rounds_timeline": timeline,
                    "cpu_ms": cpu_ms, "window": window,
                })
        for name in args.config_list:
            orchs[name].close()
            if name in warmers:
                warmers[name].close()
            row = summarize(rtt, name, runs[name])
            results.append(row)
            print(f"RTT {rtt:>3} ms  {name:<14} {row['tokens_per_s']:6.2f} tok/s  first tokens "
                  f"{row['first_token_ms']:4.0f} ms  after them {row['decode_tokens_per_s']:6.2f} tok/s  "
                  f"tau {row['tau']:5.2f}  verif/100 {row['verifications_per_100']:5.1f}  wasted {row['wasted']:4d}  "
                  f"kept {row['provisional_kept']:3d}  target-only rounds {row['target_only_rounds']}  "
                  f"burst tokens {row['decoded']}  identical {row['identical']}  busy "
                  + (" ".join(f"{k} {v:.0%}" for k, v in sorted(row["busy"].items())) or "-"), flush=True)
    pathlib.Path(args.driver_out).write_text(json.dumps(results))


# -- main -----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rtts", default="0,20,50,100", help="round-trip delays to run, ms (default 0,20,50,100)")
    parser.add_argument("--prompts", default="chat_guitar,sum_bees", help="prompt ids from bench/prompts.jsonl")
    parser.add_argument("--code-prompt", default="code_rename", help="the n-gram row's code-edit prompt")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per generation (default 48)")
    parser.add_argument("--warmup-tokens", type=int, default=96,
                        help="before timing, each configuration generates this many tokens from a warm-up prompt at "
                             "each RTT (untimed: a long-running orchestrator has measured the costs its adaptive "
                             "trigger needs; 0 = cold, the first timed prompt pays that learning) (default 96)")
    parser.add_argument("--warm-caches", action="store_true",
                        help="before each timed generation, an untimed one of 2 tokens from the same prompt, with the "
                             "verifier's prefix cache and the draft's cache reuse on: every configuration finds its "
                             "prompt cached on both (default: both off, every prompt computed whole). Never the "
                             "services' defaults alone: configurations take turns on each prompt, and only the first "
                             "to run a prompt would compute its prefill (measured: its first tokens 0.5-1 s later on a "
                             "long prompt), so the turn order, not the configuration, would decide first-token times")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy, checked against HF greedy; > 0: sampled by coupled draws (prompt i's "
                             "seed: i), checked against HF decoding with the same draws (bench/run.py CoupledDraws), "
                             "and the config 'rejection' samples by rejection sampling (whole trees, not checked)")
    parser.add_argument("--fixed-sizes", default="4,8,16", help="fixed tree sizes to compare (default 4,8,16)")
    parser.add_argument("--configs", default="", help="comma-separated subset of the configurations (default all)")
    parser.add_argument("--provisional-max", type=int, default=OrchestratorConfig.provisional_max,
                        help="provisional tokens per verification (default %(default)s, the orchestrator's)")
    parser.add_argument("--grow-width", type=int, default=0,
                        help="the draft's --grow-width (default: specsplit serve's, 4; 1 for half)")
    parser.add_argument("--branch-threshold", type=float, default=0.3, help="the draft's --branch-threshold")
    parser.add_argument("--draft-timeout", type=float, default=10.0,
                        help="orchestrator's draft timeout, s (default 10; the service default 2 is tight on a busy CPU)")
    parser.add_argument("--target-model", default=None, help="target (default SmolLM2-135M-Instruct)")
    parser.add_argument("--draft-model", default=None, help="draft model dir (default: the target's own cache dir)")
    parser.add_argument("--drafter", choices=["model", "half", "half+ngram", "eagle"], default="model",
                        help="the streamed draft: model (--draft-model), half (the target at --draft-dtype), half+ngram "
                        "(half, copying prompt-lookup spans: what --draft auto picks for SmolLM2) or eagle (the feature "
                        "drafter; the verifier sends it the target's features)")
    parser.add_argument("--draft-artifact", default=None, help="eagle artifact dir (default: the shipped one)")
    parser.add_argument("--draft-dtype", default="", help="half, half+ngram: the draft's step dtype (float16, bfloat16, float32, "
                        "int8; default: the fastest timed at start)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--edge-cpus", default="0", help="taskset CPUs of the edge host: draft, orchestrator, client "
                        "(default 0; '' = no pinning)")
    parser.add_argument("--cloud-cpus", default="1", help="taskset CPUs of the cloud host: verifier, relays (default 1: "
                        "separate machines get separate cores; give both 0 to share one core)")
    parser.add_argument("--no-netns", action="store_true", help="skip namespaces: loopback relay (labelled so)")
    parser.add_argument("--draft-trace", action="store_true",
                        help="the draft exports its spans to its log and each row gets its draft forwards' time by "
                             "phase (bench/draft_trace.py); the exporter costs the draft a little time")
    parser.add_argument("--out", default=str(HERE / "results"), help="results directory (default bench/results)")
    parser.add_argument("--report-only", action="store_true", help="rewrite network.md/png from network.json")
    parser.add_argument("--conditions", default="", help="a line describing the machine, stored with the results")
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)  # the driver process on the edge
    for internal in ("--driver-out", "--verifier-for-rtt", "--draft", "--ngram", "--busy-pids"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rtts = [int(x) for x in args.rtts.split(",") if x]
    sizes = [int(x) for x in args.fixed_sizes.split(",") if x]
    args.config_list = [c for c in args.configs.split(",") if c] or all_configs(sizes)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.driver:
        drive(args)
        return 0
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "network.json"
    data = json.loads(store.read_text()) if store.exists() else {"rows": []}
    if args.report_only:
        print(report(data, out))
        return 0

    from specsplit.models import model_path

    draft_model = args.draft_model or str(model_path(args.target_model))
    # A SIGTERM (a `kill` of this script) unwinds like Ctrl-C, so the finally below stops the services and relays
    # and deletes the namespaces instead of leaving them holding the ports the next run needs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    netns = False if args.no_netns else make_namespaces()
    network = ("network namespaces + veth, delaying TCP relay (bench/relay.py) in the cloud namespace" if netns else
               "FALLBACK: no network namespaces; delaying TCP relay on loopback")
    print(f"network: {network}", flush=True)
    logdir = pathlib.Path(tempfile.mkdtemp(prefix="specsplit-network-"))
    hosts = Hosts(netns, {EDGE_NS: args.edge_cpus, CLOUD_NS: args.cloud_cpus}, logdir)
    py = sys.executable
    serve = [py, "-m", "specsplit.cli", "serve"]
    common = ["--threads", str(args.threads), "--device", "cpu"]
    # Every timed prompt is new to every configuration (see --warm-caches): no prefix cache, no draft cache reuse.
    cold_verifier, cold_draft = ([], []) if args.warm_caches else (["--prefix-cache-tokens", "0"], ["--no-cache-reuse"])
    try:
        model_args = ["--target-model", args.target_model] if args.target_model else []
        verifier = hosts.start(CLOUD_NS, "verifier", serve + [
            "verifier", "--listen", f"{hosts.cloud_ip}:{VERIFIER_PORT}", "--max-batch", "1", *model_args, *common,
            *cold_verifier], "serving on")
        verifiers, relays = {}, {}  # relays: {"relay-<rtt>": pid}
        for i, rtt in enumerate(args.rtts):
            port = RELAY_PORT0 + i
            relays[f"relay-{rtt}"] = hosts.start(CLOUD_NS, f"relay-{rtt}", [
                py, str(HERE / "relay.py"), "--listen", f"{hosts.cloud_ip}:{port}", "--upstream",
                f"{hosts.cloud_ip}:{VERIFIER_PORT}", "--rtt-ms", str(rtt)], "relay ").pid
            verifiers[str(rtt)] = f"{hosts.cloud_ip}:{port}"
        half_dtype = ["--draft-dtype", args.draft_dtype] if args.draft_dtype else []
        drafter = {"model": ["--draft", "model", "--draft-model", draft_model], "half": ["--draft", "half", *model_args, *half_dtype],
                   "half+ngram": ["--draft", "half+ngram", *model_args, *half_dtype],
                   "eagle": ["--draft", "eagle", *model_args] + (["--draft-artifact", args.draft_artifact]
                                                                 if args.draft_artifact else [])}[args.drafter]
        width = ["--grow-width", str(args.grow_width)] if args.grow_width else []  # default: the service's
        draft = hosts.start(EDGE_NS, "draft", serve + [
            "draft", "--listen", f"{hosts.edge_ip}:{DRAFT_PORT}", *drafter, *width,
            "--branch-threshold", str(args.branch_threshold), *common, *cold_draft], "serving on",
            env=draft_trace.ENV if args.draft_trace else None)
        ngram = hosts.start(EDGE_NS, "ngram", serve + [
            "draft", "--listen", f"{hosts.edge_ip}:{NGRAM_PORT}", "--draft", "ngram", *common], "serving on")
        driver_out = logdir / "driver.json"
        cmd = hosts.prefix(EDGE_NS) + [
            py, str(HERE / "network.py"), "--driver", "--driver-out", str(driver_out),
            "--verifier-for-rtt", json.dumps(verifiers), "--draft", f"{hosts.edge_ip}:{DRAFT_PORT}",
            "--busy-pids", json.dumps({**relays, "draft": draft.pid, "ngram": ngram.pid, "verifier": verifier.pid}),
            "--ngram", f"{hosts.edge_ip}:{NGRAM_PORT}", "--rtts", ",".join(map(str, args.rtts)),
            "--prompts", args.prompts, "--code-prompt", args.code_prompt, "--max-new-tokens", str(args.max_new_tokens),
            "--configs", ",".join(args.config_list), "--provisional-max", str(args.provisional_max),
            "--drafter", args.drafter, "--warmup-tokens", str(args.warmup_tokens),
            *(["--warm-caches"] if args.warm_caches else []),
            "--threads", str(args.threads), "--draft-timeout", str(args.draft_timeout),
            "--temperature", str(args.temperature)] + (["--target-model", args.target_model] if args.target_model else [])
        subprocess.run(cmd, check=True, cwd=ROOT)
        rows = json.loads(driver_out.read_text())
    finally:
        hosts.stop()
        if netns:
            delete_namespaces()
    if args.draft_trace:  # (once the draft has stopped: its exporter has written every span)
        outside = draft_trace.attribute(rows, draft_trace.read_forwards((logdir / "draft.log").read_text()))
        print(f"draft trace: {outside} draft forwards outside the timed generations (warm-ups, last rounds)")
    for r in rows:
        r["network"] = network
        r["draft_growth"] = {"grow_width": args.grow_width, "branch_threshold": args.branch_threshold}
        r["warm_caches"] = args.warm_caches
        r["temperature"] = args.temperature
        r["drafter"] = f"model:{draft_model}" if args.drafter == "model" else args.drafter
        if args.drafter.startswith("half"):
            r["draft_dtype"] = args.draft_dtype or "auto"
    done = {(r["rtt_ms"], r["config"]) for r in rows}
    data["rows"] = [r for r in data["rows"] if (r["rtt_ms"], r["config"]) not in done] + rows
    data["rows"].sort(key=lambda r: (r["rtt_ms"], r["config"]))
    if args.conditions:
        data["conditions"] = args.conditions
    store.write_text(json.dumps(data, indent=1) + "\n")
    print(report(data, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
