"""Keep/drop of provisional tokens (the rule the draft and the orchestrator share)."""

from specsplit.provisional import follows, reconcile_provisional


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


def test_follows_also_when_nothing_is_left_past_the_committed_tokens():
    # the draft's one provisional token was the bonus token: it followed the path, though nothing is kept
    assert follows([5, 6, 7, 8], [5, 6, 7, 8]) and reconcile_provisional([5, 6, 7, 8], [5, 6, 7, 8]) == []
    assert follows([5, 6, 7, 8], [5, 6, 7, 8, 9])
    assert not follows([5, 6, 7, 3], [5, 6, 7, 8, 9])  # bonus differs from the provisional token
    assert not follows([5, 6, 7, 8], [5, 6, 7])  # the path ended before the bonus token (no provisional drafting)
    assert not follows([], [5, 6])
