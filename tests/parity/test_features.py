"""The verifier's features: the target's final hidden states of exactly the newly cached positions, from
the same forward, and their bytes counted in the round stats."""

import pytest
import torch

from specsplit.client import Client
from specsplit.config import VerifierConfig
from specsplit.features import Features
from specsplit.launch import start_stack
from specsplit.tree import TokenTree
from tiny import hf_greedy, tiny_eagle, tiny_loaded
from verifier_service.engine import TargetEngine

PROMPT = [258, 72, 101, 108, 108, 111, 32, 119]


@pytest.fixture(scope="module")
def target():
    return tiny_loaded(seed=0, eos=False)


def hf_features(model, token_ids):
    """[T, H] the target's hidden_states[-1] (after the final norm) over token_ids."""
    with torch.no_grad():
        return model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1][0]


GRAPHS = pytest.mark.parametrize("graphs", [False, True], ids=["lean", "cuda-graphs"])  # (fixed-shape ticks)


@GRAPHS
def test_prefill_and_verify_return_the_newly_cached_positions(target, graphs):
    engine = TargetEngine(target, VerifierConfig(cuda_graphs=graphs))
    try:
        prefill = engine.prefill("s", PROMPT, return_features=True)
        assert prefill.features.first_position == 0
        assert prefill.features.num_positions == len(PROMPT) - 1  # the pending last token is not cached
        greedy = hf_greedy(target.model, PROMPT, 6)
        tree = TokenTree((greedy[0], 5, greedy[1]), (-1, -1, 0))  # accepts nodes 0 and 2, rejects node 1
        result = engine.verify("s", tree, len(PROMPT))
        assert result.verdict.accepted_nodes == (0, 2)
        committed = PROMPT + list(result.verdict.committed_token_ids)
        expected = hf_features(target.model, committed)  # [T, H]
        torch.testing.assert_close(prefill.features.values.float(), expected[:len(PROMPT) - 1], atol=2e-3, rtol=2e-3)
        f = result.features
        assert (f.first_position, f.num_positions) == (len(PROMPT) - 1, 3)  # root + 2 accepted nodes
        torch.testing.assert_close(f.values.float(), expected[len(PROMPT) - 1:len(PROMPT) + 2], atol=2e-3, rtol=2e-3)
        assert f.end_position == len(committed) - 1
        assert engine.stats.graphed == graphs  # (the verification; the prompt's tick runs the lean forward)
    finally:
        engine.close()


@GRAPHS
def test_a_decode_burst_returns_the_features_of_every_position_it_cached(target, graphs):
    engine = TargetEngine(target, VerifierConfig(cuda_graphs=graphs))
    try:
        engine.prefill("s", PROMPT, return_features=True)
        greedy = hf_greedy(target.model, PROMPT, 6)
        result = engine.verify("s", TokenTree.chain([greedy[0], 5]), len(PROMPT), 0, 3)  # 1 accepted + 1 + 3
        assert list(result.verdict.committed_token_ids) == greedy[:5]
        f = result.features
        assert (f.first_position, f.end_position) == (len(PROMPT) - 1, len(PROMPT) + 4)  # all but the pending token
        expected = hf_features(target.model, PROMPT + greedy[:5])  # [T, H]
        torch.testing.assert_close(f.values.float(), expected[len(PROMPT) - 1:len(PROMPT) + 4], atol=2e-3, rtol=2e-3)
        assert engine.stats.graphed == (4 if graphs else 0)  # the tree, then three decode steps
    finally:
        engine.close()


def test_features_only_for_sessions_that_asked(target):
    engine = TargetEngine(target)
    try:
        assert engine.prefill("plain", PROMPT).features is None
        assert engine.verify("plain", TokenTree.empty(), len(PROMPT)).features is None
    finally:
        engine.close()


def test_feature_bytes_on_the_wire():
    values = torch.randn(3, 5).half()
    f = Features(7, values)
    data = f.to_bytes()
    assert len(data) == f.nbytes == 3 * 5 * 2
    back = Features.from_bytes(data, 3, 5, 7)
    assert back.first_position == 7 and torch.equal(back.values, values)


def test_round_stats_count_every_cached_position_once(target):
    hidden = target.model.config.hidden_size
    with start_stack(target, [tiny_eagle(target)]) as stack:
        chunks = list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=20, seed=0))
    tokens = [t for c in chunks for t in c.token_ids]
    stats = [c.stats for c in chunks if c.stats is not None]
    assert len(tokens) == 20
    # every position cached by the end (prompt + generated, less the pending last token), 2 bytes per unit
    assert sum(s.feature_bytes for s in stats) == (len(PROMPT) + 20 - 1) * hidden * 2
    assert all(s.feature_bytes > 0 for s in stats)


def test_an_imported_session_keeps_returning_features(target):
    a, b = TargetEngine(target), TargetEngine(target)
    try:
        a.prefill("s", PROMPT, return_features=True)
        blob = a.export_session("s", len(PROMPT))
        b.import_session("s", PROMPT, blob, return_features=True)
        tree = TokenTree.chain(hf_greedy(target.model, PROMPT, 2))
        from_a, from_b = a.verify("s", tree, len(PROMPT)), b.verify("s", tree, len(PROMPT))
        assert from_b.features is not None and from_b.features.first_position == len(PROMPT) - 1
        torch.testing.assert_close(from_b.features.values.float(), from_a.features.values.float(), atol=2e-3, rtol=2e-3)
    finally:
        a.close()
        b.close()
