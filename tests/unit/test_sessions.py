"""The verifier's session table: admission with the session's lock held, a lookup that waits for an admission."""

import threading

import pytest

from specsplit.errors import FailedPrecondition, NotFound, ResourceExhausted
from specsplit.sampling import SamplingParams
from verifier_service.sessions import SessionTable


def test_a_lookup_may_wait_for_a_session_admitted_meanwhile_and_finds_it_locked():
    table = SessionTable(max_sessions=4, max_queued_prefill_tokens=100)
    timer = threading.Timer(0.05, lambda: table.admit("s", [1, 2, 3], SamplingParams(), 2))
    timer.start()
    with pytest.raises(NotFound):
        table.get("s")  # not admitted yet, and no wait
    session = table.get("s", wait_s=5.0)
    assert session.lock.locked()  # held for the admitting Prefill until the cache is built
    with pytest.raises(NotFound, match="never prefilled here"):
        table.get("other", wait_s=0.01)
    released = []
    assert table.release("s", released.append) and released == [session] and session.released
    assert not table.release("s", released.append) and len(table) == 0


def test_admission_refuses_a_taken_id_a_full_table_and_too_many_queued_prompt_tokens():
    table = SessionTable(max_sessions=2, max_queued_prefill_tokens=10)
    table.admit("a", [1] * 9, SamplingParams(), 8)
    with pytest.raises(FailedPrecondition, match="already exists"):
        table.admit("a", [1], SamplingParams(), 0)
    with pytest.raises(ResourceExhausted, match="prompt tokens waiting"):
        table.admit("b", [1] * 5, SamplingParams(), 4)  # 8 queued + 4 > 10
    table.cached(8)  # a's prompt is cached now
    table.admit("b", [1] * 5, SamplingParams(), 4)
    with pytest.raises(ResourceExhausted, match="max_sessions=2"):
        table.admit("c", [1], SamplingParams(), 0)


def test_a_release_for_a_given_session_leaves_a_newer_one_that_took_its_id():
    """A failed Prefill cleans up its own session only: meanwhile a Release and a resumed session's Prefill may
    have given the id to another."""
    table = SessionTable(max_sessions=4, max_queued_prefill_tokens=100)
    old = table.admit("s", [1, 2, 3], SamplingParams(), 2)
    released = []
    assert table.release("s", released.append)  # the orchestrator's Release before it prefills again
    new = table.admit("s", [1, 2, 3, 4], SamplingParams(), 3)
    assert not table.release("s", released.append, expected=old)  # the old Prefill's failure
    assert table.get("s") is new and not new.released and released == [old]
    assert table.release("s", released.append, expected=new) and released == [old, new]
