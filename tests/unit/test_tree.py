import pytest
import torch

from specsplit.errors import InvalidArgument, ResourceExhausted
from specsplit.tree import (SparseDist, TokenTree, branch_below, build_buffers, full_attention_mask, tree_attn_mask,
                            until_stop)


def test_hand_drawn_tree_mask_and_positions():
    #   root ─ a(0) ─ c(2) ─ d(3)
    #        └ b(1) ─ e(4)
    tree = TokenTree((10, 11, 12, 13, 14), (-1, -1, 0, 2, 1))
    buffers = build_buffers(tree, root_token=9, prefix_len=7)
    assert buffers.input_ids.tolist() == [[9, 10, 11, 12, 13, 14]]
    assert buffers.position_ids.tolist() == [[7, 8, 8, 9, 10, 9]]
    expected = torch.tensor([
        # r  a  b  c  d  e
        [1, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0],  # a
        [1, 0, 1, 0, 0, 0],  # b
        [1, 1, 0, 1, 0, 0],  # c
        [1, 1, 0, 1, 1, 0],  # d
        [1, 0, 1, 0, 0, 1],  # e
    ], dtype=torch.bool)
    assert torch.equal(buffers.tree_attn_mask, expected)


def test_chain_mask_is_causal():
    tree = TokenTree.chain([5, 6, 7])
    assert tree.parents == (-1, 0, 1)
    assert torch.equal(tree_attn_mask(tree), torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert tree.is_chain() and tree.depth == 3


def test_full_mask_sees_prefix_and_blocks_siblings():
    tree = TokenTree((1, 2), (-1, -1))
    mask = full_attention_mask(tree_attn_mask(tree), prefix_len=3, dtype=torch.float32)
    assert mask.shape == (1, 1, 3, 6)
    allowed = mask[0, 0] == 0
    assert allowed[:, :3].all()  # everyone sees the cached prefix
    assert allowed[2].tolist() == [True, True, True, True, False, True]  # node 1 does not see node 0


def test_from_paths_shares_prefixes():
    tree = TokenTree.from_paths([[1, 2, 3], [1, 2, 4], [5]])
    assert tree.token_ids == (1, 2, 3, 4, 5)
    assert tree.parents == (-1, 0, 1, 1, -1)
    assert tree.path_to(3) == [0, 1, 3]
    assert tree.depths == (1, 2, 3, 3, 1)


def test_empty_tree():
    tree = TokenTree.empty()
    assert len(tree) == 0 and tree.depth == 0 and tree.is_chain()
    assert build_buffers(tree, 4, 2).input_ids.tolist() == [[4]]


@pytest.mark.parametrize("tree, message", [
    (TokenTree((1, 2), (-1, 1)), "parent index must be -1"),
    (TokenTree((1, 2), (-1, 5)), "parent index must be -1"),
    (TokenTree((1, 2), (-1, -2)), "parent index must be -1"),
    (TokenTree((1, 999), (-1, 0)), "outside the vocabulary"),
    (TokenTree((1, -1), (-1, 0)), "outside the vocabulary"),
    (TokenTree((1, 2), (-1,)), "same length"),
    (TokenTree((1, 2), (-1, 0), (0.5,)), "same length"),
    (TokenTree((1,), (-1,), (1.5,)), r"outside \[0, 1\]"),
])
def test_malformed_trees_are_invalid_argument(tree, message):
    with pytest.raises(InvalidArgument, match=message):
        tree.validate(vocab_size=100, max_nodes=8)


def test_too_many_nodes_is_resource_exhausted():
    with pytest.raises(ResourceExhausted, match="at most 4"):
        TokenTree.chain(list(range(5))).validate(vocab_size=100, max_nodes=4)


def test_branch_below_is_the_deepest_branch_through_a_node():
    #        root
    #       /    \
    #      0      1
    #     / \      \
    #    2   3      4
    #        |
    #        5
    parents = [-1, -1, 0, 0, 1, 3]
    assert branch_below(parents, 0) == [0, 3, 5]  # the deeper of node 0's two branches
    assert branch_below(parents, 1) == [1, 4]
    assert branch_below(parents, 2) == [0, 2]  # a leaf: its own path
    tree = TokenTree((5, 6, 7, 8, 9, 10), tuple(parents))
    assert tree.branch_below(0) == [0, 3, 5]


def test_ended_at_drops_what_follows_a_stop_token():
    #      0:a  1:EOS  2:b
    #      |     |      |
    #      3:c  4:d    5:EOS -- 6:e
    tree = TokenTree((10, 2, 11, 12, 13, 2, 14), (-1, -1, -1, 0, 1, 2, 5), (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3))
    ended = tree.ended_at({2})
    assert ended.token_ids == (10, 2, 11, 12, 2) and ended.parents == (-1, -1, -1, 0, 2)
    assert ended.draft_probs == (0.9, 0.8, 0.7, 0.6, 0.4)
    assert tree.ended_at({99}) is tree and tree.ended_at(()) is tree
    sampled = TokenTree((10, 2, 11), (-1, -1, 1), (0.5, 0.5, 0.5), (None, SparseDist((2,), (1.0,)), None))
    assert sampled.ended_at({2}).node_q == (None, SparseDist((2,), (1.0,)))


def test_until_stop_keeps_the_stop_token():
    assert until_stop([5, 6, 2, 7, 2], {2}) == [5, 6, 2]
    assert until_stop([5, 6], {2}) == [5, 6] and until_stop([], {2}) == []
