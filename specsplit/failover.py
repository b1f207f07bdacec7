"""What a generation given several orchestrators does after each chunk and each failure: which failures move it to
another orchestrator, where its next call goes and what it asks for (a start, or a resume after the tokens received).
Pure decisions, no I/O: ``specsplit.client``'s sync and async streams make the calls and wait the pauses."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from specsplit.errors import NO_SESSION_KEY
from specsplit.stream import Chunk
from specsplit.v1 import orchestrator_pb2


@dataclass(frozen=True)
class Reconnect:
    """Why a resumable generation reconnects, and where to: given to ``Client(on_reconnect=...)``."""
    failed: str  # the orchestrator whose call failed (host:port)
    code: grpc.StatusCode
    details: str
    next: str  # the orchestrator tried next
    seconds_left: float  # until the generation gives up (``reconnect_s`` after the first failure without progress)
    attempt: int  # 1 for the first reconnect since the stream last made progress



# A stream that broke with one of these may continue on another orchestrator: the server is gone
# (UNAVAILABLE), or its connection broke mid-stream (UNKNOWN/INTERNAL: RST_STREAM, socket closed).
RESUMABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


def never_reached(err: grpc.RpcError) -> bool:
    """The call failed before reaching any server: refused, or a name that does not resolve."""
    details = err.details() or ""
    return err.code() == grpc.StatusCode.UNAVAILABLE and any(what in details for what in (
        "Connection refused", "DNS resolution failed", "errors resolving", "failed to connect to all"))


def told_no_session(err: grpc.RpcError) -> bool:
    """The orchestrator says this failed call left no session under its id (``specsplit.errors.NO_SESSION_KEY``)."""
    trailing = err.trailing_metadata() if callable(getattr(err, "trailing_metadata", None)) else None
    return any(key == NO_SESSION_KEY for key, _ in (trailing or ()))


def start_moves(err: grpc.RpcError, session_id: str) -> bool:
    """Whether a plain (not resumable) generation whose call failed before any chunk came back may start on another
    orchestrator: one that was never reached or was full took nothing; one broken after it was reached may have made
    the session, so a caller-chosen ``session_id`` would then be refused elsewhere as taken (the first error is the
    truer one)."""
    code = err.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED or never_reached(err) or told_no_session(err):
        return True
    return code in RESUMABLE_CODES and not session_id


# Statuses of a call refused before it made (or touched) a session.
REFUSED_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED,
                 grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED)


def refused_start(err: grpc.RpcError, resuming: bool) -> bool:
    """The call made no session: it was refused, never reached a server, or (a start, not a resume) was refused
    because its ``session_id`` is already another session's (FAILED_PRECONDITION)."""
    code = err.code()
    return (code in REFUSED_CODES or never_reached(err)
            or (code == grpc.StatusCode.FAILED_PRECONDITION and not resuming))


class Failover:
    """Where a generation's next call goes and what it asks for, after each chunk and each failure: the decisions a
    resumable stream (and a plain one given several addresses) makes, shared by ``Client`` and ``AsyncClient``. No I/O:
    the caller makes the calls and waits the pauses.

    resumable=False: a plain generation given several addresses: it moves to the next address only while nothing has
    come back (``start_moves``: an address down or full, or a call broken before the first chunk), once per address,
    and then fails at once; a failure after its first chunk is raised."""

    def __init__(self, request, addresses: Sequence[str], reconnect_s: float,
                 on_reconnect: Callable[[Reconnect], None] | None, resumable: bool):
        self.first = request  # the generation's own request
        self.request = request  # the next call's: the start, or a resume after the tokens received
        self.addresses = addresses
        self.reconnect_s = reconnect_s
        self.on_reconnect = on_reconnect
        self.resumable = resumable
        self.index = 0  # the orchestrator the next call goes to
        self.received = 0  # tokens passed on
        self.started = False  # the header (prompt tokens) was passed on
        self.heard = False  # any chunk came back
        self.give_up_at: float | None = None
        self.delay, self.attempt = 0.05, 0  # since the last progress
        self.reconnects = 0
        # An orchestrator may hold the session: a chunk came back, or a call failed in a way that does not prove it
        # was refused. A generation that fails otherwise sends no Cancel: one for an id no session has makes a start
        # with that id within a minute begin cancelled, and one for an id another generation holds ends that one.
        self.maybe_made = False

    def take(self, chunk: Chunk) -> bool:
        """A chunk came back: whether to pass it on (a resumed call repeats the header the caller has)."""
        self.heard = self.maybe_made = True
        self.give_up_at, self.delay, self.attempt = None, 0.05, 0  # progress: a later failure gets a fresh window
        if chunk.prompt_token_ids is not None and not chunk.token_ids and not chunk.finish_reason:
            if self.started:
                return False
            self.started = True
        self.received += len(chunk.token_ids)
        return True

    def after(self, err: grpc.RpcError) -> float:
        """A call failed: raise ``err`` if nothing mends it; else point the next call at its address and request, tell
        ``on_reconnect``, and return the pause (s) before that call."""
        code = err.code()
        resuming = self.request is not self.first
        # (A start the orchestrator says it left no session for made none, whatever came back before its error.)
        none_made = not resuming and told_no_session(err)
        self.maybe_made = not none_made and (self.maybe_made or not refused_start(err, resuming))
        never_stored = code == grpc.StatusCode.NOT_FOUND and not self.started and resuming
        # A resume that lost the race to claim the session (its old orchestrator still committed a round, or another
        # resume claimed it first) is told to resume again from the session's current state.
        raced = code == grpc.StatusCode.FAILED_PRECONDITION and resuming
        # A start refused for want of room goes to the next address (the others may have it).
        full = code == grpc.StatusCode.RESOURCE_EXHAUSTED and not self.started and not resuming
        if code not in RESUMABLE_CODES and not never_stored and not raced and not full:
            raise err
        # A start that no orchestrator took (full, or never reached) is the same start at the next address.
        refused = full or (not self.started and not resuming and never_reached(err))
        if not self.resumable:  # a plain generation: the same start elsewhere while none of it came back
            refused = not self.heard and start_moves(err, self.first.session_id)
            if not refused:
                raise err
        if refused and self.attempt + 1 >= len(self.addresses):
            raise err  # every address refused the start (none answers: a wrong address, a service that is down)
        now = time.monotonic()
        self.give_up_at = self.give_up_at or now + self.reconnect_s
        if now > self.give_up_at and self.resumable:  # (a plain one tries each address once, however long)
            raise err
        failed, self.attempt = self.index, self.attempt + 1
        if not never_stored and not raced:  # (that orchestrator answered: the same one starts it again)
            self.index = (self.index + 1) % len(self.addresses)
        if self.on_reconnect is not None:
            self.on_reconnect(Reconnect(self.addresses[failed], code, err.details() or "", self.addresses[self.index],
                                        self.give_up_at - now, self.attempt))
        pause, self.delay = self.delay, min(2 * self.delay, 1.0)
        self.reconnects += 1
        # Resume where we are; a session no orchestrator ever stored (or kept) is started again, same id.
        self.request = self.first if never_stored or refused or none_made else orchestrator_pb2.GenerateRequest(
            resume_session_id=self.first.session_id, resume_from_token=self.received)
        return pause
