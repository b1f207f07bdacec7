from specsplit.accept import accept_greedy
from specsplit.tree import TokenTree


def test_perfect_match_gives_bonus():
    tree = TokenTree.chain([5, 6, 7])
    verdict = accept_greedy(tree, [5, 6, 7, 8])
    assert verdict.accepted_token_ids == (5, 6, 7)
    assert verdict.next_token_id == 8  # bonus
    assert verdict.committed_token_ids == (5, 6, 7, 8)
    assert verdict.rows_to_keep == (0, 1, 2, 3)


def test_early_mismatch_gives_recovered_token():
    verdict = accept_greedy(TokenTree.chain([5, 6, 7]), [5, 9, 7, 8])
    assert verdict.accepted_token_ids == (5,)
    assert verdict.next_token_id == 9  # recovered


def test_first_token_wrong_commits_one_target_token():
    verdict = accept_greedy(TokenTree.chain([5, 6]), [4, 6, 7])
    assert verdict.accepted_nodes == () and verdict.committed_token_ids == (4,)


def test_empty_sequence_is_plain_decoding():
    verdict = accept_greedy(TokenTree.empty(), [3])
    assert verdict.committed_token_ids == (3,) and verdict.rows_to_keep == (0,)


def test_tree_follows_the_matching_branch():
    #   root ─ a=5 ─ c=7
    #        └ b=6 ─ d=8 ─ e=9
    tree = TokenTree((5, 6, 7, 8, 9), (-1, -1, 0, 1, 3))
    # target after root: 6 (b), after b: 8 (d), after d: 9 (e), after e: 1 (bonus)
    argmax = [6, 0, 8, 0, 9, 1]  # rows: root, a, b, c, d, e
    verdict = accept_greedy(tree, argmax)
    assert verdict.accepted_nodes == (1, 3, 4)
    assert verdict.accepted_token_ids == (6, 8, 9)
    assert verdict.next_token_id == 1
    assert verdict.rows_to_keep == (0, 2, 4, 5)


def test_max_commit_caps_the_round():
    verdict = accept_greedy(TokenTree.chain([5, 6, 7]), [5, 6, 7, 8], max_commit=2)
    assert verdict.committed_token_ids == (5, 6)
    verdict = accept_greedy(TokenTree.chain([5, 6, 7]), [5, 6, 7, 8], max_commit=1)
    assert verdict.committed_token_ids == (5,) and verdict.accepted_nodes == ()
