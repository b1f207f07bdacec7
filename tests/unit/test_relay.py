"""The benchmark's delaying TCP relay: bytes arrive intact and in order, each direction delayed."""

import os
import pathlib
import socket
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
from relay import DelayRelay  # noqa: E402


def echo_server():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()

    def serve():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(65536), b"")] and None
                             or c.close(), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return sock


def test_bytes_identical_and_delayed():
    server = echo_server()
    with DelayRelay("127.0.0.1:0", f"127.0.0.1:{server.getsockname()[1]}", rtt_ms=60) as relay:
        host, port = relay.address.split(":")
        with socket.create_connection((host, int(port))) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for size in (1, 1000, 300_000):
                payload = os.urandom(size)
                start = time.perf_counter()
                conn.sendall(payload)
                got = b""
                while len(got) < size:
                    got += conn.recv(1 << 20)
                elapsed_ms = (time.perf_counter() - start) * 1e3
                assert got == payload
                assert elapsed_ms >= 60  # 30 ms each way
    server.close()


def test_zero_delay_passes_through():
    server = echo_server()
    with DelayRelay("127.0.0.1:0", f"127.0.0.1:{server.getsockname()[1]}", rtt_ms=0) as relay:
        host, port = relay.address.split(":")
        with socket.create_connection((host, int(port))) as conn:
            start = time.perf_counter()
            conn.sendall(b"ping")
            assert conn.recv(16) == b"ping"
            assert time.perf_counter() - start < 0.5
    server.close()
