"""Starting the three services, alone (``specsplit serve``) or all in one process (the embedded default)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field


from specsplit.config import PARENT_PID_ENV, DraftConfig, OrchestratorConfig, VerifierConfig
from specsplit.errors import InvalidArgument
from specsplit.models import LoadedModel, load_model, load_tokenizer
from specsplit.serving import CLIENT_MESSAGE_BYTES, Server

log = logging.getLogger(__name__)


def start_verifier(loaded: LoadedModel, address: str = "127.0.0.1:0", config: VerifierConfig | None = None,
                   medusa=None) -> Server:
    """medusa: a ``verifier_service.medusa.MedusaProposer`` for self-speculation (None: none)."""
    from verifier_service.engine import TargetEngine
    from verifier_service.servicer import VerifierServicer, registration

    engine = TargetEngine(loaded, config, medusa)
    # Every session may have a Prefill or Verify waiting on the batch: one server thread each, plus spares.
    server = Server(address, [registration(VerifierServicer(engine))], max_workers=engine.config.max_sessions + 16)
    server.core = engine
    return server



def make_proposer(kind: str, draft_model: str | None = None, device: str | None = "auto", dtype: str = "float32",
                  config: DraftConfig | None = None, loaded: LoadedModel | None = None, artifact: str | None = None,
                  target_model: str | None = None, draft_dtype: str | None = None):
    """kind: "ngram", "model" (a draft model path, or an already loaded model), "half" (the target itself,
    ``target_model``, at ``draft_dtype``, default: the fastest measured here), "eagle" or "eagle+ngram" (an eagle artifact for
    ``target_model``; default: the shipped one for it). ``draft_dtype``: the draft model's dtype when it is
    not ``dtype``."""
    from draft_service.feature_proposer import load_feature_proposer
    from draft_service.ngram import NgramProposer
    from draft_service.proposers import CombinedProposer, ModelProposer

    if kind == "ngram":
        return NgramProposer(config)
    if kind == "eagle":
        return load_feature_proposer(artifact, target_model, config)
    if kind == "eagle+ngram":
        return CombinedProposer(load_feature_proposer(artifact, target_model, config), NgramProposer(config))
    if kind in ("half", "half+ngram"):
        # The target's own weights at a cheaper precision: no training, and agreeing with the float32 target's
        # greedy tokens almost always (bench/results/drafters_half.md). Which dtype is cheapest depends on the
        # machine, so it is measured at start (draft_service/dtypes.py) unless --draft-dtype names one.
        # Verification stays exact on the target in its own dtype.
        from draft_service.dtypes import calibrate, calibration_file, parse_draft_dtype

        loaded = loaded or load_model(target_model, device, "float32")
        config = config or DraftConfig()
        remember = calibration_file() if config.remember_calibration else None
        try:
            models, calibration = calibrate(loaded.model, config.threads, step_dtypes=parse_draft_dtype(draft_dtype),
                                            remember=remember)
        except ValueError as err:  # int8 or int4 where it cannot run
            raise InvalidArgument(f"--draft-dtype {draft_dtype}: {err}") from None
        loaded = dataclasses.replace(loaded, model=models[calibration.step_dtype])
        prefill = models[calibration.many_dtype] if calibration.many_dtype != calibration.step_dtype else None
        proposer = ModelProposer(loaded, config, name=kind, prefill_model=prefill, copies=kind == "half+ngram",
                                 prefill_from=calibration.many_from())
        proposer.calibration = calibration
        return proposer
    if kind == "model":
        if draft_dtype in ("int8", "int4"):
            raise InvalidArgument(f"--draft-dtype {draft_dtype} is for --draft half (its lean forward); a --draft model "
                                  "runs in float16, bfloat16 or float32")
        if loaded is None:
            if not draft_model:
                raise InvalidArgument("--draft model needs --draft-model PATH (a local Hugging Face causal LM)")
            loaded = load_model(draft_model, device, draft_dtype or dtype)
        return ModelProposer(loaded, config)
    raise InvalidArgument(f"unknown drafter {kind!r}; choose ngram, model, half, half+ngram, eagle or eagle+ngram")


def start_draft(proposer, address: str = "127.0.0.1:0", max_nodes: int = 64, model_name: str = "",
                idle_timeout_s: float = 300.0) -> Server:
    from draft_service.drafter import Drafter
    from draft_service.servicer import DraftServicer, registration

    drafter = Drafter(proposer, max_nodes)
    server = Server(address, [registration(DraftServicer(drafter, model_name, idle_timeout_s))])
    server.core = drafter
    return server


def start_orchestrator(verifier_addresses: str | list[str], draft_addresses: list[str], tokenizer,
                       address: str = "127.0.0.1:0", config: OrchestratorConfig | None = None,
                       store=None) -> Server:
    """verifier_addresses: one address or the replicas'; store: a SessionStore (default: in this process)."""
    from orchestrator.generation import Orchestrator
    from orchestrator.servicer import OrchestratorServicer, registration
    from specsplit.rpc import RemoteDraft, RemoteVerifier

    if isinstance(verifier_addresses, str):
        verifier_addresses = [verifier_addresses]
    orchestrator = Orchestrator([RemoteVerifier(a) for a in verifier_addresses],
                                [RemoteDraft(a) for a in draft_addresses], tokenizer, config, store)
    max_streams = (config or OrchestratorConfig()).max_streams
    server = Server(address, [registration(OrchestratorServicer(orchestrator))], max_workers=max_streams + 8,
                    max_receive_bytes=CLIENT_MESSAGE_BYTES)  # (its port is the public one)
    server.core = orchestrator
    orchestrator.replicas.watch(server.set_serving)  # no verifier replica up: it cannot serve, so it says so
    return server




class DraftProcess:
    """A draft service in a child process (``specsplit serve draft ARGS``) on a loopback port.

    A model draft beside the verifier in one Python process fights it for the interpreter lock while both run
    forwards at once (provisional drafting under a verification), which undoes the overlap: the half draft
    ran the chat prompts at 19 tokens/s in one process against 36 with the draft in its own process (2-core
    CPU). Its own process is also what an edge box runs. ``address`` is known once it serves.
    """

    def __init__(self, args: list[str], timeout_s: float = 300.0):
        self.threads = int(args[args.index("--threads") + 1]) if "--threads" in args else 0  # its torch threads
        from specsplit.tls import ENV as TLS_ENV

        # Plaintext on loopback, as the stack's other servers (a deployment's SPECSPLIT_TLS_* are not for it).
        env = {k: v for k, v in os.environ.items() if k not in TLS_ENV.values()} | {
            "HF_HUB_OFFLINE": "1", PARENT_PID_ENV: str(os.getpid())}
        # Prometheus serves on one port per process, which this process holds already: the child exports none (an
        # OTLP exporter it inherits; two on one port, it would fail to start).
        metrics = [m.strip() for m in env.get("OTEL_METRICS_EXPORTER", "").split(",") if m.strip()]
        if "prometheus" in metrics:
            env["OTEL_METRICS_EXPORTER"] = ",".join(m for m in metrics if m != "prometheus") or "none"
        self.proc = subprocess.Popen([sys.executable, "-m", "specsplit.cli", "serve", "draft", "--listen",
                                      "127.0.0.1:0", *args], stderr=subprocess.PIPE, text=True, env=env)
        try:
            started = self._wait_serving(timeout_s)
        except BaseException:  # Ctrl-C (or SIGTERM) while it starts: it does not go on loading its model alone
            self.close()
            raise
        if not started or not self.address:
            self.close()
            raise InvalidArgument("the draft service process did not start: " + " | ".join(self._log))

    def _wait_serving(self, timeout_s: float) -> bool:
        """Whether it serves within ``timeout_s`` (``address`` then says where)."""
        self._log: collections.deque[str] = collections.deque(maxlen=40)  # its last stderr lines, for errors
        ready = threading.Event()
        self.address = ""

        def drain() -> None:  # read stderr to the end, so the child never blocks on a full pipe
            for line in self.proc.stderr:
                self._log.append(line.rstrip())
                if not self.address and "serving on" in line:
                    self.address = line.rsplit(" ", 1)[1].strip()
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True, name="draft-process-log").start()
        return ready.wait(timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Stack:
    """Draft(s), verifier replica(s) and orchestrator on loopback ephemeral ports in this process (real gRPC)."""

    verifiers: list[Server]
    drafts: list[Server]
    orchestrator: Server
    target: LoadedModel
    processes: list = field(default_factory=list)  # DraftProcess children (their drafts come after ``drafts``)

    @property
    def address(self) -> str:
        return self.orchestrator.address

    @property
    def verifier(self) -> Server:
        return self.verifiers[0]

    @property
    def verifier_engine(self):
        return self.verifier.core

    def draft_sessions(self) -> int:
        return sum(d.core.num_sessions() for d in self.drafts)

    def verifier_sessions(self) -> int:
        return sum(v.core.num_sessions() for v in self.verifiers)

    def close(self) -> None:
        self.orchestrator.stop(grace=1.0)
        self.orchestrator.core.close()
        for server in [*self.drafts, *self.verifiers]:
            server.stop(grace=1.0)
        for server in self.verifiers:
            server.core.close()  # each verifier's model thread
        for process in self.processes:
            process.close()

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def colocated_threads(draft_threads: int) -> int:
    """Torch threads for a CPU verifier whose draft runs on the same cores: the cores the draft leaves.

    A 2-thread verifier beside a 1-thread draft on 2 cores waits at every OpenMP barrier for the thread the
    draft displaced: a 7-token SmolLM2 verification took 382 ms that way, 279 ms on 1 thread, 214 / 224 ms
    on 2 / 1 threads with the draft idle (AVX2 EPYC, /tmp/probe/ver.py of the 2026-11-30 fourth session),
    and the embedded stack ran two chat prompts in 7.0 s instead of 8.4 s (means of two runs each)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - draft_threads)


def start_stack(target: LoadedModel, proposers: list, verifier_config: VerifierConfig | None = None,
                orchestrator_config: OrchestratorConfig | None = None, tokenizer=None, replicas: int = 1,
                store=None, medusa=None, processes: list | None = None) -> Stack:
    """proposers: in "auto" preference order (may be empty: target-only); replicas: verifier replicas
    (sharing the model's weights); store: a SessionStore (default: in this process); medusa: the
    verifiers' Medusa heads (a MedusaProposer), for --draft medusa; processes: DraftProcess children, whose
    drafts follow the proposers' (the stack closes them)."""
    processes = list(processes or [])
    if processes and target.model.device.type == "cpu" and not (verifier_config and verifier_config.threads):
        verifier_config = dataclasses.replace(verifier_config or VerifierConfig(),
                                              threads=colocated_threads(sum(p.threads or 1 for p in processes)))
    verifiers = [start_verifier(target, config=verifier_config, medusa=medusa) for _ in range(replicas)]
    drafts = [start_draft(p, model_name=getattr(getattr(p, "loaded", None), "name", "") or getattr(p, "artifact", ""))
              for p in proposers]
    orchestrator = start_orchestrator([v.address for v in verifiers],
                                      [d.address for d in drafts] + [p.address for p in processes],
                                      tokenizer or target.tokenizer, config=orchestrator_config, store=store)
    return Stack(verifiers, drafts, orchestrator, target, processes)


def default_proposers(draft: str, draft_model: str | None, device: str | None, dtype: str,
                      config: DraftConfig | None = None, artifact: str | None = None, target: LoadedModel | None = None,
                      target_model: str | None = None, draft_dtype: str | None = None) -> list:
    """The drafters behind --draft (auto: a draft model if one was given, else see ``auto_draft``).
    medusa runs in the verifier (no draft service); medusa+ngram adds an n-gram lookup draft."""
    if draft == "auto" and not draft_model:
        draft = auto_draft(target) if target is not None else "ngram"
    if draft in ("none", "medusa"):
        return []
    if draft in ("ngram", "medusa+ngram"):
        return [make_proposer("ngram", config=config)]
    if draft in ("eagle", "eagle+ngram"):
        return [make_proposer(draft, config=config, artifact=artifact, target_model=target_model)]
    if draft in ("half", "half+ngram"):
        return [make_proposer(draft, device=device, config=config, target_model=target_model, draft_dtype=draft_dtype)]
    if draft in ("model", "auto"):
        return [make_proposer("model", draft_model, device, dtype, config, draft_dtype=draft_dtype)]
    raise InvalidArgument(f"unknown --draft {draft!r}; choose auto, ngram, model, half, half+ngram, eagle, eagle+ngram, medusa, "
                          "medusa+ngram or none")


def auto_draft(target: LoadedModel) -> str:
    """--draft auto without a draft model: the best measured way to draft for this target.

    A shipped artifact (eagle or medusa, or the manifest of a half draft measured for the target) is chosen,
    merged with n-gram lookup (which keeps the long copied spans of code edits), only when its manifest says
    that, measured side by side in bench/drafters.py, ``<kind>+ngram`` beat n-gram lookup alone
    (``measured.speedup_vs_ngram`` > 1, the geometric mean over the bench prompts); the higher one wins.
    Otherwise plain n-gram lookup.
    """
    from specsplit.heads import read_manifest

    best, best_speedup = "ngram", 1.0
    for kind in ("eagle", "medusa", "half"):
        path = shipped_artifact(kind, target)
        speedup = float(read_manifest(path).measured.get("speedup_vs_ngram", 0.0)) if path is not None else 0.0
        if speedup > best_speedup:
            best, best_speedup = f"{kind}+ngram", speedup
    return best


def shipped_artifact(kind: str, target: LoadedModel):
    """The shipped artifact of ``kind`` trained for ``target`` with the best measured tau (None: none ships)."""
    from specsplit.models import target_identity
    from verifier_service.medusa import find_artifact

    return find_artifact(kind, target_identity(target), target.fingerprint)


__all__ = ["Stack", "DraftProcess", "start_stack", "start_verifier", "start_draft", "start_orchestrator", "make_proposer",
           "default_proposers", "load_model", "load_tokenizer"]
