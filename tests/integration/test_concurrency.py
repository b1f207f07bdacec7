"""Many concurrent sessions through the real gRPC services share the verifier's batches, and each one
still produces exactly its own HF greedy tokens; a full verifier answers RESOURCE_EXHAUSTED at once; a session
that ends is released on its verifier even while another call past its deadline has the replica marked down."""

import random
import threading
import time

import grpc
import pytest

from draft_service.ngram import NgramProposer
from orchestrator.requests import GenerationRequest
from specsplit.client import Client
from specsplit.config import DraftConfig, OrchestratorConfig, VerifierConfig
from specsplit.launch import start_orchestrator, start_stack, start_verifier
from specsplit.rpc import RemoteVerifier
from tiny import delay_relay, hf_greedy, tiny_loaded, wait_for

SESSIONS = 32


@pytest.fixture(scope="module")
def target():
    return tiny_loaded(seed=0)


def mixed_requests(n: int) -> list[dict]:
    """Prompts from 1 to ~200 tokens (some repetitive, so n-gram drafts hit), mixed budgets and drafts."""
    rng = random.Random(1)
    requests = []
    for i in range(n):
        length = [1, 3, 8, 20, 45, 90, 140, 200][i % 8] + rng.randrange(3)
        motif = [rng.randrange(3, 256) for _ in range(rng.randint(2, 6))]
        prompt = [258] + (motif * length)[:length - 1] if i % 2 else [rng.randrange(3, 256) for _ in range(length)]
        requests.append(dict(prompt_token_ids=prompt or [258], max_new_tokens=rng.choice([16, 24, 40]),
                             draft="none" if i % 5 == 4 else "ngram"))
    return requests


def test_32_concurrent_sessions_each_get_their_hf_greedy_tokens(target):
    requests = mixed_requests(SESSIONS)
    expected = [hf_greedy(target.model, r["prompt_token_ids"], r["max_new_tokens"]) for r in requests]
    config = VerifierConfig(max_sessions=SESSIONS + 8, prefill_chunk=32)
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    with start_stack(target, [NgramProposer(DraftConfig())], verifier_config=config) as stack:
        start = threading.Barrier(SESSIONS)

        def one(i):
            try:
                with Client(stack.address) as client:
                    start.wait()
                    got[i] = [t for c in client.generate(**requests[i]) for t in c.token_ids]
            except BaseException as err:  # surfaced below
                errors.append(err)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(SESSIONS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        engine = stack.verifier_engine
        wait_for(lambda: engine.num_sessions() == 0, timeout=10)
        assert not errors, errors[:3]
        for i in range(SESSIONS):
            assert got.get(i) == expected[i], f"session {i}: prompt of {len(requests[i]['prompt_token_ids'])} tokens"
        assert engine.stats.max_rows >= 8, engine.stats  # the sessions really were verified together
        assert engine.num_sessions() == 0


def test_full_verifier_is_resource_exhausted_through_the_orchestrator(target):
    with start_stack(target, [NgramProposer(DraftConfig())], verifier_config=VerifierConfig(max_sessions=2)) as stack:
        verifier = RemoteVerifier(stack.verifier.address)
        verifier.prefill("a", [258, 5], timeout=5)
        verifier.prefill("b", [258, 6], timeout=5)
        start = time.perf_counter()
        with pytest.raises(grpc.RpcError) as info:
            list(Client(stack.address).generate(prompt_token_ids=[258, 7, 8], max_new_tokens=4))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at capacity" in info.value.details() and "max_sessions=2" in info.value.details()
        assert time.perf_counter() - start < 2.0
        verifier.release("a", timeout=5)
        tokens = [t for c in Client(stack.address).generate(prompt_token_ids=[258, 7, 8], max_new_tokens=4)
                  for t in c.token_ids]
        assert tokens == hf_greedy(target.model, [258, 7, 8], 4)


def test_a_session_that_ends_while_another_s_deadline_marked_its_replica_down_is_released(target):
    """One session's call past its deadline marks the replica down, though it is alive and holds every other session's
    cache; a session that ends then must still be released there, not left to the verifier's idle timeout (48
    generations at 0.15-0.3 s Verify / 0.3-0.5 s Prefill deadlines left up to 10 sessions held). The verifier is
    100 ms away (the benchmark's delaying TCP relay), so a 30 ms deadline is missed for sure."""
    config = OrchestratorConfig(health_interval_s=0)  # no health checks: the replica stays as the failed call left it
    verifier = start_verifier(target)
    try:
        with delay_relay(verifier.address, 100) as relay:
            orchestrator = start_orchestrator(relay.address, [], target.tokenizer, config=config)
            core, engine = orchestrator.core, verifier.core
            try:
                # Session A (the orchestrator's own generate): held after its last round, before it settles.
                a = core.generate(GenerationRequest([258, 7, 8, 9], 4, draft="none"))
                chunks = [next(a)]
                while not chunks[-1].finish_reason:
                    chunks.append(next(a))
                assert [t for c in chunks for t in c.token_ids] == hf_greedy(target.model, [258, 7, 8, 9], 4)
                assert engine.num_sessions() == 1
                # Session B over gRPC: its Prefill misses its deadline, which marks the replica down; with no other
                # replica B fails UNAVAILABLE.
                config.prefill_timeout_s = 0.03
                with pytest.raises(grpc.RpcError) as info:
                    list(Client(orchestrator.address).generate(prompt_token_ids=[258, 5, 6], max_new_tokens=4,
                                                                draft="none"))
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert not core.replicas.replicas[0].healthy
                with pytest.raises(StopIteration):  # A settles now: its cache must be released
                    next(a)
                assert wait_for(lambda: core.generating() == 0)
                assert wait_for(lambda: engine.num_sessions() == 0), engine.num_sessions()  # A's, and B's
            finally:
                orchestrator.stop(0)
                core.close()
    finally:
        verifier.stop(0)
        verifier.core.close()
