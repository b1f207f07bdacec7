"""Where a session's KV cache lives, and getting it there: prefill, restore, failover, offload, release.

A cache is rebuilt from the session's committed tokens, either by prefill (one forward over them) or by
importing a copy offloaded to the session store earlier, whichever has been faster here. Every call
to a replica has a deadline; UNAVAILABLE, DEADLINE_EXCEEDED or CANCELLED (its server stopped mid-call)
marks the replica down and the session moves to another one; RESOURCE_EXHAUSTED (a full replica) tries the next one, and is the answer
when every replica is full. NOT_FOUND or FAILED_PRECONDITION from Verify means the replica's cache is gone
or out of step with the store (swept, restarted, or advanced by an orchestrator that then died before
it could commit): the cache is rebuilt from the store's tokens.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import grpc
from opentelemetry import context, trace

from orchestrator.replicas import Replica, ReplicaSet
from specsplit.config import OrchestratorConfig
from specsplit.errors import ResourceExhausted, Unavailable
from specsplit.rpc import RpcError

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

# CANCELLED too: the orchestrator never cancels its own unary calls to a replica, so a cancelled one
# means the replica's server shut down mid-call (grpc's stop() cancels the calls in flight).
DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
OUT_OF_STEP = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


@dataclass
class RestorePlanner:
    """Import an offloaded cache or re-prefill: whichever has cost fewer ms per token so far.

    Only restores of at least ``min_tokens`` count (a short prefill is mostly fixed overhead). An
    untried import is tried once so that it gets measured.
    """

    min_tokens: int = 32
    ema: float = 0.3
    prefill_ms_per_token: float | None = None  # the whole call, as the orchestrator saw it
    import_ms_per_token: float | None = None
    # The verifier's own time for a prefill (arrival to answer, queueing included), per token: when a prefill sent
    # now will be done there, whatever the network (``PrefillInFlight``).
    verifier_prefill_ms_per_token: float | None = None
    counts: dict = field(default_factory=lambda: {"prefill": 0, "import": 0})  # restores done, by kind

    def prefer_import(self) -> bool:
        if self.import_ms_per_token is None or self.prefill_ms_per_token is None:
            return True
        return self.import_ms_per_token <= self.prefill_ms_per_token

    def observe(self, kind: str, num_tokens: int, ms: float, verifier_ms: float = 0.0) -> None:
        """verifier_ms: a prefill's time in the verifier (0: not reported)."""
        self.counts[kind] += 1
        if num_tokens < self.min_tokens:
            return
        self._mix(f"{kind}_ms_per_token", ms / num_tokens)
        if kind == "prefill" and verifier_ms > 0:
            self._mix("verifier_prefill_ms_per_token", verifier_ms / num_tokens)

    def expected_prefill_ms(self, num_tokens: int) -> float | None:
        """The verifier's time for a prefill of ``num_tokens``: 0 for a short one (under ``min_tokens``) until a rate
        is measured, None for a longer one then."""
        rate = self.verifier_prefill_ms_per_token
        if rate is None:
            return 0.0 if num_tokens < self.min_tokens else None
        return rate * num_tokens

    def _mix(self, name: str, new: float) -> None:
        old = getattr(self, name)
        setattr(self, name, new if old is None else (1 - self.ema) * old + self.ema * new)


@dataclass
class PrefillInFlight:
    """A new session's prefill running in its own thread (``KvPlacement.start_prefill``), so that the session's
    first tree can be sent before the prefill's answer is back: timed to reach the verifier as the prefill ends
    there, it is verified one network round trip sooner than after the answer (the verifier runs a session's
    requests in order: a Verify that arrives early waits for the prefill)."""

    future: Future  # resolves when the prefill is done (its exception if it failed)
    send_at: float  # perf_counter time the prefill is expected to be done in the verifier

    def wait_to_send(self) -> None:
        """Until the prefill is expected to be done in the verifier, or its answer is back."""
        wait([self.future], timeout=max(0.0, self.send_at - time.perf_counter()))


class KvPlacement:
    def __init__(self, replicas: ReplicaSet, store, config: OrchestratorConfig):
        self.replicas = replicas
        self.store = store
        self.config = config
        self.planner = RestorePlanner()
        self._releasing: set[threading.Thread] = set()  # Release calls still out (``release(wait=False)``)
        self._lock = threading.Lock()

    # -- getting a cache onto a replica -------------------------------------------------------------
    def restore(self, session, prefer: Replica | None = None, fresh: bool = False) -> None:
        """Build the session's cache on ``prefer`` (if healthy) or the least loaded healthy replica.

        fresh: a new session (its prompt only); a replica that already has its id refuses it.
        """
        tried: set[str] = set()
        while True:
            reserved = not (prefer is not None and prefer.healthy and prefer.address not in tried)
            # Unavailable when every replica was tried; a picked replica counts the session from now on.
            replica = self.replicas.pick(exclude=tried, reserve=True) if reserved else prefer
            tried.add(replica.address)
            session.loading = replica
            try:
                self._load(session, replica, fresh)
            except BaseException as err:
                if reserved:
                    self.replicas.placed(replica, -1)  # not placed there after all
                if not isinstance(err, RpcError):
                    raise
                code = err.code()
                if code in DOWN:
                    self.replicas.mark_down(replica, f"{code.name} during restore")
                    continue
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    if len(tried) < len(self.replicas.replicas):
                        continue  # this replica is full: try another
                    # Every replica is full: say so at once, so the caller can retry later or elsewhere.
                    raise ResourceExhausted(f"the verifier is at capacity: {err.details()}") from None
                raise
            replica.healthy = True
            self._place(session, replica, reserved)
            return

    def _load(self, session, replica: Replica, fresh: bool) -> None:
        state, tokens = session.state, session.token_ids
        session.used.add(replica.address)  # (a load that times out may still have made a copy there)
        if not fresh:  # a stale copy (an earlier owner's, or a timed-out call's) would refuse the load
            self._release_on(replica, session.id)
        with tracer.start_as_current_span("specsplit.orchestrator.restore") as span:
            span.set_attribute("specsplit.replica", replica.address)
            span.set_attribute("specsplit.committed_length", len(tokens))
            start = time.perf_counter()
            offloaded = state.kv_length == len(tokens) and self.planner.prefer_import()
            kv = self.store.get_kv(session.id) if offloaded else None
            if kv is not None and kv[0] == len(tokens):
                replica.client.import_session(session.id, tokens, kv[1], timeout=self.config.prefill_timeout_s,
                                              sampling=session.sampling, return_features=session.wants_features,
                                              medusa=session.medusa)
                session.proposal = None  # an import runs no forward: no features, no Medusa tree this time
                kind = "import"
            else:
                reply = replica.client.prefill_reply(session.id, tokens, timeout=self.config.prefill_timeout_s,
                                                     sampling=session.sampling, return_features=session.wants_features,
                                                     medusa=session.medusa)
                session.absorb(reply)
                kind = "prefill"
            ms = (time.perf_counter() - start) * 1e3
            span.set_attribute("specsplit.restore", kind)
        # (the verifier's copied prompt tokens cost next to nothing: the rates are per computed token)
        computed = len(tokens) - (reply.copied_tokens if kind == "prefill" else 0)
        self.planner.observe(kind, computed, ms, reply.prefill_ms if kind == "prefill" else 0.0)
        log.info("session %s: %s of %d tokens on %s took %.1f ms", session.id, kind, len(tokens), replica.address, ms)

    def _place(self, session, replica: Replica, reserved: bool = False) -> None:
        """reserved: ``pick`` already counted the session on ``replica``."""
        if session.replica is not None:
            self.replicas.placed(session.replica, -1)
        if not reserved:
            self.replicas.placed(replica, +1)
        session.replica = replica
        session.used.add(replica.address)
        session.state.verifier = replica.address
        session.state.verifier_length = len(session.token_ids)

    def attach(self, session) -> None:
        """A resumed session: trust the replica the store names (Verify will say if it is out of step)."""
        replica = self.replicas.by_address(session.state.verifier)
        if replica is not None and replica.healthy and session.state.verifier_length == len(session.token_ids):
            self._place(session, replica)
        else:
            self.restore(session)

    def prefill(self, session) -> None:
        """A new session's cache: its prompt prefilled on the least loaded healthy replica."""
        with tracer.start_as_current_span("specsplit.orchestrator.prefill"):
            self.restore(session, fresh=True)

    def start_prefill(self, session) -> PrefillInFlight | None:
        """``prefill`` in a thread of its own; None (nothing started) for a prompt whose prefill time
        cannot be told yet (``RestorePlanner.expected_prefill_ms``): the first tree's send time comes from it."""
        expected_ms = self.planner.expected_prefill_ms(len(session.token_ids))
        if expected_ms is None:
            return None
        inflight = PrefillInFlight(Future(), time.perf_counter() + expected_ms / 1e3)

        def run():
            try:
                self.prefill(session)
                inflight.future.set_result(None)
            except BaseException as err:  # noqa: BLE001 - the session's own thread raises it
                inflight.future.set_exception(err)

        traced_thread(run, f"specsplit-prefill-{session.id}")
        return inflight

    def send_early(self, session, tree, max_commit: int, decode_steps: int = 0):
        """Send a new session's first Verify to the replica its prefill went to while that prefill is still running
        (``PrefillInFlight``) -> (replica, reply), or None when it could not be (the caller waits for the prefill,
        then verifies as usual: a replica that was not there or failed is then handled by ``verify``)."""
        replica = session.loading
        if replica is None:
            return None
        try:
            reply = replica.client.verify_reply(session.id, tree, len(session.token_ids), max_commit,
                                                timeout=self.config.prefill_timeout_s + self.config.verify_timeout_s,
                                                decode_steps=decode_steps)
        except RpcError as err:
            log.info("session %s: early first Verify on %s failed (%s); verifying after the prefill",
                     session.id, replica.address, err.code())
            return None
        return replica, reply

    def verified(self, session, replica: Replica, reply) -> None:
        """Book a Verify the replica answered."""
        replica.healthy = True  # it answered: back in rotation before the next health check
        session.state.verifier_length = len(session.token_ids) + len(reply.verdict.committed_token_ids)
        session.absorb(reply)

    # -- a verification round, moving the session when its replica fails ---------------------------------
    def verify(self, session, tree, max_commit: int, decode_steps: int = 0):
        last = None
        for _ in range(2 * len(self.replicas.replicas) + 2):
            replica = session.replica
            if replica is None:
                self.restore(session)
                replica = session.replica
            try:
                reply = replica.client.verify_reply(session.id, tree, len(session.token_ids), max_commit,
                                                    timeout=self.config.verify_timeout_s, decode_steps=decode_steps)
                self.verified(session, replica, reply)
                return reply
            except RpcError as err:
                code, last = err.code(), err
                span = trace.get_current_span()
                if code in DOWN:
                    self.replicas.mark_down(replica, f"{code.name} during Verify")
                    span.add_event("specsplit.failover", {"specsplit.replica": replica.address,
                                                               "rpc.grpc.status_code": code.value[0]})
                    self.forget(session)  # (no longer counted on the replica that failed)
                    self.restore(session)
                elif code in OUT_OF_STEP:
                    span.add_event("specsplit.rebuild", {"specsplit.replica": replica.address,
                                                               "rpc.grpc.status_code": code.value[0]})
                    self.restore(session, prefer=replica)
                else:
                    raise
        raise Unavailable(f"session {session.id!r}: no verifier replica could verify it "
                          f"(last: {last.code().name if last else '?'})")

    # -- offload and release --------------------------------------------------------------------------
    def offload(self, session) -> bool:
        """Copy an idle session's cache into the store and free it on the replica; False if not worth it."""
        tokens = session.token_ids
        replica = session.replica
        if not self.config.offload_idle or replica is None or len(tokens) < self.config.offload_min_tokens:
            return False
        try:
            blob = replica.client.export_session(session.id, len(tokens), timeout=self.config.prefill_timeout_s,
                                                 dtype=self.config.offload_dtype)
            self.store.put_kv(session.id, len(tokens), blob)
        except Exception as err:  # noqa: BLE001 - offload is an optimisation; the cache stays where it is
            log.warning("offload of session %s failed: %s", session.id, err)
            return False
        session.state.kv_length = len(tokens)
        self.release(session)
        return True

    def release(self, session, wait: bool = True, keep: str = "") -> None:
        """Free the session's cache on every replica that may hold one (but ``keep``, an address). wait=False: the
        Release calls go out on a thread of their own (in the caller's trace), so a finished generation's stream ends
        without waiting a round trip to the verifier for them (``releasing`` counts them until they are answered)."""
        replicas = [r for r in map(self.replicas.by_address, sorted(session.used - {keep})) if r is not None]
        if session.replica is not None:
            self.replicas.placed(session.replica, -1)
        session.used.clear()
        session.replica = None
        session.state.verifier, session.state.verifier_length = "", 0
        if wait:
            for replica in replicas:
                self._release_on(replica, session.id)
            return

        def run():
            try:
                for replica in replicas:
                    self._release_on(replica, session.id)
            finally:
                with self._lock:
                    self._releasing.discard(threading.current_thread())

        thread = traced_thread(run, f"specsplit-release-{session.id}", start=False)
        with self._lock:  # counted before it runs (a quick one must not be discarded before it is added)
            self._releasing.add(thread)
        thread.start()

    def releasing(self) -> int:
        """Release calls ``release(wait=False)`` sent that are not answered yet."""
        with self._lock:
            return len(self._releasing)

    def close(self, timeout_s: float = 5.0) -> None:
        """Wait (up to ``timeout_s`` in all) for the Release calls still out, before the replicas' channels close."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._releasing)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def forget(self, session) -> None:
        """The session leaves this orchestrator; its cache (if any) stays where it is."""
        if session.replica is not None:
            self.replicas.placed(session.replica, -1)
        session.replica = None

    def release_at(self, address: str, session_id: str) -> None:
        replica = self.replicas.by_address(address)
        if replica is not None:
            self._release_on(replica, session_id)

    def _release_on(self, replica: Replica, session_id: str) -> None:
        # Sent to a replica marked down too: "down" may only mean that one call (of any session) missed its deadline
        # there, and the replica, alive, still holds this cache (a dead one fails the call at once or at its deadline).
        try:
            replica.client.release(session_id, timeout=self.config.draft_timeout_s)
        except RpcError as err:  # (a replica marked down failing it is expected: its going was logged already)
            log.log(logging.WARNING if replica.healthy else logging.DEBUG, "release of %s on %s failed: %s", session_id,
                    replica.address, err.code())


def traced_thread(target, name: str, start: bool = True) -> threading.Thread:
    """A daemon thread that runs ``target`` in the caller's trace context (the generate span: the spans it makes stay
    in the generation's trace)."""
    parent = context.get_current()

    def run():
        token = context.attach(parent)
        try:
            target()
        finally:
            context.detach(token)

    thread = threading.Thread(target=run, name=name, daemon=True)
    if start:
        thread.start()
    return thread
