"""A TCP relay that delays each direction by a fixed time: the network between edge and cloud.

Where ``tc netem`` is missing (this project's kernel has no netem qdisc), this relay sits on the path
between the edge and the cloud namespaces and gives gRPC true TCP latency: every chunk read from one
side is written to the other ``delay_ms`` later (RTT/2 each way, so a request and its answer pay one
RTT), in order. Bandwidth is not limited and nothing is dropped.

    python bench/relay.py --listen 10.77.0.2:50060 --upstream 10.77.0.2:50052 --rtt-ms 50

``DelayRelay`` runs the same relay on a thread of the calling process (tests, loopback fallback).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy reader -> writer, each chunk written ``delay_s`` after it was read, in order."""
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue = asyncio.Queue()

    async def read() -> None:
        try:
            while data := await reader.read(1 << 16):
                chunks.put_nowait((loop.time() + delay_s, data))
        except (ConnectionError, OSError):
            pass
        chunks.put_nowait((loop.time() + delay_s, b""))  # end of stream, delayed like the data

    async def write() -> None:
        try:
            while True:
                due, data = await chunks.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    break
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass

    await asyncio.gather(read(), write())


async def _serve(listen: tuple[str, int], upstream: tuple[str, int], delay_s: float,
                 started: threading.Event | None = None, bound: list | None = None) -> None:
    async def handle(client_reader, client_writer):
        try:
            up_reader, up_writer = await asyncio.open_connection(*upstream)
        except OSError:
            client_writer.close()
            return
        try:
            await asyncio.gather(_pump(client_reader, up_writer, delay_s), _pump(up_reader, client_writer, delay_s))
        finally:
            for w in (client_writer, up_writer):
                w.close()

    server = await asyncio.start_server(handle, *listen)
    if bound is not None:
        bound.append(server.sockets[0].getsockname()[1])
    if started is not None:
        started.set()
    async with server:
        await server.serve_forever()


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


class DelayRelay:
    """The relay on a background thread: ``with DelayRelay("127.0.0.1:0", "127.0.0.1:50052", rtt_ms=50) as r: r.address``."""

    def __init__(self, listen: str, upstream: str, rtt_ms: float):
        self._listen, self._upstream, self.rtt_ms = _host_port(listen), _host_port(upstream), rtt_ms
        self._loop = asyncio.new_event_loop()
        self._bound: list[int] = []
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True, name="delay-relay")
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError(f"relay could not listen on {listen}")
        self.address = f"{self._listen[0]}:{self._bound[0]}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._task = self._loop.create_task(
            _serve(self._listen, self._upstream, self.rtt_ms / 2000.0, started, self._bound))
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        rest = asyncio.all_tasks(self._loop)  # connections still open: cancel them and let them finish
        for task in rest:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
        self._loop.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(5)

    def __enter__(self) -> "DelayRelay":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept connections on")
    parser.add_argument("--upstream", required=True, help="HOST:PORT every connection is relayed to")
    parser.add_argument("--rtt-ms", type=float, required=True, help="round-trip delay added (RTT/2 each way)")
    args = parser.parse_args()
    loop = asyncio.new_event_loop()
    task = loop.create_task(_serve(_host_port(args.listen), _host_port(args.upstream), args.rtt_ms / 2000.0))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    print(f"relay {args.listen} -> {args.upstream}, RTT +{args.rtt_ms:g} ms", flush=True)
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:
        pass


if __name__ == "__main__":
    main()
