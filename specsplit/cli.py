"""The ``specsplit`` command: generate text (embedded stack or a remote orchestrator) and serve services."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time

from specsplit.config import PARENT_PID_ENV
from specsplit.flags import build_parser


def _tree_config(args):
    from specsplit.config import OrchestratorConfig

    return OrchestratorConfig(trigger=args.trigger, fixed_tree_nodes=args.fixed_tree_nodes,
                              tree_max_nodes=args.tree_max_nodes, provisional_max=args.provisional_max,
                              burst_max=args.burst_max,
                              max_streams=getattr(args, "max_streams", OrchestratorConfig.max_streams))


def _draft_config(args, drafter: str):
    from specsplit.config import DraftConfig

    width = args.grow_width or (1 if drafter.startswith("half") else DraftConfig.grow_width)
    return DraftConfig(max_nodes=getattr(args, "max_tree_nodes", DraftConfig.max_nodes), grow_width=width,
                       branch_threshold=args.branch_threshold, threads=args.draft_threads,
                       reuse_ended=not args.no_cache_reuse, remember_calibration=True)


def _draft_process_args(args, kind: str) -> list[str]:
    """``specsplit serve draft`` flags for the embedded stack's draft process (--draft half or model)."""
    out = ["--draft", kind, "--device", args.device, "--dtype", args.dtype,
           "--threads", str(args.draft_threads or 1), "--branch-threshold", str(args.branch_threshold)]
    for flag, value in (("--target-model", args.target_model), ("--draft-model", args.draft_model),
                        ("--draft-dtype", args.draft_dtype), ("--grow-width", args.grow_width)):
        if value:
            out += [flag, str(value)]
    if args.no_cache_reuse:
        out.append("--no-cache-reuse")
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if os.environ.get(PARENT_PID_ENV):  # a child service of `specsplit generate`: it ends with its parent
        parent = int(os.environ[PARENT_PID_ENV])  # (watched from here, before torch loads for seconds)
        threading.Thread(target=_stop_when_orphaned, args=(parent,), daemon=True, name="parent-watch").start()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _quiet_transformers()
    if getattr(args, "threads", 0):
        import torch

        torch.set_num_threads(args.threads)
    from specsplit.errors import SpecSplitError

    try:
        if args.command == "generate":
            return generate(args)
        return serve(args)
    except SpecSplitError as err:
        print(f"specsplit: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specsplit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `specsplit generate ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


# generate's flags that set up the embedded stack; a remote orchestrator and its services have their own.
STACK_FLAGS = ("device", "dtype", "threads", "target_model", "draft_model", "draft_artifact", "medusa", "draft_dtype",
               "draft_threads", "grow_width", "branch_threshold", "no_cache_reuse", "trigger", "fixed_tree_nodes",
               "tree_max_nodes", "provisional_max", "burst_max")


def _given(args, names) -> list[str]:
    """Which of these generate flags are not at their defaults (given on the command line, or by a variable)."""
    defaults = build_parser().parse_args(["generate", ""])
    return [name for name in names if getattr(args, name) != getattr(defaults, name)]


def _refuse_stack_flags(args) -> None:
    """With --orchestrator, a stack flag would be silently ignored: refuse it instead."""
    from specsplit.errors import InvalidArgument

    given = [f"--{name.replace('_', '-')}" for name in _given(args, STACK_FLAGS)]
    if given:
        one = len(given) == 1
        raise InvalidArgument(f"{', '.join(given)} {'sets' if one else 'set'} up the embedded stack, not a request: with "
                              f"--orchestrator {'it belongs' if one else 'they belong'} on "
                              "`specsplit serve orchestrator|draft|verifier`")


# the draft flags each drafter reads (--draft auto may pick any of them); another drafter would ignore them
DRAFT_FLAG_USERS = {"draft_model": ("auto", "model"), "draft_artifact": ("auto", "eagle", "eagle+ngram"),
                    "medusa": ("auto", "medusa", "medusa+ngram"),
                    "draft_dtype": ("auto", "model", "half", "half+ngram")}


def _refuse_unused_draft_flags(args) -> None:
    """A draft flag given to a drafter that does not read it (a typo'd --draft?) is refused, not ignored."""
    from specsplit.errors import InvalidArgument

    for name in _given(args, DRAFT_FLAG_USERS):
        users = DRAFT_FLAG_USERS[name]
        if args.draft not in users:
            flag = f"--{name.replace('_', '-')}"
            raise InvalidArgument(f"{flag} is for --draft {' or '.join(u for u in users if u != 'auto')} (or auto); "
                                  f"--draft {args.draft} does not use it")


def _quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def generate(args) -> int:
    import grpc

    from specsplit.client import Client
    from specsplit.telemetry import setup_telemetry
    from specsplit.tls import hung_up_on_plaintext

    setup_telemetry("specsplit-cli")
    if threading.current_thread() is threading.main_thread():  # (signal handlers go in the main thread only)
        signal.signal(signal.SIGTERM, _terminated)  # ends like Ctrl-C: the session is cancelled, the stack stopped
    stack = None
    tls = None
    if args.orchestrator:
        from specsplit.tls import TLS

        _refuse_stack_flags(args)
        address = args.orchestrator
        tls = TLS.from_env(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key).for_calls()
    else:
        from specsplit.errors import InvalidArgument

        if args.tls_ca or args.tls_cert or args.tls_key:
            raise InvalidArgument("--tls-* flags are for a remote --orchestrator (the embedded stack talks over loopback)")
        if args.draft == "model" and not args.draft_model:
            raise InvalidArgument("--draft model needs --draft-model PATH (a small model with the target's tokenizer)")
        # What the orchestrator would refuse, refused before the stack starts (seconds of loading for nothing)
        if not args.prompt:
            raise InvalidArgument("prompt is empty: give a prompt")
        limit = _tree_config(args).max_new_tokens_limit
        if args.max_new_tokens > limit:
            raise InvalidArgument(f"--max-new-tokens {args.max_new_tokens} is over this server's limit of {limit}")
        _refuse_unused_draft_flags(args)
        from specsplit.launch import DraftProcess, default_proposers, load_model, start_stack

        from specsplit.launch import auto_draft

        target = load_model(args.target_model, args.device, args.dtype)
        if args.draft == "auto" and not args.draft_model:
            args.draft = auto_draft(target)
        medusa = None
        if args.draft in ("medusa", "medusa+ngram"):
            from verifier_service.medusa import load_medusa

            medusa = load_medusa(args.medusa, target)
        kind = "model" if args.draft == "auto" and args.draft_model else args.draft
        if kind in ("half", "half+ngram", "model"):  # a draft LM runs as its own service process, as on an edge box
            processes, proposers = [DraftProcess(_draft_process_args(args, kind))], []
        else:
            processes = []
            proposers = default_proposers(args.draft, args.draft_model, args.device, args.dtype,
                                          _draft_config(args, args.draft), artifact=args.draft_artifact, target=target,
                                          target_model=args.target_model, draft_dtype=args.draft_dtype)
        try:
            stack = start_stack(target, proposers, medusa=medusa, orchestrator_config=_tree_config(args),
                                processes=processes)
        except BaseException:
            for process in processes:
                process.close()
            raise
        address = stack.address
    token_ids: list[int] = []
    prompt_ids: list[int] = []
    text_parts: list[str] = []
    rounds = accepted = drafted = feature_bytes = wasted = kept = decoded = 0
    finish = ""
    try:
        addresses = _addresses(address)
        with Client(addresses, timeout=args.timeout or None, tls=tls,
                    on_reconnect=_tell_reconnect(len(addresses))) as client:
            start = time.perf_counter()
            stream = client.generate(args.prompt, max_new_tokens=args.max_new_tokens, stop=args.stop,
                                     draft=args.draft, chat_template=not args.no_chat_template,
                                     temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                     seed=args.seed, resume=stack is None, rejection_sampling=args.rejection_sampling)
            try:
                for chunk in stream:
                    if chunk.prompt_token_ids:
                        prompt_ids = chunk.prompt_token_ids
                    token_ids.extend(chunk.token_ids)
                    text_parts.append(chunk.text)
                    if chunk.stats is not None:
                        rounds += 1
                        accepted += chunk.stats.num_accepted
                        drafted += chunk.stats.num_draft_tokens
                        feature_bytes += chunk.stats.feature_bytes
                        wasted += chunk.stats.wasted
                        kept += chunk.stats.provisional_kept
                        decoded += chunk.stats.num_decoded
                    finish = chunk.finish_reason or finish
                    if not args.json and chunk.text:
                        print(chunk.text, end="", flush=True)
            except (KeyboardInterrupt, BrokenPipeError, SystemExit):
                # (a resumable session would stay detached, holding its cache, for a resume that never comes)
                stream.cancel()
                raise
            elapsed = time.perf_counter() - start
    except grpc.RpcError as err:
        print(f"\nspecsplit: error: {err.code().name}: {err.details()}", file=sys.stderr)
        details = err.details() or ""
        if err.code() == grpc.StatusCode.UNAVAILABLE and tls is not None and hung_up_on_plaintext(details, tls):
            print("specsplit: the orchestrator hung up: if it serves TLS, pass --tls-ca (see --help)", file=sys.stderr)
        if err.code() == grpc.StatusCode.UNIMPLEMENTED and "Method not found" in details:
            print(f"specsplit: {args.orchestrator} answered, but not as an orchestrator: a verifier's or a "
                  "draft's address? (--orchestrator takes `specsplit serve orchestrator`'s)", file=sys.stderr)
        return 2 if err.code() == grpc.StatusCode.INVALID_ARGUMENT else 1  # (2: the request itself was bad)
    finally:
        if stack is not None:
            stack.close()
    result = {
        "prompt_token_ids": prompt_ids,
        "token_ids": token_ids,
        "text": "".join(text_parts),
        "rounds": rounds,
        "mean_accepted_tokens": accepted / rounds if rounds else 0.0,
        "tokens_per_second": len(token_ids) / elapsed if elapsed > 0 else 0.0,
        "elapsed_s": elapsed,
        "tau": len(token_ids) / rounds if rounds else 0.0,
        "num_draft_tokens": drafted,
        "finish_reason": finish,
        "feature_bytes": feature_bytes,  # target features sent verifier -> orchestrator -> draft (eagle)
        "feature_bytes_per_round": feature_bytes / rounds if rounds else 0.0,
        "verifications": rounds,  # one verification per round
        "wasted_draft_tokens": wasted,
        "provisional_kept": kept,
        "decoded_tokens": decoded,  # tokens the verifier decoded alone in decode bursts (target-only rounds)
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"\n\n{len(token_ids)} tokens in {elapsed:.2f} s: {result['tokens_per_second']:.1f} tokens/s, "
              f"{rounds} rounds, {result['mean_accepted_tokens']:.2f} accepted draft tokens per round "
              f"(tau {result['tau']:.2f} tokens per round), finish: {finish}", file=sys.stderr)
    if finish == "error":  # a resumed session that had failed on its orchestrator: the tokens above are all it made
        print("specsplit: error: the generation failed on the orchestrator (finish_reason error; its log says why)",
              file=sys.stderr)
        return 1
    return 0


def _tell_reconnect(n_addresses: int):
    """Says on stderr why a resumable stream stalls: each orchestrator's failure once per stall."""
    def tell(reconnect) -> None:
        if reconnect.attempt <= n_addresses:
            print(f"\nspecsplit: orchestrator {reconnect.failed}: {reconnect.code.name} ({reconnect.details}); "
                  f"trying {reconnect.next} (for {reconnect.seconds_left:.0f} s more)", file=sys.stderr)
    return tell


def serve(args) -> int:
    from specsplit import launch, tls
    from specsplit.config import VerifierConfig
    from specsplit.serving import calls_in_flight, check_can_listen
    from specsplit.telemetry import setup_telemetry

    setup_telemetry(f"specsplit-{args.service}")
    check_can_listen(args.listen)  # (before a model loads for seconds)
    own = tls.TLS.from_env(cert=args.tls_cert, key=args.tls_key, ca=getattr(args, "tls_ca", None),
                           client_ca=args.tls_client_ca)
    tls.configure(own.for_calls() if args.service == "orchestrator" else own.checked())
    if args.service == "verifier":
        config = VerifierConfig(max_tree_nodes=args.max_tree_nodes, max_sessions=args.max_sessions,
                                max_batch=args.max_batch, batch_wait_ms=args.batch_wait_ms,
                                max_batch_tokens=args.max_batch_tokens, prefill_chunk=args.prefill_chunk,
                                idle_timeout_s=args.idle_timeout, lean_forward=not args.hf_forward,
                                prefix_cache_tokens=args.prefix_cache_tokens, cuda_graphs=args.cuda_graphs)
        config.validate()  # (before a model loads for seconds)
        target = launch.load_model(args.target_model, args.device, args.dtype)
        medusa = None
        if args.medusa:
            from verifier_service.medusa import load_medusa

            medusa = load_medusa(None if args.medusa == "shipped" else args.medusa, target)
        server = launch.start_verifier(target, args.listen, config, medusa)
    elif args.service == "draft":
        proposer = launch.make_proposer(args.draft, args.draft_model, args.device, args.dtype,
                                        _draft_config(args, args.draft), artifact=args.draft_artifact,
                                        target_model=args.target_model, draft_dtype=args.draft_dtype)
        server = launch.start_draft(proposer, args.listen, args.max_tree_nodes,
                                    args.draft_model or getattr(proposer, "artifact", ""), args.idle_timeout)
    else:
        verifiers = _addresses(args.verifier or "") + _addresses(args.verifiers)
        if not verifiers:
            print("specsplit: error: serve orchestrator needs --verifier HOST:PORT or --verifiers A,B "
                  "(or SPECSPLIT_VERIFIER / SPECSPLIT_VERIFIERS)", file=sys.stderr)
            return 2
        from specsplit.store import RedisStore, open_store

        store = open_store(args.redis_url)
        if isinstance(store, RedisStore):
            store.retry_s = args.store_retry_s
            why = store.unreachable()
            if why:  # (serving anyway: it may come up; until then generations fail with UNAVAILABLE)
                print(f"specsplit orchestrator: warning: session store {store.url} does not answer ({why}); "
                      "generations fail with UNAVAILABLE until it does", file=sys.stderr, flush=True)
        server = launch.start_orchestrator(verifiers, _addresses(args.drafts), launch.load_tokenizer(args.target_model),
                                           args.listen, _tree_config(args), store)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before the line that says it serves: a stop may follow at once
        signal.signal(sig, lambda *_: stop.set())
    secure = " (TLS)" if server.tls else ""  # the address stays the line's last word
    print(f"specsplit {args.service}{secure} serving on {server.address}", file=sys.stderr, flush=True)
    stop.wait()
    start = time.monotonic()
    if args.announce_s > 0:
        print(f"specsplit {args.service}: stopping: health NOT_SERVING; new calls still taken for {args.announce_s:g} s "
              "(--announce-s)", file=sys.stderr, flush=True)
        server.announce_stop(args.announce_s)
    print(f"specsplit {args.service}: stopping: no new calls (health NOT_SERVING); {calls_in_flight()} in flight get up "
          f"to {args.drain_s:g} s to finish (--drain-s), then are cut off", file=sys.stderr, flush=True)
    server.stop(grace=args.drain_s)
    if args.service == "orchestrator":  # waits (up to 10 s) for the Release calls of ended sessions still being sent,
        server.core.close()  # as the embedded stack does (sent on daemon threads, one cut off at exit leaves a cache)
    print(f"specsplit {args.service}: stopped after {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    _exit_stopped(0)
    return 0  # (not reached)


def _exit_stopped(code: int) -> None:
    """End a stopped server's process here, skipping the interpreter's teardown: there, with gRPC's and torch's own
    threads still running, a stopped `serve draft` aborted ("terminate called without an active exception", exit -6)
    in 3 of 22 SIGTERM stops. Spans, metrics, logs and output are flushed first, as a normal exit would."""
    from specsplit.telemetry import shutdown_telemetry

    shutdown_telemetry()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _stop_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:  # (when the parent is gone, this process is handed to another)
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)  # serving: it stops as told to; still loading: it ends there


def _addresses(text: str) -> list[str]:
    return [a.strip() for a in text.split(",") if a.strip()]


if __name__ == "__main__":
    sys.exit(main())
