"""Medusa self-speculation in the verifier: the tree shape, and lossless greedy output through gRPC."""

import grpc
import pytest
import torch

from specsplit.heads import Manifest, MedusaHeads, save_artifact
from specsplit.launch import start_stack
from specsplit.models import target_identity
from specsplit.errors import FailedPrecondition
from tiny import PARITY_PROMPTS, generate_through, hf_greedy, tiny_loaded, tiny_medusa
from verifier_service.medusa import find_artifact, load_medusa, sparse_tree_paths

PROMPTS = PARITY_PROMPTS


@pytest.fixture(scope="module")
def target():
    return tiny_loaded(seed=0, layers=2)


def run(stack, prompt_ids, max_new_tokens, draft="medusa"):
    return generate_through(stack, prompt_ids, max_new_tokens, draft)[:2]


def test_sparse_tree_is_prefix_closed_and_within_budget():
    paths = sparse_tree_paths(num_heads=4, top_k=4, max_nodes=20)
    assert len(paths) == 20 and len(set(paths)) == 20
    seen = set()
    for path in paths:
        assert len(path) == 1 or path[:-1] in seen  # parents come first
        seen.add(path)
    assert (0,) == paths[0] and (0, 0) in seen and max(map(len, paths)) <= 4


def test_proposal_takes_each_heads_top_k(target):
    medusa = tiny_medusa(target, num_heads=3, top_k=3, max_nodes=12)
    feature = torch.randn(64)
    tree = medusa.propose(feature)
    assert len(tree) == 12 == medusa.max_nodes
    logits = medusa.lm_head(medusa.heads(feature[None])[:, 0])  # [K, V]
    top = logits.topk(3, dim=-1).indices
    for node, path in enumerate(medusa.paths):
        assert tree.token_ids[node] == int(top[len(path) - 1, path[-1]])
        assert tree.depths[node] == len(path)


def test_random_heads_are_lossless(target):
    with start_stack(target, [], medusa=tiny_medusa(target)) as stack:
        drafted = 0
        for prompt in PROMPTS:
            tokens, stats = run(stack, prompt, 40)
            assert tokens == hf_greedy(target.model, prompt, 40)
            drafted += sum(s.num_draft_tokens for s in stats)
            assert all(s.drafter in ("medusa", "none") and s.feature_bytes == 0 for s in stats)
            assert all(s.num_draft_tokens <= 16 for s in stats)
        assert drafted > 0


def test_proposal_reads_the_feature_of_the_last_cached_position(target):
    """After Prefill and after each Verify the tree comes from f_{L-2}: the feature whose logits gave the
    pending token (L committed tokens)."""
    from specsplit.tree import TokenTree
    from verifier_service.engine import TargetEngine

    medusa = tiny_medusa(target)
    engine = TargetEngine(target, medusa=medusa)
    prompt = PROMPTS[1]
    try:
        result = engine.prefill("s", prompt, medusa=True)
        with torch.no_grad():
            hidden = target.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
        assert result.proposal == medusa.propose(hidden[len(prompt) - 2])
        greedy = hf_greedy(target.model, prompt, 3)
        verify = engine.verify("s", TokenTree.chain(greedy[:2]), len(prompt))
        committed = prompt + list(verify.verdict.committed_token_ids)
        with torch.no_grad():
            hidden = target.model(torch.tensor([committed]), output_hidden_states=True).hidden_states[-1][0]
        assert verify.proposal == medusa.propose(hidden[len(committed) - 2])
    finally:
        engine.close()


def test_medusa_without_heads_is_refused(target):
    with start_stack(target, []) as stack:
        with pytest.raises(grpc.RpcError) as err:
            run(stack, PROMPTS[0], 5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--medusa" in err.value.details()


def test_shipped_artifact_is_found_by_target_and_refused_for_another(tmp_path, target):
    heads = MedusaHeads(64, 2)
    identity = target_identity(target)
    for name, tau in (("m1", 1.5), ("m2", 2.5)):
        save_artifact(tmp_path / name, heads, Manifest("medusa", name, identity, target.fingerprint,
                                                       heads.manifest_config(), measured={"tau": {"chat": tau}}))
    save_artifact(tmp_path / "other", heads, Manifest("medusa", "other", "params-sha256:x", target.fingerprint,
                                                      heads.manifest_config(), measured={"tau": 9.0}))
    assert find_artifact("medusa", identity, target.fingerprint, tmp_path) == tmp_path / "m2"
    assert load_medusa(tmp_path / "m1", target).name == "m1"
    with pytest.raises(FailedPrecondition, match="trained for target"):
        load_medusa(tmp_path / "other", target)


def test_medusa_plus_ngram_is_lossless_and_merges_the_lookup(target):
    from draft_service.ngram import NgramProposer
    from specsplit.config import DraftConfig

    with start_stack(target, [NgramProposer(DraftConfig())], medusa=tiny_medusa(target)) as stack:
        for prompt in PROMPTS:
            tokens, stats = run(stack, prompt, 40, draft="medusa+ngram")
            assert tokens == hf_greedy(target.model, prompt, 40)
            assert all(s.drafter in ("medusa+ngram", "none") for s in stats)


def test_auto_picks_a_shipped_artifact_only_when_it_measured_faster_than_ngram(tmp_path, target, monkeypatch):
    import verifier_service.medusa as medusa_module
    from specsplit.heads import FeatureDrafter
    from specsplit.launch import auto_draft

    monkeypatch.setattr(medusa_module, "ARTIFACTS_DIR", tmp_path)
    assert auto_draft(target) == "ngram"  # nothing ships for this target
    identity = target_identity(target)
    heads, drafter = MedusaHeads(64, 2), FeatureDrafter.init_from_target(target.model)
    save_artifact(tmp_path / "m", heads, Manifest("medusa", "m", identity, target.fingerprint,
                                                  heads.manifest_config(), measured={"tau": 2.0, "speedup_vs_ngram": 0.9}))
    assert auto_draft(target) == "ngram"  # slower than lookup alone where it was measured
    save_artifact(tmp_path / "m", heads, Manifest("medusa", "m", identity, target.fingerprint,
                                                  heads.manifest_config(), measured={"speedup_vs_ngram": 1.1}))
    assert auto_draft(target) == "medusa+ngram"
    save_artifact(tmp_path / "e", drafter, Manifest("eagle", "e", identity, target.fingerprint,
                                                    drafter.manifest_config(), measured={"speedup_vs_ngram": 1.2}))
    assert auto_draft(target) == "eagle+ngram"
    (tmp_path / "h").mkdir()  # a half draft has no weights: its manifest records what was measured
    (tmp_path / "h" / "manifest.json").write_text(Manifest("half", "h", identity, target.fingerprint,
                                                           measured={"speedup_vs_ngram": 1.3}).to_json())
    assert auto_draft(target) == "half+ngram"
