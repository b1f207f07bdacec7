"""Merging two drafters' trees (n-gram lookup + a model) under one node budget."""

from specsplit.tree import SparseDist, TokenTree, union_trees


def test_greedy_union_shares_equal_nodes():
    ngram = TokenTree.chain([5, 6, 7])
    model = TokenTree((5, 9, 6, 8), (-1, -1, 0, 1))  # 5 -> 6 is already there; 9 -> 8 is new
    tree = union_trees(ngram, model, max_nodes=10)
    assert tree.token_ids == (5, 6, 7, 9, 8)
    assert tree.parents == (-1, 0, 1, -1, 3)


def test_union_respects_the_budget_and_drops_orphans():
    ngram = TokenTree.chain([1, 2])
    model = TokenTree((3, 4, 5), (-1, 0, 1))
    tree = union_trees(ngram, model, max_nodes=3)
    assert tree.token_ids == (1, 2, 3) and tree.parents == (-1, 0, -1)  # 4 does not fit, so 5 has no parent


def test_sampled_union_never_merges_by_value():
    q = SparseDist((5, 6), (0.5, 0.5))
    model = TokenTree((5, 6), (-1, -1), (0.5, 0.5), (q, q))  # i.i.d. draws: kept by position, not value
    tree = union_trees(TokenTree.chain([5]), model, max_nodes=8, merge=False)
    assert tree.token_ids == (5, 5, 6) and tree.parents == (-1, -1, -1)
    assert tree.node_q == (None, q, q)  # the n-gram node stays one-hot


def test_empty_lookup_leaves_the_model_tree():
    model = TokenTree((3, 4), (-1, 0), (0.9, 0.8))
    assert union_trees(TokenTree.empty(), model, 8) == model
