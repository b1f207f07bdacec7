"""Sessions whose edge takes a while to come back: how a verifier's ticks cope (rounds/s, rows per forward).

Each session sleeps ``--turnaround-ms`` between an answer and its next Verify (its network round trip, its
orchestrator and draft), sessions start staggered over one turnaround, and the verifier -- the op-bound proxy
model of ``bench/forward_cost.py``, lean forward, one thread, pinned to CPU 0 -- serves them over gRPC from
``--client-procs`` processes pinned to CPU 1. A tick that waited for every recently answered session would idle
for the far ones; the verifier waits only for those expected back within ``batch_wait_ms``
(``TargetEngine._expected_sessions``). ``--code DIR`` runs another checkout's verifier (an A/B against a commit:
``git worktree add /tmp/old COMMIT``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pathlib
import random
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and cpu < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {cpu})


def _verifier_main(code: str, conn) -> None:
    sys.path[:0] = [code, str(HERE)]
    import torch

    from proxy import proxy_model
    from specsplit.config import VerifierConfig
    from specsplit.launch import start_verifier
    from specsplit.models import LoadedModel

    _pin(0)
    torch.set_num_threads(1)
    server = start_verifier(LoadedModel(proxy_model(), None, "proxy", "proxy"), "127.0.0.1:0",
                            VerifierConfig(max_context=4096))
    conn.send(server.address)
    conn.recv()  # the clients start
    stats = server.core.stats
    before = (stats.forwards, stats.forward_ms, stats.rows)
    conn.recv()  # they are done
    conn.send((stats.forwards - before[0], stats.forward_ms - before[1], stats.rows - before[2]))
    # (no stop: the clients may still hold their channels; the process ends with this function)


def _clients_main(code: str, address: str, sessions: list[int], barrier, rounds: int, turnaround_s: float) -> None:
    sys.path[:0] = [code]
    from specsplit.rpc import RemoteVerifier
    from specsplit.tree import TokenTree

    _pin(1)
    verifier = RemoteVerifier(address)

    def session(i: int) -> None:
        sid = f"s{i}"
        verifier.prefill(sid, list(range(5, 105)), timeout=60)
        barrier.wait()
        time.sleep(random.Random(i).uniform(0, turnaround_s))  # sessions arrive over time, as in serving
        length = 100
        for _ in range(rounds):
            length = verifier.verify_reply(sid, TokenTree.chain([7, 8, 9]), length, 0, timeout=60).committed_length
            time.sleep(turnaround_s)
        barrier.wait()

    threads = [threading.Thread(target=session, args=(i,)) for i in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run(code: str, sessions: int, turnaround_ms: float, rounds: int, procs: int) -> str:
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    verifier = ctx.Process(target=_verifier_main, args=(code, child), daemon=True)
    verifier.start()
    address = conn.recv()
    barrier = ctx.Barrier(sessions + 1)
    clients = [ctx.Process(target=_clients_main, args=(code, address, list(range(p, sessions, procs)), barrier, rounds,
                                                      turnaround_ms / 1e3), daemon=True) for p in range(procs)]
    for c in clients:
        c.start()
    barrier.wait()
    conn.send("start")
    start = time.perf_counter()
    barrier.wait()
    wall = time.perf_counter() - start
    conn.send("stop")
    forwards, forward_ms, rows = conn.recv()
    for c in clients:
        c.join(timeout=30)
    verifier.join(timeout=30)
    return (f"{sessions} sessions, turnaround {turnaround_ms:g} ms: {sessions * rounds / wall:.0f} rounds/s, "
            f"{forwards} forwards, {rows / forwards:.1f} rows each, {forward_ms / forwards:.1f} ms each, "
            f"model busy {forward_ms / 1e3 / wall:.0%}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turnaround-ms", default="5,25,60,150", help="comma-separated edge turnarounds")
    parser.add_argument("--rounds", type=int, default=25, help="Verify rounds per session")
    parser.add_argument("--client-procs", type=int, default=4)
    parser.add_argument("--code", default=str(HERE.parent), help="the checkout whose verifier runs")
    args = parser.parse_args(argv)
    for turnaround in (float(t) for t in args.turnaround_ms.split(",")):
        print(run(args.code, args.sessions, turnaround, args.rounds, args.client_procs), flush=True)


if __name__ == "__main__":
    main()
