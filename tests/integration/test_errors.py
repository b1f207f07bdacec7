"""Bad input gets the right gRPC status and a message a person can act on; the services stay up."""

import re
import time

import grpc
import pytest

from specsplit.client import Client
from specsplit.config import OrchestratorConfig
from specsplit.errors import InvalidArgument
from specsplit.launch import start_draft, start_orchestrator, start_stack, start_verifier
from specsplit.rpc import RemoteDraft, RemoteVerifier
from specsplit.tree import TokenTree
from draft_service.ngram import NgramProposer
from draft_service.proposers import ModelProposer
from redis_server import free_port
from tiny import hf_greedy, tiny_loaded, tiny_tokenizer, wait_for

PROMPT = [258, 72, 101, 108, 108, 111]


def code_of(call):
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def generate(stack, **kwargs):
    return list(Client(stack.address).generate(**kwargs))


def generate_unchecked(stack, **kwargs):
    """A Generate call as a client that checks nothing sends it (the SDK refuses some of these itself)."""
    from specsplit.rpc import generate_request_to_pb
    from specsplit.v1 import orchestrator_pb2_grpc

    args = dict(prompt="", messages=None, prompt_token_ids=None, max_new_tokens=None, temperature=0.0, top_k=0,
                top_p=1.0, seed=None, stop=(), draft="auto", chat_template=True, session_id="") | kwargs
    with grpc.insecure_channel(stack.address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        return list(stub.Generate(generate_request_to_pb(**args), timeout=60))


@pytest.mark.parametrize("kwargs, code, words", [
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    (dict(prompt_token_ids=list(range(40, 296))), grpc.StatusCode.INVALID_ARGUMENT, "context holds 256"),
    (dict(prompt="hi", max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be > 0"),
    (dict(prompt="hi", max_new_tokens=-3), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be > 0"),
    (dict(prompt="hi", max_new_tokens=101), grpc.StatusCode.INVALID_ARGUMENT, "over this server's limit of 100"),
    (dict(prompt="hi", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0"),
    (dict(prompt="hi", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in [0, 1]"),
    (dict(prompt="hi", top_k=-1), grpc.StatusCode.INVALID_ARGUMENT, "top_k must be >= 0"),
    (dict(prompt="hi", draft="lookahead"), grpc.StatusCode.INVALID_ARGUMENT, "unknown draft"),
    (dict(prompt="hi", draft="model"), grpc.StatusCode.INVALID_ARGUMENT, "no 'model' draft service"),
    (dict(prompt="hi", prompt_token_ids=[1, 2]), grpc.StatusCode.INVALID_ARGUMENT, "exactly one of"),
    (dict(prompt_token_ids=[10**6]), grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
    # What one request may carry (before: each was taken, and held memory or the interpreter lock; a review's runs)
    (dict(prompt="hi", stop=["x"] * 33), grpc.StatusCode.INVALID_ARGUMENT, "at most 32 stop strings"),
    (dict(prompt="hi", stop=["x" * 257]), grpc.StatusCode.INVALID_ARGUMENT, "of at most 256 characters"),
    (dict(prompt="hi", session_id="s" * 257), grpc.StatusCode.INVALID_ARGUMENT, "session_id must be at most 256"),
    (dict(prompt="hi", session_id="a\nb"), grpc.StatusCode.INVALID_ARGUMENT, "printable characters"),
    (dict(prompt="x" * (256 * 11 + 1)), grpc.StatusCode.INVALID_ARGUMENT, "cannot fit the model's context of 256"),
    (dict(messages=[{"role": "user", "content": "x"}] * 256), grpc.StatusCode.INVALID_ARGUMENT, "cannot fit"),
    (dict(prompt="hi", temperature=1e-45), grpc.StatusCode.INVALID_ARGUMENT, "too small to sample at"),
    (dict(prompt="x" * (5 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),  # (the 4 MB message cap)
])
def test_generate_rejects_bad_requests(stack, kwargs, code, words):
    got, details = code_of(lambda: generate_unchecked(stack, **kwargs))
    assert got == code
    assert words in details


def test_verifier_errors(stack):
    verifier = RemoteVerifier(stack.verifier.address)
    code, details = code_of(lambda: verifier.verify("nope", TokenTree.empty(), 1, 0, timeout=5))
    assert code == grpc.StatusCode.NOT_FOUND and "unknown session 'nope'" in details
    code, details = code_of(lambda: verifier.prefill("s0", [], timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt is empty" in details
    code, details = code_of(lambda: verifier.prefill("s0", [1, 5000], timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in details

    assert verifier.prefill("s1", PROMPT, timeout=5) == len(PROMPT)
    code, details = code_of(lambda: verifier.prefill("s1", PROMPT, timeout=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "already exists" in details
    bad_trees = {
        "parent index must be -1": TokenTree((1, 2), (-1, 1)),
        "outside the vocabulary": TokenTree((1, 999), (-1, 0)),
        "same length": TokenTree((1, 2), (-1,)),
    }
    for words, tree in bad_trees.items():
        code, details = code_of(lambda: verifier.verify("s1", tree, len(PROMPT), 0, timeout=5))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and words in details
    code, details = code_of(lambda: verifier.verify("s1", TokenTree.chain([1] * 17), len(PROMPT), 0, timeout=5))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 16" in details
    # A stale (or repeated) Verify is refused and changes nothing.
    verdict, _ = verifier.verify("s1", TokenTree.empty(), len(PROMPT), 0, timeout=5)
    code, details = code_of(lambda: verifier.verify("s1", TokenTree.empty(), len(PROMPT), 0, timeout=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "stale or repeated" in details
    verdict2, timing = verifier.verify("s1", TokenTree.empty(), len(PROMPT) + 1, 0, timeout=5)
    assert 0 < timing.busy_ms <= timing.verify_ms < timing.call_ms  # the verifier's work, its time, the caller's
    target = stack.target
    assert [verdict.next_token_id, verdict2.next_token_id] == hf_greedy(target.model, PROMPT, 2)
    assert verifier.release("s1", timeout=5) is True
    assert verifier.release("s1", timeout=5) is False


def test_session_cap_is_resource_exhausted(stack, caplog):
    verifier = RemoteVerifier(stack.verifier.address)
    for i in range(4):
        verifier.prefill(f"cap{i}", PROMPT, timeout=5)
    try:
        code, details = code_of(lambda: verifier.prefill("cap4", PROMPT, timeout=5))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions=4" in details
        assert "Exception serializing" not in caplog.text  # a refusal is not logged as a crash
    finally:
        for i in range(4):
            verifier.release(f"cap{i}", timeout=5)


def test_draft_errors(stack):
    draft = RemoteDraft(stack.drafts[0].address)
    code, details = code_of(lambda: draft.propose("nope", [], 3, 4, timeout=5))
    assert code == grpc.StatusCode.NOT_FOUND and "StartSession first" in details
    draft.start("d1", PROMPT, "", timeout=5)
    code, details = code_of(lambda: draft.propose("d1", [1], len(PROMPT) + 5, 4, timeout=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "not the" in details
    code, details = code_of(lambda: draft.start("d2", [], "", timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_tokenizer_mismatch_is_refused(target):
    other = tiny_loaded(seed=5, tokenizer=tiny_tokenizer(extra="-other"))
    assert other.fingerprint != target.fingerprint
    server = start_draft(ModelProposer(other))
    try:
        draft = RemoteDraft(server.address)
        code, details = code_of(lambda: draft.start("m1", PROMPT, target.fingerprint, timeout=5))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "tokenizer mismatch" in details
    finally:
        server.stop(0)
    with start_stack(target, [ModelProposer(other)]) as stack:
        code, details = code_of(lambda: generate(stack, prompt="hello", max_new_tokens=4))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "tokenizer mismatch" in details
        assert stack.verifier  # and nothing leaked: the verifier released the session
        verifier = RemoteVerifier(stack.verifier.address)
        assert verifier.release("anything", timeout=5) is False


def test_a_draft_kind_asked_while_a_draft_service_is_silent_is_unavailable(target):
    """--draft model while a configured draft service has not said what it drafts (not up yet, or too slow to answer):
    UNAVAILABLE, retryable, naming it (it was INVALID_ARGUMENT "no 'model' draft service is configured", a refusal
    to give up on); a kind another service has says so as before."""
    silent = f"127.0.0.1:{free_port()}"  # nothing listens there
    verifier, ngram = start_verifier(target), start_draft(NgramProposer())
    orchestrator = start_orchestrator([verifier.address], [ngram.address, silent], target.tokenizer,
                                      config=OrchestratorConfig(draft_timeout_s=0.5))
    try:
        def asks(draft):
            return lambda: list(Client(orchestrator.address).generate(prompt_token_ids=PROMPT, max_new_tokens=4,
                                                                      draft=draft))
        code, details = code_of(asks("model"))
        assert code == grpc.StatusCode.UNAVAILABLE and silent in details and "retry" in details
        chunks = asks("ngram")()
        assert [t for c in chunks for t in c.token_ids] == hf_greedy(target.model, PROMPT, 4)
    finally:
        for server in (orchestrator, ngram, verifier):
            server.stop(0)


def test_service_stays_up_after_errors(stack):
    for kwargs in [dict(prompt=""), dict(prompt="x", max_new_tokens=0)]:
        with pytest.raises(grpc.RpcError):
            generate_unchecked(stack, **kwargs)
    chunks = generate(stack, prompt_token_ids=PROMPT, max_new_tokens=8)
    assert [t for c in chunks for t in c.token_ids] == hf_greedy(stack.target.model, PROMPT, 8)


def test_a_resumable_generation_fails_at_once_on_a_bad_request(stack):
    """A request the verifier refuses is INVALID_ARGUMENT to the client, which does not retry it."""
    import time

    start = time.monotonic()
    with Client(stack.address) as client:
        stream = client.generate(prompt_token_ids=[10**6], max_new_tokens=4, resume=True)
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and stream.reconnects == 0
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("kwargs, words", [
    (dict(messages=[{"role": "user"}]), "a chat message is a dict with str 'role' and 'content'"),
    (dict(messages=["hi"]), "a chat message is a dict"),
    (dict(prompt="hi", seed=-1), "seed must be in [0, 2**64)"),
    (dict(prompt="hi", max_new_tokens=-1), "max_new_tokens must be > 0"),  # (these were INVALID_ARGUMENT from a
    (dict(prompt="hi", temperature=-0.5), "temperature must be >= 0"),  # server, or DEADLINE_EXCEEDED at once)
    (dict(prompt="hi", temperature=1e-9), "too small to sample at"),
    (dict(prompt="hi", top_p=1.5), "top_p must be in [0, 1]"),
    (dict(prompt="hi", top_k=-1), "top_k must be >= 0"),
    (dict(prompt="hi", timeout=-1), "timeout must be > 0"),
])
def test_the_sdk_refuses_malformed_requests_before_sending(kwargs, words):
    import asyncio

    from specsplit.client import AsyncClient

    with Client("127.0.0.1:1") as client, pytest.raises(ValueError) as info:  # nothing listens there
        client.generate(**kwargs)
    assert words in str(info.value)

    async def first():
        async for chunk in AsyncClient("127.0.0.1:1").generate(**kwargs):
            return chunk

    with pytest.raises(ValueError, match=re.escape(words)):
        asyncio.run(first())


@pytest.mark.parametrize("address, words", [
    (50051, "an orchestrator address is a HOST:PORT string, got 50051"),  # (was a TypeError from list())
    ([], "no orchestrator address given"),
    ("http://orch:50051", "without a URL scheme"),
])
def test_the_sdk_refuses_a_malformed_address(address, words):
    from specsplit.client import AsyncClient

    for make in (Client, AsyncClient):
        with pytest.raises(ValueError if address == [] else InvalidArgument, match=re.escape(words)):
            make(address)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        Client("127.0.0.1:1", timeout=0)


def test_one_stop_string_given_as_a_string_is_one_stop_string():
    """generate(..., stop="xyz") sends the stop string "xyz" (it sent "x", "y" and "z": a stop at any of them)."""
    from specsplit.rpc import generate_request_to_pb

    request = generate_request_to_pb("hi", None, None, 4, 0.0, 0, 1.0, None, "xyz", "auto", True, "")
    assert list(request.stop) == ["xyz"]


def test_a_port_in_use_is_refused(stack):
    """A second server on a port in use fails to start (gRPC's SO_REUSEPORT would have shared it)."""
    from specsplit.errors import Unavailable
    from specsplit.serving import Server

    with pytest.raises(Unavailable, match="could not listen on"):
        Server(stack.address, [])


def test_a_verifier_error_mid_generation_keeps_its_status(stack, monkeypatch):
    """An error of the verifier's that the orchestrator does not handle (here RESOURCE_EXHAUSTED from Verify) reaches
    the client with its own status, named as downstream, not as UNKNOWN (which a resuming client takes for a broken
    connection)."""
    from specsplit.errors import ResourceExhausted

    def busy(*args, **kwargs):
        raise ResourceExhausted("the verifier is busy")

    monkeypatch.setattr(stack.verifier_engine, "verify", busy)
    code, details = code_of(lambda: generate(stack, prompt_token_ids=PROMPT, max_new_tokens=8))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "downstream" in details and "busy" in details, details


def test_generations_past_max_streams_are_refused_at_once(target, monkeypatch):
    """An orchestrator runs at most max_streams generations; one more is RESOURCE_EXHAUSTED at once (before, it waited
    for a server thread with no word), and once one ends a new one runs."""
    import time

    from specsplit.config import OrchestratorConfig

    with start_stack(target, [], orchestrator_config=OrchestratorConfig(max_streams=2)) as stack:
        verify = stack.verifier_engine.verify

        def slow_verify(*args, **kwargs):  # so that the two generations are still running when the third comes
            time.sleep(0.05)
            return verify(*args, **kwargs)

        monkeypatch.setattr(stack.verifier_engine, "verify", slow_verify)
        with Client(stack.address) as client:
            running = [client.generate(prompt_token_ids=PROMPT, max_new_tokens=200) for _ in range(2)]
            readers = [iter(stream) for stream in running]
            for reader in readers:
                next(reader)  # both have started
            start = time.monotonic()
            code, details = code_of(lambda: generate(stack, prompt_token_ids=PROMPT, max_new_tokens=4))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams" in details, details
            assert time.monotonic() - start < 5
            running[0].cancel()
            chunks = []
            for _ in range(100):  # the cancelled one lets go of its place as its round ends
                try:
                    chunks = generate(stack, prompt_token_ids=PROMPT, max_new_tokens=4)
                    break
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    time.sleep(0.05)
            assert [t for c in chunks for t in c.token_ids] == hf_greedy(target.model, PROMPT, 4)
            running[1].cancel()


def test_a_verifier_back_from_a_restart_is_reached_within_seconds():
    """A channel to a server that stopped retries it at least every 2 s however long it was gone: with gRPC's
    default backoff (to 120 s) an orchestrator refused work for a minute after its verifier was back (after 12 s away
    its next try was ~7 s off here)."""
    target = tiny_loaded(seed=0, layers=1)
    address = f"127.0.0.1:{free_port()}"
    server = start_verifier(target, address)
    client = RemoteVerifier(address)
    try:
        assert client.healthy(2.0)
        server.stop(0)
        away = time.monotonic() + 12
        while time.monotonic() < away:  # the orchestrator's health checks meanwhile
            assert not client.healthy(0.5)
            time.sleep(0.5)
        server = start_verifier(target, address)
        back = time.monotonic()
        assert wait_for(lambda: client.healthy(0.5), timeout=10)
        assert time.monotonic() - back < 3.5
    finally:
        client.close()
        server.stop(0)


def test_an_orchestrator_without_a_verifier_reports_not_serving():
    """A load balancer reads grpc.health.v1: an orchestrator none of whose verifier replicas passes its health checks
    cannot serve a generation, so it says NOT_SERVING (it said SERVING while every generation failed UNAVAILABLE),
    and SERVING again once one is back."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = tiny_loaded(seed=0, layers=1)
    address = f"127.0.0.1:{free_port()}"
    verifier = start_verifier(target, address)
    orchestrator = start_orchestrator(address, [], target.tokenizer, config=OrchestratorConfig(health_interval_s=0.2))
    channel = grpc.insecure_channel(orchestrator.address)
    health = health_pb2_grpc.HealthStub(channel)

    def status(service: str = "") -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status

    try:
        assert status() == status("specsplit.v1.OrchestratorService") == health_pb2.HealthCheckResponse.SERVING
        verifier.stop(0)
        assert wait_for(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING)
        assert status("specsplit.v1.OrchestratorService") == health_pb2.HealthCheckResponse.NOT_SERVING
        verifier = start_verifier(target, address)
        assert wait_for(lambda: status() == health_pb2.HealthCheckResponse.SERVING)
        tokens = [t for c in Client(orchestrator.address).generate(prompt_token_ids=PROMPT, max_new_tokens=4)
                  for t in c.token_ids]
        assert tokens == hf_greedy(target.model, PROMPT, 4)
    finally:
        channel.close()
        orchestrator.stop(0)
        orchestrator.core.close()
        verifier.stop(0)


def test_cancel_and_resume_refuse_what_they_must_not_take(stack):
    """A Cancel's id is bounded like a session id (each one for an id not yet started is kept a minute), and a plain
    (not resumable) session cannot be read or taken over by a resume naming its id: its tokens are its stream's."""
    from specsplit.v1 import orchestrator_pb2, orchestrator_pb2_grpc

    with grpc.insecure_channel(stack.address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        code, details = code_of(lambda: stub.Cancel(orchestrator_pb2.CancelRequest(session_id="c" * 10_000)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most 256 printable characters" in details
        chunks = list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=4, session_id="plain"))
        assert chunks[-1].finish_reason == "length"
        resume = orchestrator_pb2.GenerateRequest(resume_session_id="plain", resume_from_token=0)
        code, details = code_of(lambda: list(stub.Generate(resume, timeout=30)))
        assert code == grpc.StatusCode.NOT_FOUND and "as a resumable one" in details
