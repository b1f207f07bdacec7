"""Failover and resume in one process (real gRPC): replicas, detach/resume, offload, cancel, no leaks."""

import contextlib
import threading

import grpc
import pytest

from draft_service.ngram import NgramProposer
from specsplit.client import Client
from specsplit.config import DraftConfig, OrchestratorConfig, VerifierConfig
from specsplit.launch import start_stack
from specsplit.store import CANCELLED, DETACHED, FINISHED, InMemoryStore
from specsplit.v1 import orchestrator_pb2
from tiny import hf_greedy, wait_for

PROMPT = [258, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]
# Room enough that a session is still generating when its stream breaks: its first 4-6 chunks hold up to ~30
# tokens, and it runs on for a round or two before it notices (with 40, it sometimes finished first).
LONG = 120


def tokens_of(chunks):
    return [t for c in chunks for t in c.token_ids]


def read_then_drop(client, n_chunks, **kwargs):
    """Start a resumable generation, read ``n_chunks`` chunks, then break the stream (no Cancel call): as a client
    that died does (one alive that leaves its stream cancels the session)."""
    stream = client.generate(resume=True, **kwargs)
    got = []
    it = iter(stream)
    while len(got) < n_chunks:
        got.append(next(it))
    stream._cancelled = True  # (a dead client runs no cleanup: the iterator dropped below must not cancel the session)
    stream._call.cancel()  # the connection is gone; the session is not cancelled
    return stream.session_id, got


def resume(client, session_id, client_has):
    request = orchestrator_pb2.GenerateRequest(resume_session_id=session_id, resume_from_token=client_has)
    from specsplit.rpc import chunk_from_pb

    return [chunk_from_pb(m) for m in client._stub(0).Generate(request, timeout=60)]


@pytest.mark.parametrize("offload", [False, True])
def test_detached_session_resumes_with_nothing_lost_or_repeated(target, offload):
    config = OrchestratorConfig(offload_min_tokens=8 if offload else 10**6)
    with start_stack(target, [NgramProposer(DraftConfig())], orchestrator_config=config, replicas=2) as stack:
        client = Client(stack.address)
        session_id, got = read_then_drop(client, 4, prompt_token_ids=PROMPT, max_new_tokens=LONG)
        store = stack.orchestrator.core.store
        assert wait_for(lambda: store.load(session_id).status == DETACHED)
        state = store.load(session_id)
        if offload:  # the idle cache moved to the store and left the replica
            assert state.kv_length == len(state.token_ids) and store.get_kv(session_id) is not None
            assert wait_for(lambda: stack.verifier_sessions() == 0)
        else:
            assert stack.verifier_sessions() == 1
        have = tokens_of(got)
        rest = resume(client, session_id, len(have))
        assert rest[0].prompt_token_ids == PROMPT and not rest[0].token_ids  # the header again
        assert have + tokens_of(rest) == hf_greedy(target.model, PROMPT, LONG)
        assert rest[-1].finish_reason == "length"
        planner = stack.orchestrator.core.placement.planner
        assert planner.counts["import"] == int(offload)  # the restore was an import, not a prefill
        assert wait_for(lambda: stack.verifier_sessions() == 0 and stack.draft_sessions() == 0)
        assert store.get_kv(session_id) is None
        # A finished session can still be replayed to a client that lost the last chunks.
        again = resume(client, session_id, 50)
        assert tokens_of(again) == hf_greedy(target.model, PROMPT, LONG)[50:] and again[-1].finish_reason == "length"


@contextlib.contextmanager
def two_orchestrators(target, store=None, first_config=None):
    """A stack and a second orchestrator sharing its verifier and session store; a client of both, the stack's first.
    first_config: the stack's orchestrator's config."""
    from specsplit.launch import start_orchestrator

    store = store if store is not None else InMemoryStore()
    with start_stack(target, [], store=store, orchestrator_config=first_config) as stack:
        second = start_orchestrator(stack.verifier.address, [], target.tokenizer, store=store)
        try:
            yield stack, second, Client([stack.address, second.address], reconnect_s=10)
        finally:
            second.stop(0)
            second.core.close()


def test_sdk_resume_reconnects_to_the_other_orchestrator(target):
    """Two orchestrators sharing one store; the first one stops mid-stream; the SDK resumes on the second. What a
    dashboard shows of it: one trace under the SDK's generate span, each orchestrator's generate span counting its
    own tokens and rounds (their sum the whole)."""
    from tiny import span_exporter

    exporter = span_exporter()
    with two_orchestrators(target) as (stack, _, client):
        stream = client.generate(prompt_token_ids=PROMPT, max_new_tokens=200, resume=True)
        got = []
        for chunk in stream:
            got.append(chunk)
            if len(got) == 3:
                stack.orchestrator.stop(grace=0)  # the first orchestrator goes away mid-stream
    assert stream.reconnects >= 1
    assert tokens_of(got) == hf_greedy(target.model, PROMPT, 200)
    assert sum(1 for c in got if c.prompt_token_ids) == 1  # one header, however many reconnects
    spans = exporter.get_finished_spans()
    exporter.shutdown()
    (top,) = [s for s in spans if s.name == "specsplit.client.generate"]
    assert top.attributes["specsplit.reconnects"] == stream.reconnects
    generates = [s for s in spans if s.name.startswith("specsplit.orchestrator.generate")]
    assert len(generates) == 2 and {s.context.trace_id for s in generates} == {top.context.trace_id}
    assert sum(s.attributes["gen_ai.usage.output_tokens"] for s in generates) == 200
    # (a round the first committed as it stopped reaches the client replayed, without its statistics)
    assert sum(s.attributes["specsplit.rounds"] for s in generates) >= sum(1 for c in got if c.stats)
    assert [s.attributes["gen_ai.response.finish_reasons"] for s in generates] == [("unfinished",), ("length",)]


class StoreWithARivalWriter(InMemoryStore):
    """The in-process store; the first write by the orchestrator ``rival_for`` (its instance id) finds a round of
    another writer's in first (as when a session's old orchestrator commits one more round meanwhile)."""

    rival_for = ""
    rival_cache = None  # the verifier the rival's write names (None: the stored one's)
    rival_after = 0  # rounds before the rival writes

    def commit(self, state, after=None):
        if self.rival_for and state.owner == self.rival_for and state.round > self.rival_after:
            self.rival_for = ""
            stored = self.load(state.session_id)
            stored.round += 1
            if self.rival_cache is not None:
                stored.owner, stored.verifier = "rival", self.rival_cache
            super().commit(stored)
        super().commit(state, after)


@pytest.mark.parametrize("owner_cache", ["127.0.0.1:1", ""])
def test_an_orchestrator_that_lost_its_session_frees_only_caches_the_owner_does_not_use(target, owner_cache):
    """Another orchestrator claimed the session meanwhile (this one was frozen, its client moved): this one's next
    write loses, and it frees the verifier cache it placed, which the owner (its cache elsewhere) does not use; where
    the store does not say where the owner's cache is, it touches none."""
    store = StoreWithARivalWriter()
    with start_stack(target, [], store=store) as stack:
        store.rival_for, store.rival_cache, store.rival_after = stack.orchestrator.core.instance, owner_cache, 4
        with pytest.raises(grpc.RpcError) as lost:
            list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=LONG, resume=True))
        assert lost.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert wait_for(lambda: stack.verifier_sessions() == (0 if owner_cache else 1))


def test_a_timed_out_verify_on_the_only_replica_rebuilds_the_session_there(target, monkeypatch):
    """A Verify times out (DEADLINE_EXCEEDED): the replica, the only one, counts as down, and the session is rebuilt
    there. The copy the timed-out call left is released first though the replica counts as down (before, the rebuild
    was refused, 'already exists', the generation failed and the copy stayed held)."""
    from specsplit.rpc import RemoteVerifier

    real, timed_out = RemoteVerifier.verify_reply, []

    def once_too_slow(self, *args, **kwargs):
        reply = real(self, *args, **kwargs)  # the verifier did the work; its answer came too late
        if not timed_out:
            timed_out.append(1)
            raise _DeadlineExceeded()
        return reply

    monkeypatch.setattr(RemoteVerifier, "verify_reply", once_too_slow)
    with start_stack(target, [NgramProposer(DraftConfig())]) as stack:
        chunks = list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=LONG))
        assert timed_out and tokens_of(chunks) == hf_greedy(target.model, PROMPT, LONG)
        assert wait_for(lambda: stack.verifier_sessions() == 0)


class _DeadlineExceeded(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return "Deadline Exceeded"


def test_a_resume_that_loses_the_race_to_claim_the_session_resumes_again(target):
    """The orchestrator a resume reaches loses the claim to another writer (FAILED_PRECONDITION: resume it again):
    the SDK resumes again instead of failing the generation."""
    store = StoreWithARivalWriter()
    with two_orchestrators(target, store) as (stack, second, client):
        store.rival_for = second.core.instance
        stream = client.generate(prompt_token_ids=PROMPT, max_new_tokens=LONG, resume=True)
        got = []
        for chunk in stream:
            got.append(chunk)
            if len(got) == 3:
                stack.orchestrator.stop(grace=0)  # the first orchestrator goes away mid-stream
        assert not store.rival_for and stream.reconnects >= 2  # the claim lost once, then the resume again won
        assert tokens_of(got) == hf_greedy(target.model, PROMPT, LONG)


def test_a_resumable_stream_cancelled_before_it_is_read_never_starts(target):
    with start_stack(target, []) as stack:
        stream = Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=20, resume=True)
        stream.cancel()
        assert list(stream) == [] and stack.orchestrator.core.store.load(stream.session_id) is None


def test_cancel_reaches_the_session_through_another_orchestrator(target):
    """The orchestrator a resumable stream used is gone: cancel() goes to the next address, which shares the store."""
    with two_orchestrators(target) as (stack, second, client):
        stream = client.generate(prompt_token_ids=PROMPT, max_new_tokens=200, resume=True)
        reader = iter(stream)
        next(reader)
        stack.orchestrator.stop(grace=0)
        stream.cancel()
        assert wait_for(lambda: second.core.store.load(stream.session_id).status == CANCELLED)
        assert list(reader) == []  # the stream ends (it does not resume on the second)


def test_a_cancel_that_arrives_before_its_session_exists_cancels_it(target):
    """stream.cancel() right after generate(): the Cancel can reach the orchestrator before the Generate has made the
    session. It then starts cancelled (before, the cancelled call left it detached, its cache held on the verifier)."""
    with start_stack(target, [NgramProposer(DraftConfig())]) as stack:
        assert stack.orchestrator.core.cancel("early") is False  # nothing to cancel yet
        chunks = list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=LONG, resume=True,
                                                     session_id="early"))
        assert chunks[-1].finish_reason == "cancelled" and not tokens_of(chunks)
        assert wait_for(lambda: stack.orchestrator.core.store.load("early").status == CANCELLED)
        assert wait_for(lambda: stack.verifier_sessions() == 0 and stack.draft_sessions() == 0)


def test_cancel_frees_a_resumable_session(target):
    with start_stack(target, [NgramProposer(DraftConfig())]) as stack:
        client = Client(stack.address)
        stream = client.generate(prompt_token_ids=PROMPT, max_new_tokens=200, resume=True)
        for i, _ in enumerate(stream):  # (cancel() ends the iteration, without an error)
            if i == 3:
                stream.cancel()
        assert i == 3
        assert wait_for(lambda: stack.verifier_sessions() == 0 and stack.draft_sessions() == 0)
        assert stack.orchestrator.core.store.load(stream.session_id).status == "cancelled"
        assert client.cancel(stream.session_id) is False  # already over


@pytest.mark.parametrize("rejection", [False, True], ids=["coupled", "rejection"])
def test_sampled_session_continues_identically_after_a_move(target, rejection):
    kwargs = dict(prompt_token_ids=PROMPT, max_new_tokens=40, temperature=1.5, top_k=30, rejection_sampling=rejection)
    one = OrchestratorConfig(burst_max=1)  # long bursts could finish the session before the drop
    with start_stack(target, [NgramProposer(DraftConfig())], replicas=2, orchestrator_config=one) as stack:
        client = Client(stack.address)
        for kwargs["seed"] in range(11, 40):  # a seed whose draws do not end the generation early (end-of-text)
            reference = tokens_of(client.generate(**kwargs))
            if len(reference) == 40:
                break
        session_id, got = read_then_drop(client, 5, **kwargs)
        store = stack.orchestrator.core.store
        assert wait_for(lambda: store.load(session_id).status == DETACHED)
        holder = store.load(session_id).verifier
        for server in stack.verifiers:  # the replica holding the cache dies; the session moves
            if server.address == holder:
                server.stop(0)
        have = tokens_of(got)
        assert have + tokens_of(resume(client, session_id, len(have))) == reference


def test_sessions_move_when_a_replica_dies(target):
    prompts = [PROMPT, PROMPT[:7], list(range(40, 60)), [42, 43, 44], PROMPT[3:], list(range(90, 99))]
    results, errors = {}, []
    config = OrchestratorConfig(health_interval_s=0.2)
    with start_stack(target, [NgramProposer(DraftConfig())], orchestrator_config=config, replicas=2) as stack:
        started = threading.Barrier(len(prompts) + 1)

        def run(i):
            try:
                chunks = []
                for chunk in Client(stack.address).generate(prompt_token_ids=prompts[i], max_new_tokens=80):
                    chunks.append(chunk)
                    if len(chunks) == 3:
                        started.wait()
                results[i] = tokens_of(chunks)
            except Exception as err:  # noqa: BLE001
                errors.append(err)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        started.wait(timeout=60)
        stack.verifiers[0].stop(0)  # one replica dies with sessions on it
        for t in threads:
            t.join()
        assert not errors
        orchestrator = stack.orchestrator.core
        assert wait_for(lambda: not orchestrator.replicas.replicas[0].healthy)
        moved = orchestrator.placement.planner.counts["prefill"] - len(prompts)
        assert moved >= 2  # sessions were spread over both replicas, and those on the dead one moved
        assert wait_for(lambda: stack.verifiers[1].core.num_sessions() == 0)  # (Release calls run in the background)
        # and the orchestrator counts none on either (those that moved left the dead one's count: else, once back,
        # it would be passed over for as many new sessions)
        assert [r.sessions for r in orchestrator.replicas.replicas] == [0, 0]
    for i, prompt in enumerate(prompts):
        assert results[i] == hf_greedy(target.model, prompt, 80)


def test_no_kv_cache_is_left_after_200_sessions(target):
    """200 sessions that finish, are cancelled, break off and resume, or are abandoned: nothing leaks."""
    config = OrchestratorConfig(offload_min_tokens=20)
    with start_stack(target, [NgramProposer(DraftConfig())], orchestrator_config=config, replicas=2,
                     verifier_config=VerifierConfig(idle_timeout_s=1.0, max_context=256)) as stack:
        client = Client(stack.address)
        for i in range(200):
            prompt = [258, *range(1 + i % 50, 12 + i % 50)]
            kind = i % 5
            if kind == 0:  # finishes
                list(client.generate(prompt_token_ids=prompt, max_new_tokens=6))
            elif kind == 1:  # cancelled by the client (plain stream)
                stream = client.generate(prompt_token_ids=prompt, max_new_tokens=100)
                for j, _ in enumerate(stream):
                    if j == 2:
                        stream.cancel()
            elif kind == 2:  # resumable, cancelled through Cancel
                stream = client.generate(prompt_token_ids=prompt, max_new_tokens=100, resume=True)
                for j, _ in enumerate(stream):
                    if j == 2:
                        stream.cancel()
            elif kind == 3:  # resumable, breaks off, resumes, finishes
                session_id, got = read_then_drop(client, 3, prompt_token_ids=prompt, max_new_tokens=12)
                # (12 tokens may all be done before the break is noticed: a finished session resumes as well)
                wait_for(lambda: stack.orchestrator.core.store.load(session_id).status in (DETACHED, FINISHED))
                resume(client, session_id, len(tokens_of(got)))
            else:  # resumable, breaks off, never comes back (offloaded or swept)
                read_then_drop(client, 2 + i % 2, prompt_token_ids=prompt, max_new_tokens=100)
        # (a generation whose client went away may still be in its last round: it may rebuild a swept cache)
        assert wait_for(lambda: stack.orchestrator.core.generating() == 0, timeout=30)
        assert wait_for(lambda: stack.verifier_sessions() == 0, timeout=10), \
            [v.core.num_sessions() for v in stack.verifiers]
        infos = [stack.orchestrator.core.replicas.replicas[k].client.info(timeout=5) for k in range(2)]
        assert [info.num_sessions for info in infos] == [0, 0]
        engines = [v.core for v in stack.verifiers]  # every KV slot is free again (swept sessions included)
        assert wait_for(lambda: all(e._store.num_free == e.config.max_sessions for e in engines), timeout=5)
        assert wait_for(lambda: stack.draft_sessions() == 0, timeout=5)


def test_a_dead_draft_replica_is_replaced_by_its_twin(target):
    config = OrchestratorConfig(draft_retry_rounds=2)
    with start_stack(target, [NgramProposer(DraftConfig()), NgramProposer(DraftConfig())],
                     orchestrator_config=config) as stack:
        stack.drafts[0].stop(0)
        chunks = list(Client(stack.address).generate(prompt_token_ids=PROMPT * 3, max_new_tokens=60))
        assert tokens_of(chunks) == hf_greedy(target.model, PROMPT * 3, 60)
        assert any(c.stats.num_draft_tokens for c in chunks if c.stats)  # the twin drafted
        assert wait_for(lambda: stack.drafts[1].core.num_sessions() == 0)


def test_a_cancel_during_the_prefill_ends_the_stream_as_cancelled(target, monkeypatch):
    """A Cancel that arrives while a new session's prompt is being cached ends its stream with finish_reason
    "cancelled" (before, the session's first write failed on the round the Cancel had taken: UNKNOWN), and the
    verifier keeps nothing of it."""
    import time

    with start_stack(target, [NgramProposer(DraftConfig())]) as stack:
        engine = stack.verifier_engine
        prefill = engine.prefill

        def slow_prefill(*args, **kwargs):  # a long prompt's prefill, in time for the Cancel to come first
            time.sleep(0.6)
            return prefill(*args, **kwargs)

        monkeypatch.setattr(engine, "prefill", slow_prefill)
        with Client(stack.address) as client:
            timer = threading.Timer(0.2, lambda: client.cancel("during-prefill"))
            timer.start()
            chunks = list(client.generate(prompt_token_ids=PROMPT, max_new_tokens=8, session_id="during-prefill"))
            timer.join()
        assert chunks[-1].finish_reason == "cancelled" and tokens_of(chunks) == []
        assert wait_for(lambda: stack.verifier_sessions() == 0)
