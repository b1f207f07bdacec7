"""Verifier replicas: which are up (grpc.health.v1 checks plus failed calls), and where a session goes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from specsplit.errors import Unavailable
from specsplit.tls import hung_up_on_plaintext

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Replica:
    address: str
    client: object  # a RemoteVerifier
    healthy: bool = True  # optimistic until a health check or a call says otherwise
    sessions: int = 0  # sessions this orchestrator placed here and has not released
    failed_checks: int = 0  # health checks failed in a row
    cut: bool = False  # its calls in flight were cut short since it last passed a check


class ReplicaSet:
    """Verifier replicas behind one orchestrator; a background thread health-checks them."""

    def __init__(self, clients: list, health_interval_s: float = 1.0, health_timeout_s: float = 1.0,
                 cut_after: int = 3):
        """cut_after: health checks failed in a row after which the replica's calls in flight are cut short (their
        sessions move; 0: never), once another replica passes its checks: a hung replica or a partitioned link
        otherwise holds them to their deadline. With nowhere to move, they are left to answer (a replica too busy to
        answer its checks, the only one, would otherwise fail every session it holds)."""
        if not clients:
            raise ValueError("at least one verifier replica is needed")
        self.replicas = [Replica(c.address, c) for c in clients]
        self.up = True  # some replica passed its last health check (optimistic until the first round)
        self._watchers: list = []  # called with ``up`` when it changes
        self.health_timeout_s = health_timeout_s
        self.cut_after = cut_after
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if health_interval_s > 0:
            self._thread = threading.Thread(target=self._run, args=(health_interval_s,),
                                            name="specsplit-health", daemon=True)
            self._thread.start()

    def __iter__(self):
        return iter(self.replicas)

    def by_address(self, address: str) -> Replica | None:
        return next((r for r in self.replicas if r.address == address), None)

    def pick(self, exclude: Iterable[str] = (), reserve: bool = False) -> Replica:
        """The healthy replica with the fewest of our sessions (not in ``exclude``); else any not excluded.

        reserve: count the session on it at once (``placed(replica, -1)`` undoes it if the load fails), so
        sessions that arrive together spread over the replicas instead of all taking the one that was
        emptiest before any of them had loaded.
        """
        excluded = set(exclude)
        with self._lock:
            candidates = [r for r in self.replicas if r.address not in excluded]
            healthy = [r for r in candidates if r.healthy]
            if not candidates:
                raise Unavailable("no verifier replica is reachable (tried: "
                                  f"{', '.join(sorted(excluded)) or 'none'}); retry later")
            # A replica marked down may be back before the next health check: try it last, not never.
            replica = min(healthy or candidates, key=lambda r: r.sessions)
            if reserve:
                replica.sessions += 1
            return replica

    def placed(self, replica: Replica, delta: int) -> None:
        with self._lock:
            replica.sessions = max(0, replica.sessions + delta)

    def mark_down(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            log.warning("verifier replica %s is down (%s)", replica.address, reason)
        replica.healthy = False

    def check(self) -> None:
        """One round of grpc.health.v1 checks."""
        for replica in self.replicas:
            ok = replica.client.healthy(self.health_timeout_s)
            if ok and not replica.healthy:
                log.warning("verifier replica %s is back", replica.address)
            elif not ok and replica.healthy:
                why = getattr(replica.client, "health_error", "")  # (an in-process replica has none)
                log.warning("verifier replica %s failed its health check%s", replica.address, f" ({why})" if why else "")
            replica.healthy = ok
            replica.failed_checks = 0 if ok else replica.failed_checks + 1
            replica.cut = replica.cut and not ok
        up = any(r.healthy for r in self.replicas)
        if up != self.up:
            self.up = up
            log.warning("verifier replicas: %s", "one passes its health checks again" if up else
                        "none passes its health checks; this orchestrator reports NOT_SERVING until one does")
            for watcher in self._watchers:
                watcher(up)
        for replica in self.replicas:
            elsewhere = any(r.healthy for r in self.replicas if r is not replica)
            if (self.cut_after and replica.failed_checks >= self.cut_after and not replica.cut and elsewhere
                    and hasattr(replica.client, "cut_calls")):
                replica.cut = True
                cut = replica.client.cut_calls()
                if cut:
                    log.warning("verifier replica %s failed %d health checks in a row: %d calls to it cut short (their "
                                "sessions move)", replica.address, replica.failed_checks, cut)

    def watch(self, watcher) -> None:
        """``watcher(up)`` after each health-check round that changes whether any replica passes its checks."""
        self._watchers.append(watcher)

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.check()

    def close(self) -> None:
        """Stop the health checks, waiting out one in flight (at most its timeout), then close the channels: a check
        left running on a closed channel, or past the interpreter's exit, can crash the process in gRPC's teardown
        (seen: a test run's pytest segfaulting after every test passed, a health check logged after the last one)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.health_timeout_s + 1.0)
        for replica in self.replicas:
            replica.client.close()


def plaintext_hint(err) -> str:
    """For an orchestrator's error that names a verifier's failed call: what may mend a plaintext call a verifier
    serving TLS hung up on ('' otherwise). (Not the call's own details: a client reading them would take the hang-up
    for its own.)"""
    details = err.details() if hasattr(err, "details") else ""
    return " (it hung up: if it serves TLS, give this orchestrator --tls-ca)" if hung_up_on_plaintext(details or "") else ""
