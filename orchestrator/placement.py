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
import time
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

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
    prefill_ms_per_token: float | None = None
    import_ms_per_token: float | None = None
    counts: dict = field(default_factory=lambda: {"prefill": 0, "import": 0})  # restores done, by kind

    def prefer_import(self) -> bool:
        if self.import_ms_per_token is None or self.prefill_ms_per_token is None:
            return True
        return self.import_ms_per_token <= self.prefill_ms_per_token

    def observe(self, kind: str, num_tokens: int, ms: float) -> None:
        self.counts[kind] += 1
        if num_tokens < self.min_tokens:
            return
        name = f"{kind}_ms_per_token"
        old, new = getattr(self, name), ms / num_tokens
        setattr(self, name, new if old is None else (1 - self.ema) * old + self.ema * new)


class KvPlacement:
    def __init__(self, replicas: ReplicaSet, store, config: OrchestratorConfig):
        self.replicas = replicas
        self.store = store
        self.config = config
        self.planner = RestorePlanner()

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
        if not fresh:
            self._release_on(replica, session.id)  # a stale copy (an earlier owner's) would refuse the load
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
        self.planner.observe(kind, len(tokens), ms)
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
                replica.healthy = True  # it answered: back in rotation before the next health check
                session.state.verifier_length = len(session.token_ids) + len(reply.verdict.committed_token_ids)
                session.absorb(reply)
                return reply
            except RpcError as err:
                code, last = err.code(), err
                span = trace.get_current_span()
                if code in DOWN:
                    self.replicas.mark_down(replica, f"{code.name} during Verify")
                    span.add_event("specsplit.failover", {"specsplit.replica": replica.address, "grpc.status": code.name})
                    session.replica = None
                    self.restore(session)
                elif code in OUT_OF_STEP:
                    span.add_event("specsplit.rebuild", {"specsplit.replica": replica.address, "grpc.status": code.name})
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

    def release(self, session) -> None:
        """Free the session's cache on every replica that may hold one."""
        for address in sorted(session.used):
            replica = self.replicas.by_address(address)
            if replica is not None:
                self._release_on(replica, session.id)
        if session.replica is not None:
            self.replicas.placed(session.replica, -1)
        session.used.clear()
        session.replica = None
        session.state.verifier, session.state.verifier_length = "", 0

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
        if not replica.healthy:
            return  # a dead replica's caches died with it; a revived one sweeps idle sessions itself
        try:
            replica.client.release(session_id, timeout=self.config.draft_timeout_s)
        except RpcError as err:
            log.warning("release of %s on %s failed: %s", session_id, replica.address, err.code())
