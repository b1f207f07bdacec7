"""The client SDK: ``specsplit.Client(address).generate(prompt)`` streams chunks; ``AsyncClient`` for asyncio.

    import specsplit
    with specsplit.Client("localhost:50051") as client:
        for chunk in client.generate("Write a haiku about TCP", max_new_tokens=64):
            print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence

import grpc

from specsplit.rpc import chunk_from_pb, generate_request_to_pb
from specsplit.serving import CHANNEL_OPTIONS, open_channel
from specsplit.stream import Chunk, RoundStats  # noqa: F401  (re-exported for SDK users)
from specsplit.v1 import orchestrator_pb2_grpc

GenerateChunk = Chunk


class GenerateStream:
    """An iterator of chunks that can be cancelled (the server then stops and frees the session)."""

    def __init__(self, call):
        self._call = call

    def __iter__(self) -> Iterator[Chunk]:
        for msg in self._call:
            yield chunk_from_pb(msg)

    def cancel(self) -> None:
        self._call.cancel()


class Client:
    def __init__(self, address: str, timeout: float | None = 600.0):
        """address: host:port of an orchestrator; timeout: default deadline of a whole generation (s)."""
        self.address = address
        self.timeout = timeout
        self._channel = open_channel(address)
        self._stub = orchestrator_pb2_grpc.OrchestratorServiceStub(self._channel)

    def generate(self, prompt: str = "", *, messages: Sequence[dict] | None = None,
                 prompt_token_ids: Sequence[int] | None = None, max_new_tokens: int | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop: Sequence[str] = (), draft: str = "auto", chat_template: bool = True, session_id: str = "",
                 timeout: float | None = None) -> GenerateStream:
        request = generate_request_to_pb(prompt, messages, prompt_token_ids, max_new_tokens, temperature, top_k,
                                         top_p, seed, stop, draft, chat_template, session_id)
        return GenerateStream(self._stub.Generate(request, timeout=timeout or self.timeout))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    def __init__(self, address: str, timeout: float | None = 600.0):
        from opentelemetry.instrumentation.grpc import aio_client_interceptors

        self.address = address
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS,
                                                  interceptors=aio_client_interceptors())
        self._stub = orchestrator_pb2_grpc.OrchestratorServiceStub(self._channel)

    async def generate(self, prompt: str = "", *, messages: Sequence[dict] | None = None,
                       prompt_token_ids: Sequence[int] | None = None, max_new_tokens: int | None = None,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                       stop: Sequence[str] = (), draft: str = "auto", chat_template: bool = True,
                       session_id: str = "", timeout: float | None = None) -> AsyncIterator[Chunk]:
        request = generate_request_to_pb(prompt, messages, prompt_token_ids, max_new_tokens, temperature, top_k,
                                         top_p, seed, stop, draft, chat_template, session_id)
        call = self._stub.Generate(request, timeout=timeout or self.timeout)
        try:
            async for msg in call:
                yield chunk_from_pb(msg)
        finally:
            call.cancel()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
