"""Freeing sessions whose owner vanished: anything untouched for longer than ``idle_s`` is released.

A finished or cancelled generation releases its sessions itself; this catches the rest (an
orchestrator killed mid-generation, a client that never came back to resume).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from specsplit.errors import Unavailable

log = logging.getLogger(__name__)


class IdleSweeper:
    def __init__(self, release: Callable[[str], object], idle_s: float, interval_s: float | None = None):
        """release(session_id) frees one session; idle_s <= 0 turns the sweep off."""
        self.idle_s = idle_s
        self._release = release
        self._last_used: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if idle_s > 0:
            self._interval = interval_s or max(0.05, min(idle_s / 4, 30.0))
            self._thread = threading.Thread(target=self._run, name="specsplit-idle-sweep", daemon=True)
            self._thread.start()

    def touch(self, session_id: str) -> None:
        with self._lock:
            self._last_used[session_id] = time.monotonic()

    def forget(self, session_id: str) -> None:
        with self._lock:
            self._last_used.pop(session_id, None)

    def sweep(self) -> list[str]:
        """Release every session idle for longer than idle_s; return their ids."""
        cutoff = time.monotonic() - self.idle_s
        with self._lock:
            idle = [sid for sid, t in self._last_used.items() if t < cutoff]
            for sid in idle:
                del self._last_used[sid]
        for sid in idle:
            try:
                self._release(sid)
            except Unavailable as err:  # the service is shutting down (its sessions go with it): no traceback
                log.info("idle session %s not released: %s", sid, err)
            except Exception:  # noqa: BLE001 - a failed release must not stop the sweep
                log.exception("releasing idle session %s failed", sid)
        if idle:
            log.info("released %d sessions idle for more than %.0f s", len(idle), self.idle_s)
        return idle

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sweep()

    def close(self) -> None:
        self._stop.set()
