"""The `specsplit` command: embedded generate --json, and the three services as separate processes (also over TLS)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from pki import make_pki
from processes import cli, running, serve, signal_while_a_draft_starts
from redis_server import free_port
from tiny import hf_greedy

JSON_KEYS = {"prompt_token_ids", "token_ids", "text", "rounds", "mean_accepted_tokens", "tokens_per_second",
             "elapsed_s"}


def test_generate_json_is_one_object_with_the_contract_keys(model_dir):
    path, loaded = model_dir
    out = cli("generate", "hello world", "--target-model", str(path), "--max-new-tokens", "12", "--json",
              OTEL_TRACES_EXPORTER="console")  # spans go to stderr, never into the JSON
    assert out.returncode == 0, out.stderr
    assert '"name": "specsplit.orchestrator.generate' in out.stderr
    result = json.loads(out.stdout)  # exactly one JSON object on stdout
    assert JSON_KEYS <= result.keys()
    assert result["token_ids"] == hf_greedy(loaded.model, result["prompt_token_ids"], 12)
    assert result["rounds"] >= 1 and result["tokens_per_second"] > 0
    assert result["text"] == loaded.tokenizer.decode(result["token_ids"], skip_special_tokens=True)


def test_generate_samples_with_a_seed(model_dir):
    path, _ = model_dir
    runs = [cli("generate", "hello world", "--target-model", str(path), "--max-new-tokens", "12", "--json",
                "--draft", "ngram", "--temperature", "0.8", "--top-p", "0.95", "--seed", str(seed))
            for seed in (7, 7, 8)]
    assert all(out.returncode == 0 for out in runs), runs[0].stderr
    tokens = [json.loads(out.stdout)["token_ids"] for out in runs]
    assert tokens[0] == tokens[1] != tokens[2]  # a seed fixes the draw; another seed draws anew
    bad = cli("generate", "hi", "--temperature", "-1")
    assert bad.returncode == 2 and "--temperature: must be >= 0" in bad.stderr


def test_generate_streams_text_and_prints_stats(model_dir):
    path, _ = model_dir
    out = cli("generate", "hello", "--target-model", str(path), "--max-new-tokens", "6", "--draft", "none",
              "--no-chat-template")
    assert out.returncode == 0, out.stderr
    assert "tokens/s" in out.stderr and "rounds" in out.stderr


def test_bad_input_exits_with_a_clear_message(model_dir):
    path, _ = model_dir
    out = cli("generate", "hello", "--target-model", str(path), "--max-new-tokens", "0")
    assert out.returncode != 0
    assert "--max-new-tokens: must be >= 1" in out.stderr  # at once, before any model loads
    out = cli("generate", "hello", "--target-model", str(path / "missing"))
    assert out.returncode == 2 and "not a local Hugging Face model directory" in out.stderr
    out = cli("generate", "hello", "--burst-max", "0")
    assert out.returncode == 2 and "--burst-max: must be 1..65" in out.stderr
    out = cli("generate", "", "--target-model", str(path), "--draft", "none")  # refused before the stack starts
    assert out.returncode == 2 and "prompt is empty" in out.stderr, out.stderr


def test_an_incomplete_model_directory_is_named_in_one_line(model_dir, tmp_path):
    """A model directory without its tokenizer files, or without its weights: exit 2 and one line that names what is
    missing (before: a transformers traceback)."""
    import shutil

    path, _ = model_dir
    for kept, missing in ((("config.json", "model.safetensors"), "tokenizer"), (("config.json", "tokenizer.json",
                                                                                  "tokenizer_config.json"), "model weights")):
        broken = tmp_path / missing.replace(" ", "_")
        broken.mkdir()
        for name in kept:
            if (path / name).exists():
                shutil.copy(path / name, broken / name)
        out = cli("generate", "hello", "--target-model", str(broken), "--draft", "none")
        assert out.returncode == 2 and f"cannot load the {missing} from {broken}: it holds none of" in out.stderr
        assert "Traceback" not in out.stderr and "sentencepiece" not in out.stderr, out.stderr  # (what it suggested)


def test_generate_with_the_half_draft(model_dir):
    path, loaded = model_dir
    out = cli("generate", "hello world", "--target-model", str(path), "--max-new-tokens", "16", "--json",
              "--draft", "half", "--draft-threads", "1")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["token_ids"] == hf_greedy(loaded.model, result["prompt_token_ids"], 16)
    assert result["num_draft_tokens"] > 0  # the float16 target drafted


def test_help_teaches():
    out = cli("--help")
    assert out.returncode == 0 and "serve verifier" in out.stdout
    version = cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("specsplit 0.")
    out = cli("generate", "--help")
    assert "--draft" in out.stdout and "--json" in out.stdout
    text = " ".join(out.stdout.split())  # argparse wraps lines
    assert "half (the target's own weights at the 16-bit precision measured fastest" in text and "--draft-threads" in text



def test_each_service_has_its_own_flags():
    helps = {service: " ".join(cli("serve", service, "--help").stdout.split())
             for service in ("verifier", "draft", "orchestrator")}
    assert "--max-batch" in helps["verifier"] and "--max-batch" not in helps["orchestrator"]
    assert "--redis-url" in helps["orchestrator"] and "--redis-url" not in helps["verifier"]
    assert "--draft-dtype" in helps["draft"] and "--draft-dtype" not in helps["verifier"]
    assert "default 127.0.0.1:50052" in helps["verifier"] and "default 127.0.0.1:50051" in helps["orchestrator"]
    wrong = cli("serve", "orchestrator", "--max-batch", "4")  # a verifier flag: refused, not ignored
    assert wrong.returncode == 2 and "unrecognized arguments: --max-batch" in wrong.stderr
    missing = cli("serve")
    assert missing.returncode == 2 and "verifier,draft,orchestrator" in missing.stderr
    assert "required: {generate,serve}" in cli().stderr
    # every flag read from a variable names it
    assert "[env SPECSPLIT_IDLE_TIMEOUT]" in helps["draft"] and "[env SPECSPLIT_DRAFT_DTYPE]" in helps["draft"]
    assert "[env SPECSPLIT_STORE_RETRY_S]" in helps["orchestrator"] and "[env SPECSPLIT_THREADS]" in helps["verifier"]


@pytest.mark.parametrize("args, words", [
    (("serve", "draft", "--listen", "127.0.0.1:99999"), "not a HOST:PORT address"),
    (("serve", "draft", "--listen", "garbage"), "not a HOST:PORT address"),
    (("serve", "orchestrator", "--verifier", "nonsense"), "not a HOST:PORT address"),
    (("serve", "orchestrator", "--verifier", "v:1", "--drafts", "d:1,oops"), "(port 1-65535): 'oops'"),
    (("generate", "hi", "--orchestrator", "a:1,b"), "(port 1-65535): 'b'"),
    (("generate", "hi", "--orchestrator", "127.0.0.1:0"), "(port 1-65535): '127.0.0.1:0'"),  # nothing to call
    (("generate", "hi", "--burst-max", "abc"), "--burst-max: not an integer: 'abc'"),
    (("generate", "hi", "--draft", "ngram", "--draft-model", "/nowhere"), "--draft ngram does not use it"),
    (("generate", "hi", "--draft", "none", "--medusa", "/nowhere"), "--medusa is for --draft medusa or medusa+ngram"),
    (("generate", "hi", "--draft", "half", "--draft-dtype", "float64"), "choose one of auto, bf16"),
    (("serve", "verifier", "--prefill-chunk", "0"), "--prefill-chunk: must be >= 1"),
    (("serve", "verifier", "--cuda-graphs", "--hf-forward", "--target-model", "/nowhere"), "cannot go with lean_forward"),
    (("generate", "hi", "--threads", "-1"), "--threads: must be >= 0"),
    (("generate", "hi", "--branch-threshold", "2"), "a probability: 0..1"),
    (("generate", "hi", "--orchestrator", "127.0.0.1:1", "--trigger", "fixed"), "--trigger sets up the embedded stack"),
    (("generate", "hi", "--draft", "model"), "--draft model needs --draft-model PATH"),
    (("generate", "hi", "--seed", str(2**64)), "--seed: must be < 18446744073709551616"),
    (("serve", "draft", "--drain-s", "nan"), "--drain-s: must be a finite number"),
    (("generate", "hi", "--tls-ca", "ca.pem"), "--tls-* flags are for a remote --orchestrator"),
    (("generate", "hi", "--orchestrator", "127.0.0.1:1", "--tls-cert", "c.pem", "--tls-key", "k.pem"),
     "--tls-cert without --tls-ca: this process's calls would go out in plaintext"),
    (("generate", "hi", "--device", "nonsense", "--max-new-tokens", "1"), "unknown device 'nonsense'"),
    # what the embedded orchestrator would refuse, refused before a model loads (this one is nowhere)
    (("generate", "", "--target-model", "/nowhere"), "prompt is empty"),
    (("generate", "hi", "--max-new-tokens", "5000", "--target-model", "/nowhere"), "over this server's limit of 4096"),
    (("generate", "hi", "--max-new-tokens", "3000000000"), "--max-new-tokens: must be < 2147483648"),
    (("generate", "hi", "--top-k", "3000000000"), "--top-k: must be < 2147483648"),
])
def test_bad_flags_fail_fast_with_one_line(args, words):
    out = cli(*args)
    assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_bad_variables_are_flag_errors():
    out = cli("serve", "draft", SPECSPLIT_IDLE_TIMEOUT="5m")
    assert out.returncode == 2 and "--idle-timeout: not a number: '5m' (from SPECSPLIT_IDLE_TIMEOUT)" in out.stderr
    # (the device and the dtype were checked only as the model loaded, without naming the variable)
    out = cli("serve", "verifier", SPECSPLIT_DEVICE="gpu")
    assert out.returncode == 2 and "--device: unknown device 'gpu'" in out.stderr and "(from SPECSPLIT_DEVICE)" in out.stderr
    out = cli("generate", "hi", SPECSPLIT_DTYPE="float64")
    assert out.returncode == 2 and "--dtype: unknown dtype 'float64'" in out.stderr and "(from SPECSPLIT_DTYPE)" in out.stderr


def test_a_variable_set_empty_is_unset(monkeypatch):
    """An env file's template leaves variables empty: SPECSPLIT_DEVICE= is the default device, not an unknown one."""
    from specsplit.flags import build_parser

    for name in ("SPECSPLIT_DEVICE", "SPECSPLIT_DTYPE", "SPECSPLIT_IDLE_TIMEOUT", "SPECSPLIT_LISTEN"):
        monkeypatch.setenv(name, "")
    args = build_parser().parse_args(["serve", "verifier"])
    assert (args.device, args.dtype, args.idle_timeout, args.listen) == ("auto", "float32", 300.0, "127.0.0.1:50052")


def test_an_orchestrator_says_when_its_session_store_does_not_answer():
    """It serves anyway (Redis may come up later) but says so at start, not at the first generation's failure; the
    URL it names has no password (its journal is no place for one)."""
    env = dict(os.environ, SPECSPLIT_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "specsplit.cli", "serve", "orchestrator", "--verifier",
                             "127.0.0.1:1", "--redis-url", f"redis://:s3cret@127.0.0.1:{free_port()}/0", "--listen",
                             "127.0.0.1:0"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        warning, serving = proc.stderr.readline(), proc.stderr.readline()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert "does not answer" in warning and "generations fail with UNAVAILABLE until it does" in warning
    assert "redis://:***@127.0.0.1" in warning and "s3cret" not in warning
    assert "serving on" in serving


def test_a_busy_port_fails_before_the_model_loads():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        out = cli("serve", "verifier", "--listen", address, "--target-model", "/nowhere")  # (never loaded)
    assert out.returncode == 2 and f"could not listen on {address}: Address already in use" in out.stderr, out.stderr


def test_services_as_separate_processes(model_dir):
    path, loaded = model_dir
    procs = []
    try:
        verifier, verifier_addr = serve("verifier", "--target-model", str(path))
        procs.append(verifier)
        draft, draft_addr = serve("draft", "--draft", "ngram")
        procs.append(draft)
        orch, orch_addr = serve("orchestrator", "--verifier", verifier_addr, "--drafts", draft_addr,
                                 "--target-model", str(path))
        procs.append(orch)
        prompt = "abcabcabcabc"
        out = cli("generate", prompt, "--orchestrator", orch_addr, "--max-new-tokens", "16", "--json",
                  "--no-chat-template")
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["token_ids"] == hf_greedy(loaded.model, result["prompt_token_ids"], 16)
        down = f"127.0.0.1:{free_port()}"  # the first orchestrator named is down: the CLI says so and goes on
        out = cli("generate", prompt, "--orchestrator", f"{down},{orch_addr}", "--max-new-tokens", "16", "--json",
                  "--no-chat-template")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["token_ids"] == result["token_ids"]
        assert f"orchestrator {down}: UNAVAILABLE" in out.stderr and f"trying {orch_addr}" in out.stderr
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            assert proc.wait(timeout=20) == 0  # SIGTERM drains and exits cleanly
    orch.log_reader.join(timeout=10)
    log = "".join(orch.log)  # and says so
    assert "stopping: no new calls (health NOT_SERVING); 0 in flight get up to 5 s" in log and "stopped after" in log


def test_services_over_tls_with_client_certificates(model_dir, tmp_path):
    """Edge to cloud over TLS: the verifier demands a client certificate (mutual TLS), the orchestrator serves
    TLS and presents its certificate to the verifier; a plaintext or unverified caller is refused."""
    path, loaded = model_dir
    pki = make_pki(tmp_path)
    own = ["--tls-cert", pki["host.pem"], "--tls-key", pki["host.key"]]
    procs = []
    try:
        verifier, verifier_addr = serve("verifier", "--target-model", str(path), *own,
                                         "--tls-client-ca", pki["ca.pem"])
        procs.append(verifier)
        lone, lone_addr = serve("orchestrator", "--verifier", verifier_addr, "--target-model", str(path),
                                 "--tls-ca", pki["ca.pem"])  # trusts the verifier, has no client certificate
        procs.append(lone)
        orch, orch_addr = serve("orchestrator", "--verifier", verifier_addr, "--target-model", str(path),
                                 "--tls-ca", pki["ca.pem"], *own)
        procs.append(orch)
        plain, plain_addr = serve("orchestrator", "--verifier", verifier_addr, "--target-model", str(path))
        procs.append(plain)  # calls its TLS verifier in plaintext
        args = ("generate", "abcabcabcabc", "--max-new-tokens", "12", "--json", "--no-chat-template")
        out = cli(*args, "--orchestrator", orch_addr)  # plaintext
        assert out.returncode != 0 and "UNAVAILABLE" in out.stderr and "pass --tls-ca" in out.stderr
        # The hang-up was the orchestrator's verifier's, not the client's: the orchestrator's error says which flag
        # mends it, and the client does not send its user after its own --tls-ca.
        out = cli(*args, "--orchestrator", plain_addr)
        assert "no verifier replica answered" in out.stderr and "give this orchestrator --tls-ca" in out.stderr
        assert "pass --tls-ca" not in out.stderr
        out = cli(*args, "--orchestrator", verifier_addr, "--tls-ca", pki["ca.pem"], "--tls-cert", pki["host.pem"],
                  "--tls-key", pki["host.key"])  # the verifier's address where the orchestrator's belongs
        assert out.returncode != 0 and "answered, but not as an orchestrator" in out.stderr
        out = cli(*args, "--orchestrator", orch_addr, "--tls-ca", pki["other.pem"])  # a root that did not sign it
        assert out.returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in out.stderr
        out = cli(*args, "--orchestrator", lone_addr)  # serves plaintext; its verifier refuses it
        assert out.returncode != 0 and "no verifier replica answered" in out.stderr and "--tls-ca" not in out.stderr
        out = cli(*args, "--orchestrator", orch_addr, "--tls-ca", pki["ca.pem"])
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["token_ids"] == hf_greedy(loaded.model, result["prompt_token_ids"], 12)
        missing = cli(*args, "--orchestrator", orch_addr, "--tls-ca", str(tmp_path / "nope.pem"))
        assert missing.returncode == 2 and "TLS ca file not found" in missing.stderr
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            assert proc.wait(timeout=20) == 0


def _random_artifacts(tmp_path, loaded, identity):
    import torch

    from specsplit.heads import FeatureDrafter, Manifest, MedusaHeads, save_artifact

    torch.manual_seed(0)
    drafter = FeatureDrafter.init_from_target(loaded.model)
    heads = MedusaHeads(loaded.model.config.hidden_size, 2)
    eagle = save_artifact(tmp_path / "eagle", drafter, Manifest("eagle", "e", identity, loaded.fingerprint,
                                                                 drafter.manifest_config()))
    medusa = save_artifact(tmp_path / "medusa", heads, Manifest("medusa", "m", identity, loaded.fingerprint,
                                                                 heads.manifest_config()))
    return eagle, medusa


def test_eagle_and_medusa_services_as_separate_processes(model_dir, tmp_path):
    from specsplit.models import target_identity

    path, loaded = model_dir
    eagle, medusa = _random_artifacts(tmp_path, loaded, target_identity(loaded))
    bad, _ = _random_artifacts(tmp_path / "bad", loaded, "params-sha256:another")
    refused = subprocess.run([sys.executable, "-m", "specsplit.cli", "serve", "draft", "--draft", "eagle",
                              "--draft-artifact", str(bad), "--target-model", str(path), "--listen", "127.0.0.1:0"],
                             capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, HF_HUB_OFFLINE="1", SPECSPLIT_THREADS="1"))
    assert refused.returncode == 2 and "trained for target params-sha256:another" in refused.stderr
    procs = []
    try:
        verifier, verifier_addr = serve("verifier", "--target-model", str(path), "--medusa", str(medusa))
        procs.append(verifier)
        draft, draft_addr = serve("draft", "--draft", "eagle", "--draft-artifact", str(eagle),
                                   "--target-model", str(path))
        procs.append(draft)
        orch, orch_addr = serve("orchestrator", "--verifier", verifier_addr, "--drafts", draft_addr,
                                 "--target-model", str(path))
        procs.append(orch)
        for draft_choice in ("eagle", "medusa"):
            out = cli("generate", "abcabcabcabc", "--orchestrator", orch_addr, "--max-new-tokens", "16", "--json",
                      "--no-chat-template", "--draft", draft_choice)
            assert out.returncode == 0, out.stderr
            result = json.loads(out.stdout)
            assert result["token_ids"] == hf_greedy(loaded.model, result["prompt_token_ids"], 16)
            hidden = loaded.model.config.hidden_size
            cached = len(result["prompt_token_ids"]) + len(result["token_ids"]) - 1  # every position cached at the end
            expected_bytes = cached * hidden * 2 if draft_choice == "eagle" else 0
            assert result["feature_bytes"] == expected_bytes
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            assert proc.wait(timeout=20) == 0


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_draft_process_interrupted_while_it_starts_ends_with_its_parent():
    """Ctrl-C while the draft child still starts: the parent stops it (and reaps it) before exiting; it went on to load
    its model and serve, until its parent watch saw the parent gone (tests/slow: the parent killed)."""
    parent, child = signal_while_a_draft_starts(signal.SIGINT, ["--draft", "ngram"])
    assert "KeyboardInterrupt" in parent.stderr.read() and parent.wait(60) != 0
    assert not running(child)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_draft_process_ends_with_the_process_that_started_it():
    """`specsplit generate` runs a model draft as a child service; killed (SIGKILL: no cleanup runs), it leaves no
    draft process behind with its model loaded: the child notices its parent is gone and stops."""
    import time

    script = ("import time; from specsplit.launch import DraftProcess; "
              "p = DraftProcess(['--draft', 'ngram']); print(p.proc.pid, flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert running(child)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(child)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_on_a_resumable_generate_cancels_its_session(model_dir, sig, code):
    """`generate --orchestrator A,B` makes a resumable session; interrupted (Ctrl-C) or terminated, the CLI cancels it
    rather than leave it detached, its cache held on the verifier, for a resume that never comes."""
    import time

    from specsplit.rpc import RemoteVerifier
    from tiny import EOS_ID, wait_for

    path, loaded = model_dir
    # a prompt whose greedy continuation runs long without the end-of-text token, so that it is still generating
    prompt = next(p for p in ("abcabcabcabc", "hello world", "the quick brown fox", "0123456789")
                  if EOS_ID not in hf_greedy(loaded.model, list(loaded.tokenizer(p)["input_ids"]), 400))
    procs = []
    try:
        verifier, verifier_addr = serve("verifier", "--target-model", str(path))
        procs.append(verifier)
        # (one token a round: the tiny model would decode all 400 in bursts within a quarter second, before the signal)
        orch, orch_addr = serve("orchestrator", "--verifier", verifier_addr, "--target-model", str(path), "--burst-max",
                                "1")
        procs.append(orch)
        env = dict(os.environ, HF_HUB_OFFLINE="1", SPECSPLIT_THREADS="1")
        # (SIGINT as a terminal delivers it: a test run started in the background inherits it ignored)
        client = subprocess.Popen([sys.executable, "-m", "specsplit.cli", "generate", prompt, "--orchestrator",
                                   f"{orch_addr},{orch_addr}", "--max-new-tokens", "400", "--no-chat-template"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        client.stdout.read(1)  # it is generating
        client.send_signal(sig)
        assert client.wait(timeout=30) == code, client.stderr.read()
        start = time.monotonic()
        assert wait_for(lambda: RemoteVerifier(verifier_addr).info(timeout=5).num_sessions == 0, timeout=5)
        assert time.monotonic() - start < 5
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=20)


def test_announce_s_says_not_serving_while_calls_are_still_taken():
    """SIGTERM with --announce-s: health turns NOT_SERVING at once, new calls are still answered for that long (a load
    balancer polling health stops sending before any call is refused), then the drain, and exit 0."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specsplit.rpc import RemoteDraft
    from tiny import wait_for

    proc, address = serve("draft", "--draft", "ngram", "--announce-s", "5", "--drain-s", "1")
    try:
        channel = grpc.insecure_channel(address)
        health = health_pb2_grpc.HealthStub(channel)
        status = lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=2).status  # noqa: E731
        assert status() == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING)
        assert RemoteDraft(address).info(timeout=5).max_nodes > 0  # a new call, still answered
        assert proc.poll() is None  # (still announcing)
        channel.close()
    finally:
        proc.terminate()
    assert proc.wait(timeout=60) == 0
    proc.log_reader.join(timeout=10)
    assert "health NOT_SERVING; new calls still taken for 5 s (--announce-s)" in "".join(proc.log)
