"""The verifier's model thread: gathers pending work into ticks and runs each tick's forwards.

Requests (a Verify, a Prefill, a Release) arrive from gRPC threads as ``Work`` and wait on a future.
One thread takes them in arrival order into a *tick*: up to ``max_batch`` works and ``max_tokens``
tokens, waiting at most ``wait_s`` after the first for the sessions expected back by then (and not at
all once they all have something in the tick; a session whose round trip usually takes longer is not
waited for, so a far or slow edge never holds everyone's forward). Two works of one session never share a tick: the
second ends the gathering and opens the next tick. Work that needs more ticks (a long Prefill, one
chunk per tick; a decode burst, one step per tick) goes in the next one right after the works that waited (did not
fit in this tick, or came during it): a long prompt holds no one back more than a tick.

All forwards run on this one thread (see ``specsplit.runner`` for why), under inference mode.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from specsplit.errors import Unavailable


@dataclass(eq=False)
class Work:
    key: object  # the session this work belongs to
    tokens: int  # tokens it adds to the tick (0 for bookkeeping such as Release)
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)
    busy_at_submit: float = 0.0  # the scheduler's busy_s() when it was submitted


_STOP = object()


class Scheduler:
    def __init__(self, run_tick: Callable[[list[Work]], list[Work]], max_batch: int, max_tokens: int, wait_s: float,
                 expected: Callable[[float], set[int]] | None = None, name: str = "verifier", threads: int = 0):
        """run_tick(works) runs one tick, resolves what finished and returns the works that continue.
        expected(deadline): the ``id``s of the work keys (sessions) a tick waits for until ``deadline`` (a
        perf_counter time); None: always wait the whole ``wait_s``.
        threads: torch CPU threads of the ticks (0: the process's; OpenMP's count is per calling thread)."""
        self.run_tick = run_tick
        self.threads = threads
        self.max_batch, self.max_tokens, self.wait_s = max_batch, max_tokens, wait_s
        self.expected = expected
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._carry: collections.deque[Work] = collections.deque()  # first in the next tick
        self._closed = False
        self._busy_lock = threading.Lock()
        self._busy_s = 0.0  # the model thread's summed time in ticks (finished ones)
        self._tick_start: float | None = None  # perf_counter when the running tick began (None: gathering or idle)
        self._thread = threading.Thread(target=self._loop, name=f"specsplit-{name}", daemon=True)
        self._thread.start()

    def submit(self, work: Work) -> Future:
        if self._closed:
            raise Unavailable("the verifier is shutting down")
        work.busy_at_submit = self.busy_s()
        self._queue.put(work)
        return work.future

    def busy_s(self) -> float:
        """The model thread's time in ticks so far, the running one counted to now (any thread): between a work's
        submission and its answer, the time the model worked rather than idled (gathering, waiting for sessions
        on their way back, or with nothing to do)."""
        with self._busy_lock:
            return self._busy_s + (time.perf_counter() - self._tick_start if self._tick_start is not None else 0.0)

    def close(self) -> None:
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout=10)

    # -- the model thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        while True:
            batch = self.gather()
            if batch is None:
                break
            with self._busy_lock:
                self._tick_start = time.perf_counter()
            try:
                with torch.inference_mode():
                    continuing = self.run_tick(batch)
            except BaseException as err:  # run_tick resolves its own errors; this is the backstop
                continuing = []
                for work in batch:
                    if not work.future.done():
                        work.future.set_exception(err)
            finally:
                with self._busy_lock:
                    self._busy_s += time.perf_counter() - self._tick_start
                    self._tick_start = None
            self._requeue(continuing)
        for work in [*self._carry, *self._drain()]:
            work.future.set_exception(Unavailable("the verifier shut down before this request ran"))

    def _requeue(self, continuing: list[Work]) -> None:
        """The next tick's order: the works that waited (they did not fit in this tick, or came during it) before those
        that continue (a prompt's next chunk, a burst's next step), so a long prompt or a burst holds no one back more
        than a tick; a waiting work of a session that continues stays behind it (a session's works keep their order)."""
        waiting = [*self._carry]
        self._carry.clear()
        while (item := self._get(0.0)) is not None:
            if item is _STOP:
                self._queue.put(_STOP)  # (behind what it followed, now in the carry)
                break
            waiting.append(item)
        going = {id(work.key) for work in continuing}
        self._carry.extend([w for w in waiting if id(w.key) not in going] + continuing +
                           [w for w in waiting if id(w.key) in going])

    def gather(self) -> list[Work] | None:
        """The next tick's works (None once closed)."""
        batch: list[Work] = []
        keys: set[int] = set()
        missing: set[int] | None = None  # expected sessions not in the tick yet (None: wait for anyone)
        tokens, deadline = 0, 0.0
        while len(batch) < self.max_batch:
            if self._carry:
                work = self._carry.popleft()
            else:
                if not batch:
                    timeout = None  # idle: block until something arrives
                elif missing is not None and not missing:
                    timeout = 0.0  # every expected session is in: take only what is already queued
                else:
                    timeout = max(0.0, deadline - time.perf_counter())
                work = self._get(timeout)
                if work is None:
                    break
            if work is _STOP:
                if batch:
                    self._queue.put(_STOP)
                    break
                return None
            if batch and (id(work.key) in keys or tokens + work.tokens > self.max_tokens):
                self._carry.appendleft(work)  # opens the next tick
                break
            if not batch:
                deadline = time.perf_counter() + self.wait_s
                missing = self.expected(deadline) if self.expected is not None else None
            batch.append(work)
            keys.add(id(work.key))
            if missing is not None:
                missing.discard(id(work.key))
            tokens += work.tokens
        return batch

    def _get(self, timeout: float | None):
        try:
            if timeout == 0.0:
                return self._queue.get_nowait()
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def _drain(self) -> list[Work]:
        items = []
        while (item := self._get(0.0)) is not None:
            if item is not _STOP:
                items.append(item)
        return items
