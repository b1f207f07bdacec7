from draft_service.ngram import NgramProposer
from specsplit.config import DraftConfig
from specsplit.lookup import COPY_BRIDGE_BEHIND, COPY_BRIDGE_ROUNDS, NgramIndex, span_hits, use_bridge, use_span


def test_continuation_of_longest_suffix_match():
    index = NgramIndex(1, 3)
    index.extend([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert index.continuations(max_len=3, max_branches=3) == [[4, 5, 9]]


def test_most_recent_match_first_and_distinct_branches():
    index = NgramIndex(1, 2)
    index.extend([7, 1, 2, 7, 3, 4, 7])
    # suffix [7] was followed by [3, 4] (most recent) and [1, 2]
    assert index.continuations(max_len=2, max_branches=3) == [[3, 4], [1, 2]]


def test_lookup_for_a_context_past_the_indexed_tokens():
    index = NgramIndex(3, 4)  # only suffixes of 3-4 tokens may match (what half+ngram copies after)
    index.extend([5, 6, 7, 8, 9, 10, 11])
    assert index.continuations(4, 1, context=[1, 5, 6, 7]) == [[8, 9, 10, 11]]  # drafted [5, 6, 7] matched
    assert index.continuations(4, 1, context=[1, 2, 6, 7]) == []  # [6, 7]: too short a match
    assert index.tokens == [5, 6, 7, 8, 9, 10, 11]  # the context is not indexed


def test_no_match_gives_empty_tree():
    proposer = NgramProposer(DraftConfig())
    proposer.start("s", [1, 2, 3])
    assert len(proposer.propose("s", [1, 2, 3, 4], max_nodes=8)) == 0


def test_proposal_respects_budget_and_branches():
    proposer = NgramProposer(DraftConfig(ngram_branches=2))
    tokens = [1, 2, 10, 11, 12, 13, 1, 2, 20, 21, 22, 1, 2]
    proposer.start("s", tokens)
    tree = proposer.propose("s", tokens, max_nodes=5)
    assert len(tree) <= 5
    # first branch: the most recent continuation of [1, 2]
    assert tree.token_ids[:3] == (20, 21, 22)
    assert 10 in tree.token_ids  # the older continuation as a second branch
    assert proposer.propose("s", tokens, max_nodes=0).token_ids == ()


def test_index_follows_new_tokens():
    proposer = NgramProposer(DraftConfig())
    proposer.start("s", [5, 6, 7])
    tree = proposer.propose("s", [5, 6, 7, 5, 6], max_nodes=4)
    assert tree.token_ids[0] == 7


def test_a_span_is_used_while_spans_have_been_right_or_when_it_extends_the_drafts_tokens():
    assert use_span([4, 5, 6], [], hits=0.5) and not use_span([4, 5, 6], [], hits=0.4)
    assert not use_span([], [], hits=1.0)
    assert use_span([4, 5, 6], [4, 5], hits=0.0)  # the draft's kept tokens vouch for its start
    assert not use_span([4, 9, 6], [4, 5], hits=1.0)  # the draft disagrees
    assert not use_span([4, 5], [4, 5], hits=1.0)  # no further than the draft's own


def test_the_target_bridges_after_a_copied_span_only_when_the_draft_is_far_behind():
    assert use_bridge(0, COPY_BRIDGE_BEHIND) and use_bridge(COPY_BRIDGE_ROUNDS - 1, 64)  # a code edit's edit point
    assert not use_bridge(0, 1)  # a chance match rejected at its first token: the draft goes on at once
    assert not use_bridge(COPY_BRIDGE_ROUNDS, 64)  # the bridge is over


def test_span_hits_count_what_the_target_committed_as_far_as_both_go():
    assert span_hits(1.0, [4, 5, 6, 7], [4, 5, 9]) == 1.0 + 0.5 * (2 / 3 - 1.0)  # 2 of the 3 comparable right
    assert span_hits(1.0, [4, 5, 6, 7], [8]) == 0.5  # a chance match: wrong from its first token
    assert span_hits(0.5, [4, 5], [4, 5, 6]) == 0.75  # all of it right
    hits = 1.0
    for _ in range(2):  # two wrong spans in a row stop spans being verified without the draft
        hits = span_hits(hits, [4, 5], [8])
    assert not use_span([4, 5], [], hits)


def test_a_lookup_path_ends_at_a_stop_token():
    """Nothing after the target's EOS can be committed: a looked-up continuation is cut there."""
    proposer = NgramProposer(DraftConfig(ngram_branches=1))
    tokens = [1, 2, 10, 20, 11, 12, 13, 5, 1, 2]
    proposer.start("s", tokens)
    assert proposer.propose("s", tokens, max_nodes=5).token_ids == (10, 20, 11, 12, 13)
    assert proposer.propose("s", tokens, max_nodes=5, stop_token_ids=(11,)).token_ids == (10, 20, 11)
