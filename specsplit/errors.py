"""Domain errors. Each carries the gRPC status it maps to; the mapping happens in one
place (``specsplit.serving.grpc_errors``), so core code never imports grpc."""

from __future__ import annotations


class SpecSplitError(Exception):
    code_name = "INTERNAL"


class InvalidArgument(SpecSplitError):
    code_name = "INVALID_ARGUMENT"


class NotFound(SpecSplitError):
    code_name = "NOT_FOUND"


class FailedPrecondition(SpecSplitError):
    code_name = "FAILED_PRECONDITION"


class ResourceExhausted(SpecSplitError):
    code_name = "RESOURCE_EXHAUSTED"


class Unavailable(SpecSplitError):
    code_name = "UNAVAILABLE"


class DataLoss(SpecSplitError):
    code_name = "DATA_LOSS"


class StaleRound(FailedPrecondition):
    """A session-store write lost a compare-and-set on the session's round: someone wrote newer state.

    The writer must reload the session and retry from that fresh state (or give the session up)."""

    def __init__(self, session_id: str, expected_round: int, stored_round: int):
        self.session_id, self.expected_round, self.stored_round = session_id, expected_round, stored_round
        super().__init__(f"session {session_id!r} is at round {stored_round}, this write expected round "
                         f"{expected_round}: another writer committed first (a stale orchestrator or a retried "
                         "request); reload the session and retry from its current state")


# Trailing metadata of a failed Generate that started no session (an orchestrator that reached no verifier, a prompt
# whose prefill failed): nothing is stored under its id, so the client starts it again rather than resuming it, and
# sends no Cancel when it gives up (one for an id no session has makes a start with that id within a minute begin
# cancelled). ``grpc_errors`` sends it for an error ``made_no_session`` marked.
NO_SESSION_KEY = "specsplit-no-session"


def made_no_session(err: BaseException) -> BaseException:
    """Mark ``err`` as the error of a start that left no session behind; returns it."""
    try:
        err.specsplit_no_session = True
    except AttributeError:  # (an exception type with __slots__: left unmarked, so the client resumes and cancels)
        pass
    return err
