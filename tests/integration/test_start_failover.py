"""Where a generation starts when it is given several orchestrators (real gRPC): one down, full or broken before the
first chunk hands the start to the next; a resumable generation's start, a plain one's and the AsyncClient's."""

import asyncio
import time

import grpc
import pytest

from specsplit.client import AsyncClient, Client
from specsplit.config import OrchestratorConfig
from specsplit.launch import start_stack
from test_resume import PROMPT, tokens_of, two_orchestrators
from tiny import hf_greedy


def test_sdk_starts_on_the_second_orchestrator_when_the_first_is_down(target):
    """The first address is down when the generation starts (refused: nothing reached it, so nothing was stored): the
    client starts it on the second (before: a resume there, NOT_FOUND, then the start; earlier still, the start went
    back to the first one, forever)."""
    from redis_server import free_port

    with start_stack(target, []) as stack:
        down = f"127.0.0.1:{free_port()}"  # nothing listens there
        told = []  # what the client tells its user while it reconnects
        client = Client([down, stack.address], reconnect_s=10, on_reconnect=told.append)
        stream = client.generate(prompt_token_ids=PROMPT, max_new_tokens=20, resume=True)
        assert tokens_of(list(stream)) == hf_greedy(target.model, PROMPT, 20)
        assert stream.reconnects == 1  # the start moved to the second
        assert [(r.failed, r.code, r.next, r.attempt) for r in told] == [
            (down, grpc.StatusCode.UNAVAILABLE, stack.address, 1)]
        assert 9 < told[0].seconds_left <= 10


def test_a_plain_generation_starts_on_the_next_address_and_never_moves_after_its_first_chunk(target):
    """Several addresses without resume=True: a generation whose first address is down starts on the next one (before,
    it only ever dialled the first and failed); every address down fails at once; once chunks have come back, a
    failure is raised, not hidden by a start elsewhere (its tokens would be a second generation's)."""
    from redis_server import free_port

    with two_orchestrators(target) as (stack, second, _):
        down, also_down = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"  # nothing listens there
        told = []
        # (reconnect_s bounds a resumable stream's reconnects; a plain one tries every address once whatever it is)
        stream = Client([down, also_down, stack.address], reconnect_s=0, on_reconnect=told.append).generate(
            prompt_token_ids=PROMPT, max_new_tokens=20)
        assert tokens_of(list(stream)) == hf_greedy(target.model, PROMPT, 20)
        assert stream.reconnects == 2
        assert [(r.failed, r.next) for r in told] == [(down, also_down), (also_down, stack.address)]

        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(Client([down, f"127.0.0.1:{free_port()}"], reconnect_s=30).generate(prompt_token_ids=PROMPT,
                                                                                    max_new_tokens=4))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 10

        stream = Client([stack.address, second.address]).generate(prompt_token_ids=PROMPT, max_new_tokens=200)
        got = []
        with pytest.raises(grpc.RpcError):
            for chunk in stream:
                got.append(chunk)
                if len(got) == 3:
                    stack.orchestrator.stop(grace=0)  # the first orchestrator goes away mid-stream
        assert len(got) == 3 and stream.reconnects == 0 and second.core.generating() == 0


def test_which_failed_starts_move_to_the_next_orchestrator():
    """A plain generation's start moves when its orchestrator was never reached or was full; when one was reached and
    broke before the first chunk, only if the orchestrator names the session: one the caller named may have been
    taken there, and the next orchestrator would refuse it as taken."""
    from specsplit.failover import start_moves

    class Failed(grpc.RpcError):
        def __init__(self, code, details=""):
            self._code, self._details = code, details

        def code(self):
            return self._code

        def details(self):
            return self._details

    refused = Failed(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: Connection refused")
    broken = Failed(grpc.StatusCode.UNAVAILABLE, "Socket closed")
    for session_id in ("", "mine"):
        assert start_moves(refused, session_id) and start_moves(Failed(grpc.StatusCode.RESOURCE_EXHAUSTED), session_id)
        assert not start_moves(Failed(grpc.StatusCode.INVALID_ARGUMENT), session_id)
        assert not start_moves(Failed(grpc.StatusCode.DEADLINE_EXCEEDED), session_id)
    assert start_moves(broken, "") and start_moves(Failed(grpc.StatusCode.INTERNAL), "")
    assert not start_moves(broken, "mine") and not start_moves(Failed(grpc.StatusCode.INTERNAL), "mine")


def test_a_plain_generation_refused_for_want_of_room_starts_on_the_next_orchestrator(target):
    with two_orchestrators(target, first_config=OrchestratorConfig(max_streams=0)) as (_, _, client):
        stream = client.generate(prompt_token_ids=PROMPT, max_new_tokens=8)
        assert tokens_of(stream) == hf_greedy(target.model, PROMPT, 8)
        assert stream.reconnects == 1


def test_an_async_client_starts_on_the_next_address_and_never_moves_after_its_first_chunk(target):
    """AsyncClient with several addresses: down, then full (at max_streams), then one that serves: the generation starts
    on the third; every address refusing fails with the last one's status; a failure after the first chunk is raised."""
    from redis_server import free_port

    async def collect(addresses, max_new_tokens, stop_after=0, stack=None):
        got = []
        async with AsyncClient(addresses) as client:
            async for chunk in client.generate(prompt_token_ids=PROMPT, max_new_tokens=max_new_tokens):
                got.append(chunk)
                if len(got) == stop_after:
                    stack.orchestrator.stop(grace=0)  # the orchestrator in use goes away mid-stream
        return got

    down = f"127.0.0.1:{free_port()}"  # nothing listens there
    with two_orchestrators(target, first_config=OrchestratorConfig(max_streams=0)) as (full, second, _):
        got = asyncio.run(collect([down, full.address, second.address], 8))
        assert tokens_of(got) == hf_greedy(target.model, PROMPT, 8)
        with pytest.raises(grpc.RpcError) as err:
            asyncio.run(collect([down, full.address], 8))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with two_orchestrators(target) as (stack, second, _):
        with pytest.raises(grpc.RpcError):
            asyncio.run(collect([stack.address, second.address], 200, stop_after=3, stack=stack))
        assert second.core.generating() == 0


def test_a_start_refused_for_want_of_room_goes_to_the_next_orchestrator(target):
    """RESOURCE_EXHAUSTED at the start (an orchestrator at max_streams) means: retry on another. A resumable generation
    starts on the next address, once, the same start (not a resume of a session no one stored)."""
    with two_orchestrators(target, first_config=OrchestratorConfig(max_streams=0)) as (stack, _, client):
        with pytest.raises(grpc.RpcError) as err:  # the full one alone: refused at once
            list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=8, resume=True))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        stream = client.generate(prompt_token_ids=PROMPT, max_new_tokens=8, resume=True)
        assert tokens_of(stream) == hf_greedy(target.model, PROMPT, 8)
        assert stream.reconnects == 1


def test_a_start_that_made_no_session_is_retried_as_a_start_and_never_cancelled(target):
    """An orchestrator that reaches no verifier fails a resumable start with UNAVAILABLE and a trailer saying it left no
    session: the client starts it again (not a resume, which would be NOT_FOUND) until ``reconnect_s`` runs out, then
    raises and sends no Cancel. Before, it sent one, and the same id started within the next minute (the verifier back)
    began cancelled and ended with no tokens."""
    from redis_server import free_port

    from specsplit.errors import NO_SESSION_KEY
    from specsplit.launch import start_orchestrator, start_verifier

    verifier_address = f"127.0.0.1:{free_port()}"  # nothing listens there yet
    orchestrator = start_orchestrator(verifier_address, [], target.tokenizer)
    try:
        told = []
        client = Client([orchestrator.address], reconnect_s=1.0, on_reconnect=told.append)
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(prompt_token_ids=PROMPT, max_new_tokens=8, resume=True, session_id="retry-me"))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert (NO_SESSION_KEY, "1") in tuple(err.value.trailing_metadata())
        assert told and all(r.code == grpc.StatusCode.UNAVAILABLE for r in told)  # every retry a start: no NOT_FOUND

        verifier = start_verifier(target, address=verifier_address)
        try:
            stream = Client([orchestrator.address], reconnect_s=20).generate(
                prompt_token_ids=PROMPT, max_new_tokens=8, resume=True, session_id="retry-me")
            chunks = list(stream)
            assert tokens_of(chunks) == hf_greedy(target.model, PROMPT, 8)
            assert chunks[-1].finish_reason == "length"
        finally:
            verifier.stop(0)
    finally:
        orchestrator.stop(0)
        orchestrator.core.close()


def test_a_start_the_orchestrator_left_no_session_for_is_started_again_not_resumed():
    """Failover's decision alone: the same UNAVAILABLE with and without the orchestrator's no-session trailer."""
    from specsplit.errors import NO_SESSION_KEY
    from specsplit.failover import Failover, start_moves
    from specsplit.v1 import orchestrator_pb2

    class Failed(grpc.RpcError):
        def __init__(self, trailing=()):
            self._trailing = trailing

        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "no verifier replica answered; retry later"

        def trailing_metadata(self):
            return self._trailing

    start = orchestrator_pb2.GenerateRequest(prompt_token_ids=PROMPT, session_id="mine", resumable=True)
    plain, marked = Failed(), Failed(((NO_SESSION_KEY, "1"),))
    unsure = Failover(start, ["a:1", "b:1"], 10.0, None, resumable=True)
    unsure.after(plain)
    assert unsure.maybe_made and unsure.request.resume_session_id == "mine"  # it may exist: resumed, cancelled at the end
    sure = Failover(start, ["a:1", "b:1"], 10.0, None, resumable=True)
    sure.after(marked)
    assert not sure.maybe_made and sure.request is start and sure.index == 1  # started again, on the next address
    assert start_moves(marked, "mine") and not start_moves(plain, "mine")
