"""train.py on a tiny target: each kind trains, improves held-out agreement, and writes a loadable artifact."""

import json

import pytest
from tiny import tiny_loaded

from draft_service.training import train
from draft_service.training.generate_data import build_shard, eos_ids, shard_path, write_shard
from specsplit.heads import check_manifest, load_artifact
from specsplit.models import load_model, target_identity


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    loaded = tiny_loaded(seed=3)
    loaded.model.save_pretrained(root / "target")
    loaded.tokenizer.save_pretrained(root / "target")
    prompts = [{"index": i, "kind": "t", "prompt": f"prompt number {i} " * (1 + i % 3)} for i in range(24)]
    tensors, stats = build_shard(loaded, prompts, max_new_tokens=12, batch_size=8,
                                 pad_id=loaded.tokenizer.eos_token_id, eos=eos_ids(loaded))
    (root / "data").mkdir()
    write_shard(shard_path(root / "data", 0), tensors, stats)
    (root / "data" / "data.json").write_text(json.dumps({"seed": 0, "sequences": 24}))
    return root


@pytest.mark.parametrize("kind,extra", [("eagle", []), ("medusa", ["--heads", "2"]), ("draft_lm", ["--layers", "1"])])
def test_train_writes_artifact_for_the_target(tiny_data, kind, extra, capsys):
    out = tiny_data / f"artifact-{kind}"
    train.main([kind, "--out", str(out), "--data", str(tiny_data / "data"), "--target-model",
                str(tiny_data / "target"), "--epochs", "3", "--batch-tokens", "256", "--head-vocab", "200",
                "--val-fraction", "0.2", "--lr", "3e-3", *extra])
    target = load_model(str(tiny_data / "target"), "cpu", "float32")
    module, manifest = load_artifact(out, target.model.get_input_embeddings().weight, target.model.model.norm.weight)
    check_manifest(manifest, target_identity(target), target.fingerprint)
    assert manifest.kind == kind and manifest.training["steps"] > 0
    assert all(0.0 <= a <= 1.0 for a in manifest.measured["heldout_agreement"])
    log = capsys.readouterr().out
    assert "held-out agreement" in log
