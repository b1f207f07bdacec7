"""The client SDK: ``specsplit.Client(address).generate(prompt)`` streams chunks; ``AsyncClient`` for asyncio.

    import specsplit
    with specsplit.Client("localhost:50051") as client:
        for chunk in client.generate("Write a haiku about TCP", max_new_tokens=64):
            print(chunk.text, end="", flush=True)

    # Survives the death of the orchestrator: reconnects to another one (sharing a Redis session store)
    # and resumes after the last token received.
    with specsplit.Client(["orch-a:50051", "orch-b:50051"]) as client:
        for chunk in client.generate("Write a haiku about TCP", resume=True):
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence

import grpc
from opentelemetry import trace

from specsplit.errors import InvalidArgument
from specsplit.failover import Failover, Reconnect
from specsplit.rpc import chunk_from_pb, generate_request_to_pb
from specsplit.sampling import SamplingParams
from specsplit.serving import check_address, open_aio_channel, open_channel
from specsplit.stream import Chunk, RoundStats  # noqa: F401  (re-exported for SDK users)
from specsplit.tls import TLS
from specsplit.v1 import orchestrator_pb2, orchestrator_pb2_grpc

GenerateChunk = Chunk
tracer = trace.get_tracer(__name__)


def record_failure(span, err: Exception) -> None:
    """Mark a client span as failed with ``err``."""
    span.record_exception(err)
    span.set_status(trace.Status(trace.StatusCode.ERROR, str(err)))


class GenerateStream:
    """An iterator of chunks that can be cancelled (the server then stops and frees the session; the iteration ends
    there, without an error). A loop that stops early (``break``, an exception, the iterator closed or dropped) or a
    ``with`` block left before the last chunk cancels it too: the server does not generate on for no one."""

    def __init__(self, call):
        self._call = call
        self._cancelled = False
        self._finished = False  # the chunk with a finish_reason arrived
        self._chunks: Iterator[Chunk] | None = None  # next()'s iteration

    def __iter__(self) -> Iterator[Chunk]:
        try:
            for msg in self._call:
                chunk = chunk_from_pb(msg)
                self._finished = self._finished or bool(chunk.finish_reason)
                yield chunk
        except grpc.RpcError:
            if self._cancelled:
                return  # cancel(): the stream ends here
            raise
        finally:
            self.close()  # stopped early, or failed: nothing more is wanted

    def __next__(self) -> Chunk:
        if self._chunks is None:
            self._chunks = iter(self)
        return next(self._chunks)

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    def close(self) -> None:
        """Cancel the generation unless it has finished."""
        if not self._finished and not self._cancelled:
            self.cancel()

    def __enter__(self) -> "GenerateStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ResumableStream(GenerateStream):
    """A generation that survives its orchestrator: after a failure it reconnects to any of the client's
    orchestrators and resumes the session after the last token it received (none lost, none repeated).

    ``reconnects`` counts the resumes; ``session_id`` names the session (chosen by the client). Also the stream of a
    plain generation given several addresses (``resumable=False``): that one only moves its start (``reconnects``
    counts the moves; ``session_id`` is the caller's, "" when the orchestrator names the session).
    """

    def __init__(self, client: "Client", request, timeout: float | None, resumable: bool = True):
        super().__init__(None)
        self._client = client
        self._failover = Failover(request, client.addresses, client.reconnect_s, client.on_reconnect, resumable)
        self._timeout = timeout
        self._resumable = resumable
        self._cancelled = False
        self._settled = False  # its iteration ended and took care of the session (cancelled it or left it)
        self.session_id = request.session_id

    @property
    def reconnects(self) -> int:
        return self._failover.reconnects

    def __iter__(self) -> Iterator[Chunk]:
        # One span over every call of the generation: a resumed one stays one trace across orchestrators.
        span = tracer.start_span("specsplit.client.generate", attributes={"gen_ai.conversation.id": self.session_id})
        failed = False
        try:
            yield from self._calls(span)
        except Exception as err:
            failed = True
            record_failure(span, err)
            raise
        finally:
            # A resumable session outlives its stream (for a resume); one this client stopped reading or gave up on
            # (its deadline, an error no reconnect mends) would only hold its caches until it expires.
            if not self._finished and not self._cancelled and (not failed or self._failover.maybe_made):
                with contextlib.suppress(Exception):  # best effort, and never in place of the error being raised
                    self.cancel(timeout=1.0)
            self._settled = True
            span.set_attribute("specsplit.reconnects", self.reconnects)
            span.end()

    def close(self) -> None:
        """Cancel the session unless it finished, or its iteration ended and settled it already: a start refused
        is not cancelled (its id may be another live session's), and a stream never iterated made no session (closed,
        it starts none)."""
        if self._settled or self._call is None:
            self._cancelled = True  # (nothing more is wanted of it)
            return
        super().close()

    def _calls(self, span) -> Iterator[Chunk]:
        failover = self._failover
        while True:
            if self._cancelled:  # cancelled before the first call, or while reconnecting: nothing more comes
                return
            with trace.use_span(span, end_on_exit=False):
                self._call = self._client._stub(failover.index).Generate(failover.request, timeout=self._timeout)
            if self._cancelled:  # cancel() ran while the call was being made: it may have missed this one
                self._call.cancel()
                return
            try:
                for msg in self._call:
                    chunk = chunk_from_pb(msg)
                    if failover.take(chunk):
                        self._finished = bool(chunk.finish_reason)
                        yield chunk
                    if chunk.finish_reason:
                        return
                return
            except grpc.RpcError as err:
                if self._cancelled:
                    return  # cancel(): the stream ends here
                time.sleep(failover.after(err))

    def cancel(self, timeout: float = 5.0) -> None:
        """Cancel the session itself (a resumable session outlives a dropped stream), then the stream. The Cancel goes
        to the orchestrator in use, and to the others in turn if it cannot be reached (any of them can cancel a
        session in the store they share). A plain generation ends with its call."""
        self._cancelled = True
        n = len(self._client.addresses) if self._resumable else 0
        for k in range(n):
            try:
                self._client.cancel(self.session_id, index=(self._failover.index + k) % n, timeout=timeout)
                break
            except grpc.RpcError:
                pass  # that orchestrator is gone (or its store is): try the next; else the session expires on its own
        if self._call is not None:
            self._call.cancel()


GRPC_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")


def check_target(address: str) -> str:
    """An orchestrator's HOST:PORT (or a gRPC target name such as ``dns:///host:port`` or ``unix:/path``); specsplit's
    InvalidArgument for anything else, before a channel quietly dials port 443 or fails on a URL."""
    if not isinstance(address, str):
        raise InvalidArgument(f"an orchestrator address is a HOST:PORT string, got {address!r}")
    if address.startswith(("http://", "https://", "grpc://", "grpcs://")):
        raise InvalidArgument(f"{address!r}: give HOST:PORT without a URL scheme (TLS is the tls= argument)")
    return address if address.startswith(GRPC_SCHEMES) else check_address(address, listen=False)


def addresses_of(address: str | Sequence[str]) -> list[str]:
    """A client's orchestrator addresses: one, or several (checked by ``check_target``)."""
    several = not isinstance(address, str) and isinstance(address, Iterable)
    addresses = [check_target(a) for a in (list(address) if several else [address])]
    if not addresses:
        raise ValueError("no orchestrator address given")
    return addresses


def check_timeout(timeout: float | None) -> float | None:
    if timeout is not None and not timeout > 0:  # (grpc would fail the call with DEADLINE_EXCEEDED at once)
        raise ValueError(f"timeout must be > 0 seconds (None: no deadline), got {timeout}")
    return timeout


def check_arguments(max_new_tokens: int | None, temperature: float, top_k: int, top_p: float,
                    timeout: float | None) -> None:
    """What a generation's arguments can be checked for here, as ``ValueError`` before any call (the orchestrator
    checks them again, and the rest: the prompt's length, its server's max_new_tokens limit)."""
    if max_new_tokens is not None and max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0 (None: the server's default), got {max_new_tokens}")
    check_timeout(timeout)
    try:
        SamplingParams(temperature, top_k, top_p).validate()
    except InvalidArgument as err:
        raise ValueError(str(err)) from None


class Client:
    def __init__(self, address: str | Sequence[str], timeout: float | None = 600.0, reconnect_s: float = 30.0,
                 tls: TLS | None = None, on_reconnect: Callable[[Reconnect], None] | None = None):
        """address: host:port of an orchestrator, or several that share a session store (a ``resume=True``
        generation moves between them; any generation starts on the next one while one is down or full);
        timeout: default deadline of a whole generation (s);
        reconnect_s: how long a resumable generation keeps trying to reconnect after a failure;
        tls: ``specsplit.TLS(ca=...)`` for an orchestrator serving TLS (plus ``cert``/``key`` for mutual TLS);
        on_reconnect: called with a ``Reconnect`` before each reconnect of a resumable generation, and before a
        plain one's start moves to the next address (to tell a user why the stream stalls; it must not raise)."""
        self.tls = (tls or TLS()).for_calls()
        self.addresses = addresses_of(address)
        self.address = self.addresses[0]
        self.timeout = check_timeout(timeout)
        self.reconnect_s = reconnect_s
        self.on_reconnect = on_reconnect
        self._channels: dict[int, grpc.Channel] = {}

    def _stub(self, index: int) -> orchestrator_pb2_grpc.OrchestratorServiceStub:
        if index not in self._channels:
            self._channels[index] = open_channel(self.addresses[index], self.tls)
        return orchestrator_pb2_grpc.OrchestratorServiceStub(self._channels[index])

    def generate(self, prompt: str = "", *, messages: Sequence[dict] | None = None,
                 prompt_token_ids: Sequence[int] | None = None, max_new_tokens: int | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop: Sequence[str] = (), draft: str = "auto", chat_template: bool = True, session_id: str = "",
                 timeout: float | None = None, resume: bool = False, rejection_sampling: bool = False
                 ) -> GenerateStream:
        """resume: survive the orchestrator (reconnect to any of this client's addresses and resume).
        rejection_sampling: with temperature > 0, verify by rejection sampling against the draft's own draws instead
        of coupled draws (the default: the tokens then depend on the seed alone; README "Sampling")."""
        if resume:
            session_id = session_id or uuid.uuid4().hex
        check_arguments(max_new_tokens, temperature, top_k, top_p, timeout)
        request = generate_request_to_pb(prompt, messages, prompt_token_ids, max_new_tokens, temperature, top_k,
                                         top_p, seed, stop, draft, chat_template, session_id, resumable=resume,
                                         rejection_sampling=rejection_sampling)
        if resume or len(self.addresses) > 1:  # (several addresses: a plain generation may start on any of them)
            return ResumableStream(self, request, timeout or self.timeout, resumable=resume)
        return GenerateStream(self._stub(0).Generate(request, timeout=timeout or self.timeout))

    def cancel(self, session_id: str, index: int = 0, timeout: float = 5.0) -> bool:
        """Cancel a session on whichever orchestrator runs it; False if it already ended or is unknown."""
        request = orchestrator_pb2.CancelRequest(session_id=session_id)
        return self._stub(index).Cancel(request, timeout=timeout).cancelled

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    def __init__(self, address: str | Sequence[str], timeout: float | None = 600.0, tls: TLS | None = None, *,
                 reconnect_s: float = 30.0, on_reconnect: Callable[[Reconnect], None] | None = None):
        """The ``Client``'s arguments, for asyncio: a ``resume=True`` generation moves between the addresses and
        resumes; any generation starts on the next address while one is down or full. ``close()`` (or leaving
        ``async with``) cancels the resumable sessions of generations still open (left by ``break`` and not yet
        closed by the event loop, or still being read)."""
        self.addresses = addresses_of(address)
        self.address = self.addresses[0]
        self.timeout = check_timeout(timeout)
        self.reconnect_s = reconnect_s
        self.on_reconnect = on_reconnect
        self._tls = (tls or TLS()).for_calls()
        self._channels: dict[int, grpc.aio.Channel] = {}  # opened on first use, inside the event loop that uses it
        # Resumable generations not yet ended, by id(their failover) (not by session id: a second generation naming a
        # live session's id, refused, must not take the first one's entry with it).
        self._open: dict[int, Failover] = {}

    def _stub(self, index: int) -> orchestrator_pb2_grpc.OrchestratorServiceStub:
        if index not in self._channels:
            self._channels[index] = open_aio_channel(self.addresses[index], self._tls)
        return orchestrator_pb2_grpc.OrchestratorServiceStub(self._channels[index])

    async def generate(self, prompt: str = "", *, messages: Sequence[dict] | None = None,
                       prompt_token_ids: Sequence[int] | None = None, max_new_tokens: int | None = None,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                       stop: Sequence[str] = (), draft: str = "auto", chat_template: bool = True,
                       session_id: str = "", timeout: float | None = None, resume: bool = False,
                       rejection_sampling: bool = False) -> AsyncIterator[Chunk]:
        """The ``Client.generate`` arguments. resume=True: the session outlives its orchestrator (name it with
        ``session_id`` to cancel it from elsewhere; otherwise the client names it); a generation this loop leaves before
        its last chunk (``break``, an exception, ``aclose()``) or gives up on is cancelled."""
        if resume:
            session_id = session_id or uuid.uuid4().hex
        check_arguments(max_new_tokens, temperature, top_k, top_p, timeout)
        request = generate_request_to_pb(prompt, messages, prompt_token_ids, max_new_tokens, temperature, top_k,
                                         top_p, seed, stop, draft, chat_template, session_id, resumable=resume,
                                         rejection_sampling=rejection_sampling)
        failover = Failover(request, self.addresses, self.reconnect_s, self.on_reconnect, resumable=resume)
        span = tracer.start_span("specsplit.client.generate", attributes={"gen_ai.conversation.id": session_id})
        finished = failed = False
        if resume:
            self._open[id(failover)] = failover
        try:
            while True:
                with trace.use_span(span, end_on_exit=False):
                    call = self._stub(failover.index).Generate(failover.request, timeout=timeout or self.timeout)
                try:
                    async for msg in call:
                        chunk = chunk_from_pb(msg)
                        if failover.take(chunk):
                            finished = bool(chunk.finish_reason)
                            yield chunk
                        if chunk.finish_reason:
                            return
                    return
                except grpc.RpcError as err:
                    await asyncio.sleep(failover.after(err))
                finally:
                    call.cancel()
        except Exception as err:
            failed = True
            record_failure(span, err)
            raise
        finally:
            span.set_attribute("specsplit.reconnects", failover.reconnects)
            span.end()  # (first: the Cancel below awaits, and a second cancellation of this task may stop it there)
            # A resumable session outlives its call; one left or given up on is cancelled, as the Client's stream does
            # (unless close() has: it cancels those still open).
            if self._open.pop(id(failover), None) is not None and not finished and (not failed or failover.maybe_made):
                await self._cancel(session_id, failover.index)

    async def _cancel(self, session_id: str, index: int) -> None:
        """Cancel a session through the orchestrator at ``index``, else the others in turn; best effort (never in
        place of an error being raised: the session then expires on its own)."""
        request = orchestrator_pb2.CancelRequest(session_id=session_id)
        for k in range(len(self.addresses)):
            with contextlib.suppress(Exception):
                await self._stub((index + k) % len(self.addresses)).Cancel(request, timeout=1.0)
                return

    async def close(self) -> None:
        """Cancel the open resumable generations' sessions, then close the channels."""
        open_, self._open = self._open, {}  # (their generators, when they end, find theirs gone and cancel nothing)
        for failover in open_.values():
            await self._cancel(failover.request.session_id, failover.index)
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
