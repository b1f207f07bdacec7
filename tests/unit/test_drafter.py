"""The draft's sessions take the orchestrator's rounds in the order they were sent, whichever reaches them first."""

import threading
import time

import pytest

from draft_service.drafter import Drafter, GrowthControl
from draft_service.ngram import NgramProposer
from specsplit.config import DraftConfig
from specsplit.errors import FailedPrecondition
from tiny import wait_for

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]


def run_round(drafter: Drafter, new_token_ids: list[int], committed_length: int) -> list[int]:
    """One DraftTree round as the servicer runs it: every step, the stream ended once the tree is whole."""
    control, tree = GrowthControl(), []
    for step in drafter.grow("s", new_token_ids, committed_length, 4, control):
        tree += step.token_ids
        if step.done:
            control.close()
    return tree


def started() -> Drafter:
    drafter = Drafter(NgramProposer(DraftConfig()))
    drafter.start("s", PROMPT, "")
    return drafter


def test_rounds_that_wait_on_a_running_one_go_in_the_order_sent():
    """Each call has its own handler thread and the session's lock is not first come first served: two rounds waiting
    on a running one may take the session in either order. Whichever goes first, the later one waits for the earlier
    (it failed FAILED_PRECONDITION on the committed length, and the orchestrator went on without its draft)."""
    for _ in range(20):
        drafter = started()
        session = drafter._sessions["s"]
        running = drafter.grow("s", [], len(PROMPT), 4, GrowthControl())
        next(running)  # a round in its forward: it holds the session
        errors = []

        def send(new_token_ids, committed_length):
            try:
                run_round(drafter, new_token_ids, committed_length)
            except Exception as err:  # noqa: BLE001 - the assertion below names it
                errors.append(err)

        later = threading.Thread(target=send, args=([5], len(PROMPT) + 2))
        earlier = threading.Thread(target=send, args=([7], len(PROMPT) + 1))
        later.start()
        assert wait_for(lambda: session.rounds == 2)
        earlier.start()
        assert wait_for(lambda: session.rounds == 3)
        list(running)  # the running round ends; the two waiting ones take the session in either order
        for thread in (later, earlier):
            thread.join(timeout=5)
        assert errors == [] and session.token_ids == [*PROMPT, 7, 5]


def test_a_round_that_does_not_continue_the_session_fails_at_once():
    """With no other round of the session on its way, waiting cannot bring the tokens a round builds on: a round that
    says the session holds more, or fewer, committed tokens than it does fails at once, and the session goes on."""
    drafter = started()
    start = time.perf_counter()
    with pytest.raises(FailedPrecondition, match="committed tokens"):
        run_round(drafter, [7], len(PROMPT) + 2)
    with pytest.raises(FailedPrecondition, match="committed tokens"):
        run_round(drafter, [7], len(PROMPT))
    assert time.perf_counter() - start < 1.0
    run_round(drafter, [7], len(PROMPT) + 1)
    assert drafter._sessions["s"].token_ids == [*PROMPT, 7]


def test_a_given_chain_is_refused_by_a_draft_that_cannot_draft_on_from_one():
    """DraftTree's given_token_ids (a copied span the orchestrator verifies) needs a model draft; the n-gram draft
    refuses it with a clear error instead of ignoring it."""
    from specsplit.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="given chain"):
        list(started().grow("s", [], len(PROMPT), 4, GrowthControl(), given=[5, 6]))
