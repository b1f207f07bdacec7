"""Resume across a session store that fails: writes that did not land, a store that lost its last writes or the
session itself (Redis's fsync window, a restart from an older snapshot or empty)."""

import grpc
import pytest

from draft_service.ngram import NgramProposer
from specsplit.client import Client
from specsplit.config import DraftConfig
from specsplit.errors import Unavailable
from specsplit.launch import start_stack
from specsplit.store import DETACHED, FINISHED, InMemoryStore
from specsplit.v1 import orchestrator_pb2
from test_resume import LONG, PROMPT, read_then_drop, resume, tokens_of
from tiny import hf_greedy, wait_for


class EndedEarly(Exception):
    """The generation ended (end-of-text) before it could be broken off: a sampled one may."""


def drop_then_lose_writes(stack, client, **request) -> tuple[str, list[int]]:
    """Read 6 chunks of a resumable generation, break the stream, then roll the stored session back to its first 3
    tokens (the store lost its last writes: Redis's fsync window); (session id, the tokens the client has)."""
    try:
        session_id, got = read_then_drop(client, 6, **request)
    except StopIteration:
        raise EndedEarly() from None
    store = stack.orchestrator.core.store
    assert wait_for(lambda: store.load(session_id).status in (DETACHED, FINISHED))
    if store.load(session_id).status == FINISHED:
        raise EndedEarly()
    state = store.load(session_id)
    state.committed_token_ids, state.generated = state.committed_token_ids[:3], 3  # rolled back
    state.round += 1
    store.commit(state)
    return session_id, tokens_of(got)


def test_client_ahead_of_the_store_gets_only_new_tokens(target):
    """Redis lost the last writes (e.g. fsync window): the session regenerates them, sending none twice."""
    with start_stack(target, [NgramProposer(DraftConfig())]) as stack:
        client = Client(stack.address)
        session_id, have = drop_then_lose_writes(stack, client, prompt_token_ids=PROMPT, max_new_tokens=LONG)
        rest = resume(client, session_id, len(have))
        assert have + tokens_of(rest) == hf_greedy(target.model, PROMPT, LONG)


@pytest.mark.parametrize("rejection", [False, True], ids=["coupled", "rejection"])
@pytest.mark.parametrize("seed", [None, 7])
def test_a_sampled_session_the_store_lost_tokens_of(target, seed, rejection):
    """Sampled, the regenerated tokens are the client's when they follow from the session's seed: coupled draws always
    (the tokens depend on the seed, the request's or the one drawn at its start, alone), rejection sampling only with a
    request's seed (each round's draws and trees follow from it). Then the resume continues exactly as the
    uninterrupted run; otherwise it fails with DATA_LOSS instead of sending tokens drawn after a different prefix."""
    sampling = dict(temperature=0.8, seed=seed, prompt_token_ids=PROMPT, max_new_tokens=LONG,
                    rejection_sampling=rejection)
    with start_stack(target, [NgramProposer(DraftConfig())]) as stack:
        client = Client(stack.address)
        whole = tokens_of(client.generate(**sampling)) if seed is not None else None
        for _ in range(10):
            try:
                session_id, have = drop_then_lose_writes(stack, client, **sampling)
                break
            except EndedEarly:  # unseeded draws can reach the end-of-text token within 6 chunks: draw again
                assert seed is None
        if seed is None and rejection:
            with pytest.raises(grpc.RpcError) as info:
                resume(client, session_id, len(have))
            assert info.value.code() == grpc.StatusCode.DATA_LOSS and "seed" in info.value.details()
            return
        if seed is None:  # the seed the session drew at its start gives the same tokens to a new request
            whole = tokens_of(client.generate(**{**sampling, "seed": stack.orchestrator.core.store.load(session_id).seed}))
        assert have + tokens_of(resume(client, session_id, len(have))) == whole


class StoreThatFailsOnce(InMemoryStore):
    """The in-process store, one of whose writes fails unapplied (UNAVAILABLE: unreachable) once ``fail`` is set."""

    fail = False

    def commit(self, state, after=None):
        if self.fail:
            self.fail = False
            raise Unavailable("the session store is unreachable")
        super().commit(state, after)


def test_a_round_the_store_could_not_write_is_written_when_the_session_detaches(target):
    """A round's write fails (the store unreachable past --store-retry-s): the stream ends with UNAVAILABLE, and the
    session's detach write, one round later, takes the failed write's round (before, it lost to it as stale: the
    store kept the session RUNNING with what the round before had, and its resume re-prefilled)."""
    store = StoreThatFailsOnce()
    with start_stack(target, [NgramProposer(DraftConfig())], store=store) as stack:
        client = Client(stack.address)
        request = orchestrator_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=LONG, session_id="flaky",
                                                   resumable=True)
        from specsplit.rpc import chunk_from_pb

        got = []
        with pytest.raises(grpc.RpcError) as info:
            for message in client._stub(0).Generate(request, timeout=60):
                got.append(chunk_from_pb(message))
                if len(got) == 3:
                    store.fail = True
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert wait_for(lambda: store.load("flaky").status == DETACHED)
        have = tokens_of(got)
        assert store.load("flaky").generated > len(have)  # the failed round's tokens, kept though never sent
        assert have + tokens_of(resume(client, "flaky", len(have))) == hf_greedy(target.model, PROMPT, LONG)


class StoreThatRestarts(InMemoryStore):
    """The in-process store that, when told, goes back to what it held after a session's write of round 3, or to
    nothing (Redis restarted from an older snapshot, or without one)."""

    def __init__(self):
        super().__init__()
        self.snapshots = {}

    def commit(self, state, after=None):
        super().commit(state, after)
        if state.round == 3:
            self.snapshots[state.session_id] = state.copy()

    def restart(self, session_id, from_snapshot: bool):
        with self._lock:
            if from_snapshot:
                self._put(self.snapshots[session_id])
            else:
                self._states.pop(session_id)


@pytest.mark.parametrize("from_snapshot", [False, True])
def test_a_live_session_outlives_a_store_that_lost_it(target, from_snapshot):
    """The store restarts mid-stream, without the session or a few rounds behind: the orchestrator, which holds the
    whole session, writes it again and goes on (it failed with FAILED_PRECONDITION, 'another writer', and left its
    verifier and draft sessions held until their idle timeout)."""
    store = StoreThatRestarts()
    with start_stack(target, [NgramProposer(DraftConfig())], store=store) as stack:
        stream = Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=200, resume=True)
        got = []
        for chunk in stream:
            got.append(chunk)
            if len(got) == 6:
                store.restart(stream.session_id, from_snapshot)
        assert len(got) > 6 and stream.reconnects == 0
        assert tokens_of(got) == hf_greedy(target.model, PROMPT, 200)
        assert store.load(stream.session_id).status == FINISHED
        assert wait_for(lambda: stack.verifier_sessions() == 0 and stack.draft_sessions() == 0)
