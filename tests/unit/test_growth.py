"""Width-adaptive tree growth: budget, depth where confident, branching threshold, one expand per step."""

from specsplit.growth import GrowingTree, GrowthPolicy, best_leaf, grow_tree


def chain_expand(probs_by_branch):
    """Root children: one per branch (token = branch id, prob given); then each branch repeats its own prob."""
    def expand(frontier, tree):
        out = []
        for node in frontier:
            if node < 0:
                out.append(sorted(((b, p) for b, p in probs_by_branch.items()), key=lambda c: -c[1]))
            else:
                branch = tree.token_ids[tree.path_to(node)[0]]
                out.append([(branch, probs_by_branch[branch]), (99, 0.01)])
        return out
    return expand


def run(expand, max_nodes, policy=None):
    tree = GrowingTree()
    calls = []

    def counted(frontier):
        calls.append(list(frontier))
        return expand(frontier, tree)

    steps = list(grow_tree(counted, max_nodes, policy, tree=tree))
    return tree, steps, calls


def depth_of(tree, node):
    return len(tree.path_to(node))


def test_budget_respected():
    for budget in (1, 2, 5, 17, 40):
        tree, steps, _ = run(chain_expand({1: 0.95, 2: 0.5, 3: 0.4}), budget)
        assert len(tree) <= budget
        assert sum(len(s.token_ids) for s in steps) == len(tree)
        assert all(-1 <= p < i for i, p in enumerate(tree.parents))


def test_deeper_where_confident():
    tree, _, _ = run(chain_expand({1: 0.95, 2: 0.4}), 40, GrowthPolicy(min_relative=0.05))
    depth = {b: max(depth_of(tree, n) for n in range(len(tree)) if tree.token_ids[tree.path_to(n)[0]] == b) for b in (1, 2)}
    assert depth[1] > depth[2] + 3  # the 0.4 branch stops once it falls under 5% of the 0.95 branch


def test_branching_threshold_opens_branches():
    tree, _, _ = run(chain_expand({1: 0.6, 2: 0.35, 3: 0.05}), 4, GrowthPolicy(branch_threshold=0.3, max_depth=1))
    assert sorted(tree.token_ids) == [1, 2]  # 0.35 > 0.3 branches; 0.05 does not
    tree, _, _ = run(chain_expand({1: 0.6, 2: 0.35}), 4, GrowthPolicy(branch_threshold=0.5, max_depth=1))
    assert tree.token_ids == [1]  # the top candidate always extends; nothing else above 0.5


def test_one_expand_call_per_step_covers_the_whole_frontier():
    tree, steps, calls = run(chain_expand({1: 0.9, 2: 0.45, 3: 0.4}), 30, GrowthPolicy(max_width=3))
    assert len(calls) == len(steps)
    assert calls[0] == [-1]
    assert len(calls[1]) == 3  # all three branches expanded by one forward


def test_confidence_is_product_along_path():
    tree, _, _ = run(chain_expand({1: 0.5}), 3, GrowthPolicy(branch_threshold=0.9))
    assert tree.confidence == [0.5, 0.25, 0.125]


def test_best_leaf_prefers_the_deepest_most_confident_branch():
    tree = GrowingTree()
    a = tree.add(-1, 10, 0.9)
    b = tree.add(-1, 20, 0.4)
    a2 = tree.add(a, 11, 0.9)
    b2 = tree.add(b, 21, 0.9)
    assert best_leaf(tree) == a2
    assert best_leaf(tree, num_nodes=2) == a  # only the first two nodes were sent for verification
    assert best_leaf(GrowingTree()) == -1
    assert b2 != best_leaf(tree)


def test_continue_a_seeded_tree():
    tree = GrowingTree()
    seed = tree.add(-1, 1, 0.9)
    steps = list(grow_tree(lambda f: [[(1, 0.9)] for _ in f], 4, tree=tree, frontier=[seed]))
    assert len(tree) == 4 and tree.parents == [-1, 0, 1, 2]
    assert steps[0].first == 1


EOS = 7


def test_a_branch_ends_at_a_stop_token():
    """Nothing is drafted past the target's EOS (generation ends there): the EOS node is never expanded, and growth
    ends once every live branch has reached one; a weak branch beside it stops as it would beside any other token."""
    def expand(frontier, tree):
        out = []
        for node in frontier:
            depth = 0 if node < 0 else len(tree.path_to(node))
            out.append([(EOS, 0.9), (5, 0.05)] if depth == 2 else [(1, 0.95), (2, 0.35)])
        return out

    stop = GrowthPolicy(stop_token_ids=frozenset({EOS}))
    tree, steps, calls = run(expand, 40, stop)
    eos_nodes = [n for n, t in enumerate(tree.token_ids) if t == EOS]
    assert eos_nodes and all(n not in frontier for frontier in calls for n in eos_nodes)
    assert all(tree.parents[n] not in eos_nodes for n in range(len(tree)))  # no node below an EOS
    assert len(calls) == 3  # root, depth 1, depth 2: then only EOS leaves (and the 5% branch) are left
    unstopped, _, _ = run(expand, 40, GrowthPolicy())
    assert len(unstopped) == 40 > len(tree)  # without the stop tokens it grows on past EOS to the budget


def test_a_seeded_tree_ending_at_a_stop_token_does_not_grow():
    tree = GrowingTree()
    seed = tree.add(tree.add(-1, 1, 0.9), EOS, 0.9)
    steps = list(grow_tree(lambda f: [[(1, 0.9)] for _ in f], 8, GrowthPolicy(stop_token_ids=frozenset({EOS})),
                           tree=tree, frontier=[seed]))
    assert steps == [] and len(tree) == 2
