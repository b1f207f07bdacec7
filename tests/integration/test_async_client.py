"""The AsyncClient's resumable generations (real gRPC, two orchestrators sharing one session store): a resume after
the orchestrator in use goes away, and the session a loop leaves early is cancelled, as with the sync Client."""

import asyncio

import grpc
import pytest

from specsplit.client import AsyncClient
from specsplit.store import CANCELLED
from test_resume import PROMPT, tokens_of, two_orchestrators
from tiny import hf_greedy, span_exporter, wait_for


def test_an_async_resumable_generation_resumes_on_the_other_orchestrator(target):
    """The first orchestrator stops mid-stream; the async generation resumes on the second after the last token it
    received: HF greedy's tokens, one header, the reconnect told and counted on the client's span (before, the
    AsyncClient had no resume: the generation failed)."""
    exporter = span_exporter()
    told = []

    async def collect(stack, second):
        got = []
        async with AsyncClient([stack.address, second.address], reconnect_s=10, on_reconnect=told.append) as client:
            async for chunk in client.generate(prompt_token_ids=PROMPT, max_new_tokens=200, resume=True,
                                               session_id="async-moved"):
                got.append(chunk)
                if len(got) == 3:
                    stack.orchestrator.stop(grace=0)  # the orchestrator in use goes away mid-stream
        return got

    with two_orchestrators(target) as (stack, second, _):
        got = asyncio.run(collect(stack, second))
        assert tokens_of(got) == hf_greedy(target.model, PROMPT, 200) and got[-1].finish_reason == "length"
        assert sum(1 for c in got if c.prompt_token_ids) == 1  # one header, however many reconnects
        assert told and told[0].failed == stack.address and told[0].next == second.address
        assert second.core.store.load("async-moved").status != CANCELLED  # finished: nothing to cancel
    (top,) = [s for s in exporter.get_finished_spans() if s.name == "specsplit.client.generate"]
    exporter.shutdown()
    assert top.attributes["gen_ai.conversation.id"] == "async-moved"
    assert top.attributes["specsplit.reconnects"] == len(told) >= 1


def test_an_async_resumable_generation_left_early_is_cancelled(target):
    """A resumable session outlives its call (for a resume): a loop that leaves it early cancels it, through the next
    orchestrator when the one in use is gone; a plain start that nothing takes still fails at once."""

    async def read(addresses, n, stack=None):
        async with AsyncClient(addresses, reconnect_s=10) as client:
            got = []
            stream = client.generate(prompt_token_ids=PROMPT, max_new_tokens=200, resume=True, session_id="left")
            async for chunk in stream:
                got.append(chunk)
                if len(got) == n:
                    if stack is not None:
                        stack.orchestrator.stop(grace=0)  # the one in use is gone: the Cancel goes to the other
                    break
            await stream.aclose()
            return got

    with two_orchestrators(target) as (stack, second, _):
        got = asyncio.run(read([stack.address, second.address], 2, stack=stack))
        assert len(got) == 2
        assert wait_for(lambda: second.core.store.load("left").status == CANCELLED)
        assert wait_for(lambda: stack.verifier_sessions() == 0)
    with pytest.raises(grpc.RpcError) as err:
        asyncio.run(read(["127.0.0.1:1", "127.0.0.1:2"], 1))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_closing_an_async_client_cancels_the_sessions_its_loops_left(target):
    """A loop left by ``break`` without ``aclose()``: the event loop closes that generator later, maybe after the
    client is closed (before, its Cancel then opened a new channel that was never closed, and a second cancellation
    could leave its span unended). Leaving ``async with`` cancels the session itself; the span ends; no channel is left."""
    exporter = span_exporter()

    async def leave(address):
        client = AsyncClient(address)
        async with client:
            async for _ in client.generate(prompt_token_ids=PROMPT, max_new_tokens=200, resume=True,
                                           session_id="left-open"):
                break
        return client

    with two_orchestrators(target) as (stack, _, _):
        client = asyncio.run(leave(stack.address))
        assert wait_for(lambda: stack.orchestrator.core.store.load("left-open").status == CANCELLED)
        assert client._channels == {} and client._open == {}
    spans = [s for s in exporter.get_finished_spans() if s.name == "specsplit.client.generate"]
    exporter.shutdown()
    assert [s.attributes["gen_ai.conversation.id"] for s in spans] == ["left-open"]


@pytest.mark.parametrize("kind", ["sync", "sync-with", "async"])
def test_a_refused_resumable_start_cancels_no_session(target, monkeypatch, kind):
    """A resumable start the orchestrator refuses sends no Cancel (before, the Client and the AsyncClient both did,
    and a Client stream read in a ``with`` block did still when the block ended): the id of a request over the
    server's limit then began cancelled when retried within a minute, and a start refused because another live
    generation holds its id ended that generation."""
    from specsplit.client import Client
    from specsplit.launch import start_stack
    from tiny import hold_each_forward

    def run(address, **kwargs):
        kwargs.update(prompt_token_ids=PROMPT, resume=True)
        if kind == "sync":
            return list(Client(address).generate(**kwargs))
        if kind == "sync-with":
            with Client(address).generate(**kwargs) as stream:
                return list(stream)

        async def collect():
            async with AsyncClient(address) as client:
                return [chunk async for chunk in client.generate(**kwargs)]

        return asyncio.run(collect())

    with start_stack(target, []) as stack:
        with pytest.raises(grpc.RpcError) as err:
            run(stack.address, session_id="again", max_new_tokens=10**6)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        chunks = run(stack.address, session_id="again", max_new_tokens=8)
        assert tokens_of(chunks) == hf_greedy(target.model, PROMPT, 8) and chunks[-1].finish_reason == "length"

        hold_each_forward(stack.verifier_engine, monkeypatch)  # (the holder is still generating when the twin starts)
        holder = iter(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=60, resume=True,
                                                     session_id="held"))
        got = [next(holder), next(holder)]
        with pytest.raises(grpc.RpcError) as err:
            run(stack.address, session_id="held", max_new_tokens=8)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        got += list(holder)
        assert tokens_of(got) == hf_greedy(target.model, PROMPT, 60) and got[-1].finish_reason == "length"


def test_a_refused_twin_does_not_take_the_live_generation_s_place(target, monkeypatch):
    """An AsyncClient generation naming the id of one of its live generations is refused; the live one, left early
    after that, is still cancelled (before, the twin took the live one's entry with it, and nothing cancelled it: it
    held its caches until it expired)."""
    from specsplit.launch import start_stack
    from tiny import hold_each_forward

    async def twins(address):
        async with AsyncClient(address) as client:
            holder = client.generate(prompt_token_ids=PROMPT, max_new_tokens=60, resume=True, session_id="held")
            await holder.__anext__()
            with pytest.raises(grpc.RpcError) as err:
                async for _ in client.generate(prompt_token_ids=PROMPT, max_new_tokens=8, resume=True,
                                               session_id="held"):
                    pass
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            await holder.aclose()  # left early: cancelled

    with start_stack(target, []) as stack:
        hold_each_forward(stack.verifier_engine, monkeypatch)
        asyncio.run(twins(stack.address))
        assert wait_for(lambda: stack.orchestrator.core.store.load("held").status == CANCELLED)
