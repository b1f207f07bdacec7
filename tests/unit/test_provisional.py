"""Keep/drop of provisional tokens (the rule the draft and the orchestrator share)."""

from specsplit.provisional import reconcile_provisional


def test_kept_when_committed_runs_along_the_path():
    # best branch [5, 6, 7], provisional [8, 9]; all accepted, bonus 8 = the first provisional token
    assert reconcile_provisional([5, 6, 7, 8], [5, 6, 7, 8, 9]) == [9]


def test_dropped_when_an_error_was_found():
    assert reconcile_provisional([5, 6, 4], [5, 6, 7, 8, 9]) == []  # recovered token differs
    assert reconcile_provisional([5, 6, 7, 3], [5, 6, 7, 8, 9]) == []  # bonus differs from provisional


def test_nothing_left_to_keep():
    assert reconcile_provisional([5, 6, 7], [5, 6, 7]) == []
    assert reconcile_provisional([5, 6, 7, 8], [5, 6]) == []
    assert reconcile_provisional([], [5, 6]) == []
    assert reconcile_provisional([5], []) == []
