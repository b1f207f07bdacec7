"""deploy/ as written: each systemd unit's ExecStart, run with its Environment= and EnvironmentFile= as systemd
would (``$VAR`` split into words), as three separate processes with mutual TLS from certificates made by
deploy/make-certs.sh and a real redis-server; only hosts, ports and paths are swapped for this machine's. Greedy
tokens equal HF greedy; SIGTERM stops every service cleanly within the unit's TimeoutStopSec."""

import configparser
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import threading

import pytest

from pki import make_pki
from tiny import hf_greedy

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"
BINARY = "/opt/specsplit/.venv/bin/specsplit"  # where deploy/README.md installs it
SERVICES = ("verifier", "draft", "orchestrator")


def read_unit(service: str) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read_string((DEPLOY / "systemd" / f"specsplit-{service}.service").read_text())
    return unit


def read_env_file(path: pathlib.Path) -> dict[str, str]:
    """systemd's EnvironmentFile: VAR=value lines; whole-line comments."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            assert "#" not in value, f"{path.name}: a trailing comment would become part of {name}'s value"
            env[name] = value
    return env


def service_env(service: str) -> dict[str, str]:
    """Environment= first, then the EnvironmentFile (which systemd lets override it)."""
    unit = read_unit(service)["Service"]
    env = dict(pair.split("=", 1) for pair in shlex.split(unit["Environment"]))
    assert unit["EnvironmentFile"] == f"/etc/specsplit/{service}.env"
    env.update(read_env_file(DEPLOY / "env" / f"{service}.env"))
    return env


def exec_argv(service: str, env: dict[str, str]) -> list[str]:
    """ExecStart with ``$VAR`` split on whitespace and ``${VAR}`` as one word, as systemd expands them."""
    words = []
    for word in shlex.split(read_unit(service)["Service"]["ExecStart"]):
        if m := re.fullmatch(r"\$(\w+)", word):
            words += env.get(m.group(1), "").split()
        else:
            words.append(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word))
    assert words[:3] == [BINARY, "serve", service]
    return [sys.executable, "-m", "specsplit.cli", *words[1:]]


def start(service: str, overrides: dict[str, str]) -> tuple[subprocess.Popen, str]:
    env = service_env(service)
    missing = set(overrides) - set(env) - {"SPECSPLIT_VERIFIERS", "SPECSPLIT_DRAFTS"}
    assert not missing, f"deploy/env/{service}.env no longer sets {missing}"
    env.update(overrides)
    proc = subprocess.Popen(exec_argv(service, env), stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env, "SPECSPLIT_THREADS": "1"})
    line = proc.stderr.readline()
    assert "(TLS) serving on" in line, line + proc.stderr.read()
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # a chatty child never blocks on a full pipe
    return proc, line.rsplit(" ", 1)[1].strip()


def test_the_units_start_the_stack_as_deployed(model_dir, tmp_path, redis_server):
    path, loaded = model_dir
    pki = make_pki(tmp_path)
    here = {"SPECSPLIT_LISTEN": "127.0.0.1:0", "SPECSPLIT_TARGET_MODEL": str(path), "HF_HOME": str(tmp_path / "hf"),
            "SPECSPLIT_CACHE": str(tmp_path / "cache")}
    host = {"SPECSPLIT_TLS_CERT": pki["host.pem"], "SPECSPLIT_TLS_KEY": pki["host.key"]}
    procs = []
    try:
        verifier, verifier_addr = start("verifier", {**here, **host, "SPECSPLIT_DEVICE": "cpu",
                                                     "SPECSPLIT_TLS_CLIENT_CA": pki["ca.pem"]})
        procs.append(verifier)
        draft, draft_addr = start("draft", {**here, **host})
        procs.append(draft)
        orch, orch_addr = start("orchestrator", {**here, **host, "SPECSPLIT_TLS_CA": pki["ca.pem"],
                                                 "SPECSPLIT_VERIFIERS": verifier_addr, "SPECSPLIT_DRAFTS": draft_addr,
                                                 "SPECSPLIT_REDIS_URL": redis_server.url})
        procs.append(orch)
        out = subprocess.run([sys.executable, "-m", "specsplit.cli", "generate", "abcabcabcabc", "--orchestrator",
                              orch_addr, "--tls-ca", pki["ca.pem"], "--max-new-tokens", "16", "--json",
                              "--no-chat-template"], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["token_ids"] == hf_greedy(loaded.model, result["prompt_token_ids"], 16)
        assert result["num_draft_tokens"] > 0, result  # the half+ngram draft of draft.env took part
    finally:
        for proc in procs:
            proc.terminate()  # KillSignal=SIGTERM
    for service, proc in zip(SERVICES, procs):
        stop_s = float(read_unit(service)["Service"]["TimeoutStopSec"])
        assert proc.wait(timeout=stop_s) == 0


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize("service", SERVICES)
def test_systemd_accepts_the_units(service, tmp_path):
    """``systemd-analyze verify`` on each unit, its binary and EnvironmentFile pointed at this checkout's."""
    specsplit = pathlib.Path(sys.executable).with_name("specsplit")
    assert specsplit.exists(), "the project's console script (pip install -e .)"
    text = (DEPLOY / "systemd" / f"specsplit-{service}.service").read_text()
    text = text.replace(BINARY, str(specsplit)).replace(f"/etc/specsplit/{service}.env",
                                                         str(DEPLOY / "env" / f"{service}.env"))
    unit = tmp_path / f"specsplit-{service}.service"
    unit.write_text(text)
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "specsplit" not in out.stderr, out.stderr
