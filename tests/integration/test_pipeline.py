"""The pipeline's behaviour through real gRPC: fallback, cancellation, stop strings, chat, SDKs, tracing."""

import asyncio
import copy
import threading
import time

import grpc
import pytest

from draft_service.ngram import NgramProposer
from draft_service.proposers import ModelProposer
from orchestrator import drafts
from orchestrator.trigger import make_trigger
from specsplit.client import AsyncClient, Client
from specsplit.config import DraftConfig, OrchestratorConfig, VerifierConfig
from specsplit.errors import FailedPrecondition, Unavailable
from specsplit.launch import start_stack
from tiny import hf_greedy, hold_each_forward, tiny_loaded, wait_for

PROMPT = [258, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]


def tokens_of(chunks):
    return [t for c in chunks for t in c.token_ids]


class SlowNgram(NgramProposer):
    """A draft that has become slow (a fault injected into a real proposer)."""

    def propose(self, session_id, token_ids, max_nodes, stop_token_ids=()):
        time.sleep(0.5)
        return super().propose(session_id, token_ids, max_nodes, stop_token_ids)


def test_draft_down_falls_back_to_target_only(target):
    with start_stack(target, [NgramProposer(DraftConfig())]) as stack:
        stack.drafts[0].stop(0)  # the edge box is gone
        chunks = list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=30))
        assert tokens_of(chunks) == hf_greedy(target.model, PROMPT, 30)
        assert all(c.stats.num_draft_tokens == 0 for c in chunks if c.stats)


def test_slow_draft_falls_back_and_output_is_unchanged(target):
    config = OrchestratorConfig(draft_timeout_s=0.1, draft_retry_rounds=5)
    with start_stack(target, [SlowNgram(DraftConfig())], orchestrator_config=config) as stack:
        start = time.perf_counter()
        chunks = list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=30))
        assert tokens_of(chunks) == hf_greedy(target.model, PROMPT, 30)
        assert time.perf_counter() - start < 0.5 * 30  # not every round waited for the slow draft
        assert wait_for(lambda: stack.draft_sessions() == 0)  # and the slow draft was told the session ended


def forget_sessions(drafter, at=lambda call: call == 3) -> list:
    """The fault: the draft service forgets a session (restarted, or idle-swept) as its ``at(call)``-th round reaches
    it (counted from 1 over all rounds). Returns the session ids of the rounds, as they come."""
    session_of, calls = drafter._session, []

    def forgetful(session_id):
        calls.append(session_id)
        if at(len(calls)):
            drafter.end(session_id)
        return session_of(session_id)

    drafter._session = forgetful
    return calls


def test_a_draft_that_lost_the_session_is_started_again_next_round(target):
    """The draft service loses the session mid-generation (restarted, or its idle sweep ended it): its next round
    answers NOT_FOUND, and the orchestrator starts the session on it again at the next round, from all committed
    tokens, instead of decoding target-only for ``draft_retry_rounds`` (32) rounds. The output does not change."""
    config = OrchestratorConfig(trigger="fixed", fixed_tree_nodes=4)  # every round drafts (the target as its draft)
    with start_stack(target, [ModelProposer(target, DraftConfig())], orchestrator_config=config) as stack:
        calls = forget_sessions(stack.drafts[0].core)  # before the draft's 3rd round
        chunks = list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=60))
        assert tokens_of(chunks) == hf_greedy(target.model, PROMPT, 60)
        assert len(calls) >= 3
        rounds = [c.stats for c in chunks if c.stats]
        without = [r.round for r in rounds if r.num_draft_tokens == 0]
        assert len(rounds) >= 6 and len(without) == 1, [(r.round, r.num_draft_tokens) for r in rounds]
        assert without[0] < rounds[-1].round  # the draft drafted again after the round that lost it


def test_a_draft_that_keeps_losing_the_session_is_paused_after_one_restart(target, caplog):
    """A draft that loses the session every round (a fault that a restart does not cure) is started again at once only
    once in ``draft_retry_rounds`` rounds: a restart that fails again pauses it like any failed draft."""
    config = OrchestratorConfig(trigger="fixed", fixed_tree_nodes=4, draft_retry_rounds=3)
    with start_stack(target, [ModelProposer(target, DraftConfig())], orchestrator_config=config) as stack:
        forget_sessions(stack.drafts[0].core, at=lambda call: True)
        with caplog.at_level("WARNING", logger="orchestrator.generation"):
            chunks = list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=60))
        assert tokens_of(chunks) == hf_greedy(target.model, PROMPT, 60)
    said = ["again" if "started again next round" in r.message else "pause" for r in caplog.records
            if "failed for session" in r.message]
    assert said[:3] == ["again", "pause", "again"] and "again, again" not in ", ".join(said), said


def test_a_restarted_draft_that_refuses_the_session_does_not_fail_the_generation(target):
    """Mid-generation, a draft started again (it lost the session) that now refuses it (as a draft restarted with
    another model would: FAILED_PRECONDITION) is a failed draft: the generation goes on target-only."""
    config = OrchestratorConfig(trigger="fixed", fixed_tree_nodes=4)
    with start_stack(target, [ModelProposer(target, DraftConfig())], orchestrator_config=config) as stack:
        drafter = stack.drafts[0].core
        start, calls = drafter.start, forget_sessions(drafter)

        def refuses_again(session_id, *args, **kwargs):
            if calls:
                raise FailedPrecondition("tokenizer mismatch (injected)")
            return start(session_id, *args, **kwargs)

        drafter.start = refuses_again
        chunks = list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=60))
        assert tokens_of(chunks) == hf_greedy(target.model, PROMPT, 60) and chunks[-1].finish_reason == "length"


class RebootingNgram(NgramProposer):
    """A draft that answers UNAVAILABLE until ``up_at`` (time.monotonic()): its edge box rebooting (a fault injected
    into a real proposer)."""

    up_at = 0.0

    def propose(self, session_id, token_ids, max_nodes, stop_token_ids=()):
        if time.monotonic() < self.up_at:
            raise Unavailable("the edge box is rebooting (injected)")
        return super().propose(session_id, token_ids, max_nodes, stop_token_ids)


def test_a_failed_draft_is_tried_again_after_seconds_as_well_as_rounds(target, monkeypatch):
    """After a failure the draft is tried again after ``draft_retry_rounds`` rounds or ``draft_retry_s`` seconds,
    whichever comes first: a draft back after a short outage drafts again though the rounds are far from over (long
    rounds across a far network would otherwise leave most of a generation target-only)."""
    config = OrchestratorConfig(draft_retry_rounds=1000, draft_retry_s=0.2, burst_max=1)
    draft = RebootingNgram(DraftConfig())
    with start_stack(target, [draft], orchestrator_config=config) as stack:
        hold_each_forward(stack.verifier_engine, monkeypatch, 0.01)  # the generation lasts about a second
        draft.up_at = time.monotonic() + 0.3
        chunks = list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=100))
    assert tokens_of(chunks) == hf_greedy(target.model, PROMPT, 100)
    drafted = [bool(c.stats.num_draft_tokens) for c in chunks if c.stats]
    assert not drafted[0] and any(drafted), drafted  # down at first, drafting again later in the same generation


def test_client_cancel_releases_sessions(target):
    with start_stack(target, [NgramProposer(DraftConfig())]) as stack:
        stream = Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=200)
        got = []
        for chunk in stream:  # (cancel() ends the iteration, without an error)
            got.append(chunk)
            if len(got) == 3:
                stream.cancel()
        assert len(got) == 3 and not got[-1].finish_reason
        assert wait_for(lambda: stack.verifier_engine.num_sessions() == 0)
        assert stack.draft_sessions() == 0


def test_stop_strings_cut_text_and_tokens(target):
    tokenizer = target.tokenizer
    with start_stack(target, [NgramProposer(DraftConfig())]) as stack:
        full = list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=40))
        text = "".join(c.text for c in full)
        expected_tokens = tokens_of(full)
        assert text == tokenizer.decode(expected_tokens, skip_special_tokens=True)
        stop = text[10:13]
        cut = list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=40, stop=[stop]))
        assert cut[-1].finish_reason == "stop"
        assert "".join(c.text for c in cut) == text[: text.find(stop)]
        got = tokens_of(cut)
        assert got == expected_tokens[: len(got)]
        assert stop in tokenizer.decode(got) and stop not in tokenizer.decode(got[:-1])


def test_chat_template_and_plain_prompt(target):
    tokenizer = target.tokenizer
    with start_stack(target, []) as stack:
        client = Client(stack.address)
        chat = list(client.generate("hello", max_new_tokens=3))
        expected = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert chat[0].prompt_token_ids == list(expected)
        plain = list(client.generate("hello", max_new_tokens=3, chat_template=False))
        assert plain[0].prompt_token_ids == tokenizer("hello")["input_ids"]
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        msgs = list(client.generate(messages=messages, max_new_tokens=3))
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert msgs[0].prompt_token_ids == list(expected)


def test_async_client_matches_sync(target):
    async def collect(address):
        async with AsyncClient(address) as client:
            return [c async for c in client.generate(prompt_token_ids=PROMPT, max_new_tokens=20)]

    with start_stack(target, [NgramProposer(DraftConfig())]) as stack:
        chunks = asyncio.run(collect(stack.address))
        assert tokens_of(chunks) == hf_greedy(target.model, PROMPT, 20)
        assert chunks[-1].finish_reason == "length"


def test_sdk_clients_over_tls(target, tmp_path):
    """Every server of the stack serving TLS, every channel verifying it: both SDK clients, and a client
    trusting another CA refused."""
    from pki import make_pki
    from specsplit import tls

    pki = make_pki(tmp_path)
    own = tls.TLS(cert=pki["host.pem"], key=pki["host.key"], ca=pki["ca.pem"], client_ca=pki["ca.pem"])

    async def collect(address):
        async with AsyncClient(address, tls=tls.TLS(ca=pki["ca.pem"], cert=pki["host.pem"], key=pki["host.key"])) as c:
            return [c async for c in c.generate(prompt_token_ids=PROMPT, max_new_tokens=12)]

    from specsplit.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="TLS files unusable"):
        tls.TLS(cert=pki["ca.pem"], key=pki["host.key"]).checked()  # a key that is not the certificate's
    with pytest.raises(InvalidArgument, match="calls would go out in plaintext"):
        Client("127.0.0.1:1", tls=tls.TLS(cert=pki["host.pem"], key=pki["host.key"]))
    tls.configure(own)
    try:
        with start_stack(target, [NgramProposer(DraftConfig())]) as stack:
            assert stack.orchestrator.tls and stack.verifier.tls
            with Client(stack.address, tls=own) as client:
                assert tokens_of(client.generate(prompt_token_ids=PROMPT, max_new_tokens=12)) == \
                    hf_greedy(target.model, PROMPT, 12)
            assert tokens_of(asyncio.run(collect(stack.address))) == hf_greedy(target.model, PROMPT, 12)
            for wrong in (tls.TLS(ca=pki["other.pem"], cert=pki["host.pem"], key=pki["host.key"]),  # unknown root
                          tls.TLS(ca=pki["ca.pem"])):  # no client certificate
                with Client(stack.address, tls=wrong, timeout=5) as client, pytest.raises(grpc.RpcError) as err:
                    list(client.generate(prompt_token_ids=PROMPT, max_new_tokens=4))
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        tls.configure(tls.TLS())


def test_concurrent_sessions_are_independent(target):
    prompts = [PROMPT, PROMPT[:5], list(range(40, 70)), [42, 43]]
    results = {}
    with start_stack(target, [NgramProposer(DraftConfig())]) as stack:
        def run(i):
            results[i] = tokens_of(Client(stack.address).generate(prompt_token_ids=prompts[i], max_new_tokens=24))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i, prompt in enumerate(prompts):
        assert results[i] == hf_greedy(target.model, prompt, 24)


def test_health_and_reflection(target):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with start_stack(target, [NgramProposer(DraftConfig())]) as stack:
        for server, name in [(stack.verifier, "specsplit.v1.VerifierService"),
                             (stack.drafts[0], "specsplit.v1.DraftService"),
                             (stack.orchestrator, "specsplit.v1.OrchestratorService")]:
            channel = grpc.insecure_channel(server.address)
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            responses = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                        timeout=5)
            services = {s.name for r in responses for s in r.list_services_response.service}
            assert name in services and "grpc.health.v1.Health" in services
            channel.close()


def test_a_closed_stack_leaves_no_thread_behind(target):
    """Every thread a stack started (gRPC workers, idle sweeps, model threads) ends once it is closed and dropped:
    none holds its engines and caches for the life of the process (an idle sweep did: a test run grew to 450 threads
    and 2 GB)."""
    import gc

    before = set(threading.enumerate())
    with start_stack(target, [ModelProposer(target, DraftConfig())]) as stack:
        assert list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=8))
        started = set(threading.enumerate()) - before
        assert any(t.name == "specsplit-idle-sweep" for t in started)
    del stack
    gc.collect()
    for thread in started:
        thread.join(timeout=5)
    assert [t.name for t in started if t.is_alive()] == []


def test_target_only_rounds_decode_in_bursts(target):
    """--draft none: each Verify has the verifier decode a burst of tokens alone (sized from the measured
    round trip; over localhost gRPC next to a tiny model, several); greedy output stays HF greedy's, a
    seeded sampled one is the same as one token a request, and --burst-max 1 is one token a round."""
    one = OrchestratorConfig(burst_max=1)
    with start_stack(target, []) as stack, start_stack(target, [], orchestrator_config=one) as single:
        chunks = list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=40, draft="none"))
        assert tokens_of(chunks) == hf_greedy(target.model, PROMPT, 40)
        rounds = [c.stats for c in chunks if c.stats]
        assert len(rounds) < 20 and all(r.num_draft_tokens == 0 for r in rounds)
        assert rounds[0].num_committed == 1  # nothing measured yet: the first token streams after one step
        single_rounds = [c.stats for c in Client(single.address).generate(prompt_token_ids=PROMPT, max_new_tokens=12)
                         if c.stats]
        assert [r.num_committed for r in single_rounds] == [1] * 12

        def sampled(address):
            return tokens_of(Client(address).generate(prompt_token_ids=PROMPT, max_new_tokens=30, temperature=1.5,
                                                      seed=5, draft="none"))

        assert sampled(stack.address) == sampled(single.address)


def test_a_burst_never_asks_more_than_the_verifier_decodes(target):
    """A verifier configured to decode fewer tokens alone per Verify than the orchestrator's --burst-max (it says how
    many in GetInfo): bursts stop at its limit, where the generation failed with INVALID_ARGUMENT before."""
    small = VerifierConfig(max_decode_steps=2)
    eager = OrchestratorConfig(burst_max=16, burst_overhead=0.001)  # bursts as long as allowed
    with start_stack(target, [], verifier_config=small, orchestrator_config=eager) as stack:
        chunks = list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=40, draft="none"))
    assert tokens_of(chunks) == hf_greedy(target.model, PROMPT, 40)
    committed = [c.stats.num_committed for c in chunks if c.stats]
    assert max(committed) == 3 and len(committed) < 20  # one token and two decoded alone a Verify


def test_a_drafted_round_whose_draft_seldom_pays_ends_in_a_burst(target):
    """n-gram rounds next to a tiny model (a ~1 ms forward beside a few ms of gRPC a round): a drafted round costs
    more per token than the target decoding alone, so its Verify decodes a burst after the tree's verdict. Greedy
    output stays HF greedy's, a seeded sampled one is the same as with one token a round, and --burst-max 1
    decodes nothing after a tree."""
    prompt = [258] + [10, 11, 12, 13, 14] * 8  # n-gram matches everywhere, the model goes its own way
    one = OrchestratorConfig(burst_max=1)
    ngram = [NgramProposer(DraftConfig())]
    with start_stack(target, ngram) as stack, start_stack(target, ngram, orchestrator_config=one) as single:
        chunks = list(Client(stack.address).generate(prompt_token_ids=prompt, max_new_tokens=60, draft="ngram"))
        assert tokens_of(chunks) == hf_greedy(target.model, prompt, 60)
        rounds = [c.stats for c in chunks if c.stats]
        assert any(r.num_draft_tokens and r.num_decoded for r in rounds), rounds
        single_rounds = [c.stats for c in Client(single.address).generate(prompt_token_ids=prompt, max_new_tokens=30,
                                                                          draft="ngram") if c.stats]
        assert not any(r.num_decoded for r in single_rounds)

        def sampled(address):
            return tokens_of(Client(address).generate(prompt_token_ids=prompt, max_new_tokens=30, temperature=1.5,
                                                      seed=5, draft="ngram"))

        assert sampled(stack.address) == sampled(single.address)


def test_a_new_session_starts_from_the_latest_sessions_estimates(target, monkeypatch):
    """A streamed-tree session's trigger is a copy of the previous session's: it starts where that one's
    estimates were, and moves on its own (share_estimates off: each starts afresh)."""
    made = []
    monkeypatch.setattr(drafts, "make_trigger", lambda *a: made.append(make_trigger(*a)) or made[-1])
    with start_stack(target, [ModelProposer(tiny_loaded(seed=99, layers=1))]) as stack:
        client, learned = Client(stack.address), stack.orchestrator.core._learned
        list(client.generate(prompt_token_ids=PROMPT, max_new_tokens=20, draft="model"))
        first = learned[("trigger", "goodput", "model", True)]
        snapshot = copy.deepcopy(first)
        list(client.generate(prompt_token_ids=PROMPT, max_new_tokens=20, draft="model"))
        second = learned[("trigger", "goodput", "model", True)]
        assert made == [first]  # one trigger made from scratch; the second session's is a copy
        assert second is not first and first == snapshot  # the copy moved on, the first one stayed as it was
    fresh = OrchestratorConfig(share_estimates=False)
    with start_stack(target, [ModelProposer(tiny_loaded(seed=99, layers=1))], orchestrator_config=fresh) as stack:
        made.clear()
        for _ in range(2):
            list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=20, draft="model"))
        assert len(made) == 2


def test_leaving_a_stream_early_cancels_its_generation(target):
    """A loop that breaks off, a stream read with next() and dropped, a with-block left early: the server stops and
    frees the session (it used to generate on to the end for no one, a resumable one then sat detached)."""
    with start_stack(target, [NgramProposer(DraftConfig())]) as stack:
        client = Client(stack.address)
        core = stack.orchestrator.core

        def freed():
            return wait_for(lambda: core.generating() == 0 and stack.verifier_sessions() == 0, timeout=10)

        for _ in client.generate(prompt_token_ids=PROMPT, max_new_tokens=400):
            break
        assert freed()
        stream = client.generate(prompt_token_ids=PROMPT, max_new_tokens=400, resume=True)
        for i, _ in enumerate(stream):
            if i == 2:
                break
        assert freed() and core.store.load(stream.session_id).status == "cancelled"
        with client.generate(prompt_token_ids=PROMPT, max_new_tokens=400) as stream:
            assert next(stream).prompt_token_ids == PROMPT  # (an iterator: next() works)
        assert freed()
        whole = client.generate(prompt_token_ids=PROMPT, max_new_tokens=12)
        assert tokens_of(whole) == hf_greedy(target.model, PROMPT, 12)
        whole.close()  # finished: nothing to cancel


def test_sdk_arguments_are_checked_with_their_names(target):
    from specsplit.errors import InvalidArgument

    for bad in ("localhost", "http://127.0.0.1:50051", "", "host:0"):
        with pytest.raises(InvalidArgument, match="HOST:PORT"):
            Client(bad)
    with pytest.raises(InvalidArgument, match="HOST:PORT"):
        AsyncClient("localhost")
    client = Client("127.0.0.1:1")
    with pytest.raises(ValueError, match="max_new_tokens must fit in 32 bits"):
        client.generate("hi", max_new_tokens=2**31)
    with pytest.raises(ValueError, match="top_k must fit in 32 bits"):
        client.generate("hi", top_k=2**31)
    with start_stack(target, []) as stack:
        chunks = list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=5, stop=None))
        assert tokens_of(chunks) == hf_greedy(target.model, PROMPT, 5)
        # no draft service: "auto" decodes target-only, a drafter named is refused, not silently dropped
        with pytest.raises(grpc.RpcError) as err:
            list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=5, draft="ngram"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no 'ngram' draft" in err.value.details()


def test_an_address_that_never_answers_fails_at_once_not_after_the_reconnect_window():
    """A resumable generation reconnects for ``reconnect_s`` after an orchestrator it was using goes away; one whose
    every address refused from the start (a typo, a service not running) fails at once."""
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(Client(["127.0.0.1:1", "127.0.0.1:2"], reconnect_s=30).generate("hi", resume=True))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - start < 5
    start = time.monotonic()  # a name that does not resolve (before: retried for reconnect_s)
    with pytest.raises(grpc.RpcError) as err:
        list(Client(["nosuchhost.invalid:1", "127.0.0.1:2"], reconnect_s=30).generate("hi", resume=True))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - start < 10


def test_an_async_client_is_made_outside_an_event_loop(target):
    with start_stack(target, [NgramProposer(DraftConfig())]) as stack:
        asyncio.run(asyncio.sleep(0))  # (a loop ran and closed: none is current now)
        client = AsyncClient(stack.address)

        async def run():
            async with client:
                return [c async for c in client.generate(prompt_token_ids=PROMPT, max_new_tokens=8)]

        assert tokens_of(asyncio.run(run())) == hf_greedy(target.model, PROMPT, 8)
