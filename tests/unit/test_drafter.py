"""The draft's sessions take the orchestrator's rounds in the order they were sent, whichever arrives first."""

import threading

import pytest

from draft_service import drafter as drafter_module
from draft_service.drafter import Drafter, GrowthControl
from draft_service.ngram import NgramProposer
from specsplit.config import DraftConfig
from specsplit.errors import FailedPrecondition

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]


def run_round(drafter: Drafter, new_token_ids: list[int], committed_length: int) -> list[int]:
    """One DraftTree round as the servicer runs it: every step, verified once the tree is whole."""
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


def test_a_round_that_overtakes_the_one_sent_before_it_waits_for_it():
    """Each call has its own handler thread and the session's lock is not first come first served: the next round
    can reach the session before the round the orchestrator sent first. It waits for it instead of failing (it did:
    FAILED_PRECONDITION on the committed length, and the orchestrator decoded 32 rounds without its draft)."""
    drafter = started()
    results, errors = [], []

    def second():
        try:
            results.append(run_round(drafter, [5], len(PROMPT) + 2))
        except Exception as err:  # noqa: BLE001 - the assertion below names it
            errors.append(err)

    late = threading.Thread(target=second)
    late.start()
    late.join(timeout=0.3)
    assert late.is_alive() and not errors  # waiting for its turn
    run_round(drafter, [7], len(PROMPT) + 1)
    late.join(timeout=5)
    assert not late.is_alive() and errors == []
    assert drafter._sessions["s"].token_ids == [*PROMPT, 7, 5]
    assert results and results[0]  # the lookup drafts after ...7 5: the cycle goes on


def test_a_round_that_does_not_continue_the_session_still_fails(monkeypatch):
    """A round built on more tokens than the session will ever have waits its turn out, then fails as before; one
    built on fewer fails at once."""
    monkeypatch.setattr(drafter_module, "TURN_WAIT_S", 0.2)
    drafter = started()
    with pytest.raises(FailedPrecondition, match="committed tokens"):
        run_round(drafter, [7], len(PROMPT) + 2)
    with pytest.raises(FailedPrecondition, match="committed tokens"):
        run_round(drafter, [7], len(PROMPT))
    run_round(drafter, [7], len(PROMPT) + 1)
    assert drafter._sessions["s"].token_ids == [*PROMPT, 7]
