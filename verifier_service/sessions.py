"""The verifier's sessions by id: admission under its limits, lookup, release.

A session is admitted with its lock already held by the admitting Prefill (or Import), so nothing else
runs on it before its cache is built; a Verify that arrives a moment before its session's Prefill (an
orchestrator that sends the first tree right behind the Prefill) waits briefly for the admission.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from specsplit import metrics as meter
from specsplit.errors import FailedPrecondition, NotFound, ResourceExhausted
from specsplit.sampling import SamplingParams, session_generator
from verifier_service.work import TargetSession

# A Verify for a session not (yet) admitted waits this long for its Prefill, which may have been sent just before it.
ADMISSION_GRACE_S = 0.05


class SessionTable:
    def __init__(self, max_sessions: int, max_queued_prefill_tokens: int):
        self.max_sessions = max_sessions
        self.max_queued_prefill_tokens = max_queued_prefill_tokens
        self._sessions: dict[str, TargetSession] = {}
        self._lock = threading.Condition()  # notified when a session is admitted
        self._queued_prefill_tokens = 0  # prompt tokens admitted and not cached yet

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def all(self) -> list[TargetSession]:
        return list(self._sessions.values())

    def admit(self, session_id: str, token_ids: list[int], sampling: SamplingParams, to_cache: int) -> TargetSession:
        """Register a new session, its lock held by the caller (who releases it once the cache is built); refused
        when the id is taken or the verifier is full. to_cache: its prompt tokens still to be cached."""
        with self._lock:
            if session_id in self._sessions:
                raise FailedPrecondition(f"session {session_id!r} already exists; Release it or use a new id")
            if len(self._sessions) >= self.max_sessions:
                meter.refused.add(1, {"reason": "max_sessions"})
                raise ResourceExhausted(f"verifier holds {len(self._sessions)} sessions (max_sessions="
                                        f"{self.max_sessions}); retry later or on another replica")
            queued = self._queued_prefill_tokens
            if to_cache and queued and queued + to_cache > self.max_queued_prefill_tokens:
                meter.refused.add(1, {"reason": "prefill_queue"})
                raise ResourceExhausted(
                    f"verifier has {queued} prompt tokens waiting to be cached (max_queued_prefill_tokens="
                    f"{self.max_queued_prefill_tokens}); retry later or on another replica")
            session = TargetSession(list(token_ids), sampling, session_generator(sampling))
            session.lock.acquire()
            self._sessions[session_id] = session
            meter.sessions.add(1)
            self._queued_prefill_tokens += to_cache
            self._lock.notify_all()
        return session

    def get(self, session_id: str, wait_s: float = 0.0) -> TargetSession:
        """The session; wait_s: how long to wait for one not admitted yet. NotFound if there is none."""
        if wait_s > 0:
            with self._lock:
                self._lock.wait_for(lambda: session_id in self._sessions, timeout=wait_s)
        try:
            return self._sessions[session_id]
        except KeyError:
            raise NotFound(f"unknown session {session_id!r}: it was never prefilled here, or was released") from None

    def release(self, session_id: str, then: Callable[[TargetSession], None],
                expected: TargetSession | None = None) -> bool:
        """Forget the session and call ``then(session)`` under the table's lock (so that whatever it queues comes
        before the work of any session admitted after); False if there was none. ``expected``: only that session --
        a failed Prefill or import cleaning up after itself must not release a newer session that took its id
        meanwhile (a Release, then a resumed session's Prefill, while the failed one's tick still ran)."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or (expected is not None and session is not expected):
                return False
            del self._sessions[session_id]
            meter.sessions.add(-1)
            session.released = True
            then(session)
        return True

    def cached(self, num_tokens: int) -> None:
        """That many admitted prompt tokens are cached now (or will not be)."""
        with self._lock:
            self._queued_prefill_tokens -= num_tokens
