"""The trained-draft modules: cached == uncached drafting, artifacts round-trip, manifests refuse mismatches."""

import pytest
import torch

from specsplit.errors import FailedPrecondition
from specsplit.heads import (FeatureDrafter, Manifest, MedusaHeads, build_draft_lm, check_manifest,
                             draft_lm_manifest_config, frequent_ids, load_artifact, read_manifest, save_artifact)
from tests.tiny import tiny_llama


def _drafter(seed=0, head_ids=None):
    target = tiny_llama(seed)
    torch.manual_seed(seed + 1)
    drafter = FeatureDrafter.init_from_target(target, head_ids)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return target, drafter.eval()


def test_feature_drafter_cached_rows_equal_one_causal_pass():
    target, drafter = _drafter()
    T, H = 7, target.config.hidden_size
    features = torch.randn(1, T, H)  # [1, T, H]
    tokens = torch.randint(0, 300, (1, T))  # [1, T]
    positions = torch.arange(1, T + 1)[None]  # [1, T]
    with torch.no_grad():
        whole, _ = drafter(features, tokens, positions)  # [1, T, H]
        first, past = drafter(features[:, :4], tokens[:, :4], positions[:, :4])
        allowed = torch.ones(1, 1, T - 4, T, dtype=torch.bool).tril(diagonal=4)  # [1, 1, 3, T]
        rest, _ = drafter(features[:, 4:], tokens[:, 4:], positions[:, 4:], allowed, past)
    torch.testing.assert_close(torch.cat([first, rest], 1), whole, atol=1e-5, rtol=1e-5)


def test_feature_drafter_pruned_head_scores_chosen_ids():
    head_ids = torch.tensor([5, 9, 100, 257])
    _, drafter = _drafter(head_ids=head_ids)
    f = torch.randn(3, drafter.config.hidden_size)
    full = f @ drafter.embed.weight.T  # [3, V]
    torch.testing.assert_close(drafter.logits(f), full[:, head_ids])


def test_medusa_heads_start_as_identity():
    heads = MedusaHeads(16, 3)
    f = torch.randn(2, 5, 16)
    out = heads(f)  # [3, 2, 5, 16]
    assert out.shape == (3, 2, 5, 16)
    torch.testing.assert_close(out[2], f)


def _manifest(kind, config, name="t"):
    return Manifest(kind, name, "target-a", "fp-a", config)


def test_artifacts_round_trip_without_target_tensors(tmp_path):
    target, drafter = _drafter(head_ids=torch.tensor([3, 1, 2]))
    save_artifact(tmp_path / "e", drafter, _manifest("eagle", drafter.manifest_config()))
    heads = MedusaHeads(target.config.hidden_size, 2)
    torch.nn.init.normal_(heads.blocks[0].weight)
    save_artifact(tmp_path / "m", heads, _manifest("medusa", heads.manifest_config()))
    lm = build_draft_lm(target.config, 1, target.get_input_embeddings().weight, target=target)
    save_artifact(tmp_path / "d", lm, _manifest("draft_lm", draft_lm_manifest_config(lm)))
    from safetensors.torch import load_file
    assert "embed.weight" not in load_file(str(tmp_path / "e" / "weights.safetensors"))
    assert "model.embed_tokens.weight" not in load_file(str(tmp_path / "d" / "weights.safetensors"))
    embed = target.get_input_embeddings().weight
    for name, original in (("e", drafter), ("m", heads), ("d", lm)):
        loaded, manifest = load_artifact(tmp_path / name, embed, target.model.norm.weight)
        for key, value in original.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[key], value.half().float() if value.is_floating_point()
                                       else value, atol=1e-7, rtol=0, msg=f"{name}:{key}") if "embed" not in key \
                and "lm_head" not in key else None
    assert read_manifest(tmp_path / "e").config["head_vocab"] == 3


def test_manifest_refuses_another_target():
    manifest = _manifest("eagle", {})
    check_manifest(manifest, "target-a", "fp-a")
    with pytest.raises(FailedPrecondition, match="trained for target"):
        check_manifest(manifest, "target-b", "fp-a")
    with pytest.raises(FailedPrecondition, match="tokenizer"):
        check_manifest(manifest, "target-a", "fp-b")


def test_frequent_ids_most_frequent_first_with_forced_ids():
    counts = torch.tensor([5, 0, 9, 1, 7])
    assert frequent_ids(counts, 3, always=[1]).tolist() == [1, 2, 4]
