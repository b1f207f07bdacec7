"""The EAGLE-style feature drafter through the real gRPC services: greedy output equals HF greedy of the
target alone, whatever the drafter's weights; an artifact trained for another target is refused."""

import grpc
import pytest
import torch

from draft_service.drafter import GrowthControl
from draft_service.feature_proposer import load_feature_proposer
from draft_service.ngram import NgramProposer
from draft_service.proposers import CombinedProposer
from specsplit.config import DraftConfig
from specsplit.errors import FailedPrecondition
from specsplit.features import Features
from specsplit.heads import FeatureDrafter, Manifest, save_artifact
from specsplit.launch import start_stack
from specsplit.models import target_identity
from tiny import PARITY_PROMPTS, generate_through, hf_greedy, tiny_eagle, tiny_loaded

PROMPTS = PARITY_PROMPTS


@pytest.fixture(scope="module")
def target():
    return tiny_loaded(seed=0, layers=2)


def run(stack, prompt_ids, max_new_tokens, draft="auto"):
    return generate_through(stack, prompt_ids, max_new_tokens, draft)[:2]


def test_random_feature_drafter_is_lossless(target):
    proposer = tiny_eagle(target, config=DraftConfig(model_top_k=2, model_depth=4))
    with start_stack(target, [proposer]) as stack:
        drafted = 0
        for prompt in PROMPTS:
            tokens, stats = run(stack, prompt, 40)
            assert tokens == hf_greedy(target.model, prompt, 40)
            drafted += sum(s.num_draft_tokens for s in stats)
            assert all(s.drafter in ("eagle", "none") for s in stats)
        assert drafted > 0  # the drafter really drafted


def test_pruned_vocabulary_drafter_is_lossless(target):
    head_ids = torch.arange(0, 320, 2)  # half the vocabulary
    proposer = tiny_eagle(target, seed=3, head_ids=head_ids)
    with start_stack(target, [proposer]) as stack:
        for prompt in PROMPTS[:2]:
            tokens, stats = run(stack, prompt, 30)
            assert tokens == hf_greedy(target.model, prompt, 30)
    proposer.start("u", PROMPTS[1])
    proposer.add_features("u", [Features(0, torch.randn(len(PROMPTS[1]) - 1, 64).half())])
    tree = proposer.propose("u", PROMPTS[1], 12)
    assert len(tree) > 0 and all(t % 2 == 0 for t in tree.token_ids)  # only ids the pruned head scores


def test_greedy_chain_equals_drafting_from_scratch(target):
    """The cached, tree-masked drafting equals plain causal passes of the drafter over the whole history."""
    proposer = tiny_eagle(target, config=DraftConfig(model_top_k=1, model_depth=4))
    drafter = proposer.drafter
    prompt = PROMPTS[1]
    features = torch.randn(len(prompt) - 1, 64).half()  # [P-1, H]
    proposer.start("s", prompt)
    proposer.add_features("s", [Features(0, features[:5]), Features(5, features[5:])])
    chain = proposer.propose("s", prompt, 4)
    assert chain.is_chain() and len(chain) == 4
    feats, toks = features.float(), list(prompt[1:])  # row t reads (f_t, x_{t+1})
    expected = []
    with torch.no_grad():
        for _ in range(4):
            n = len(toks)
            out, _ = drafter(feats[None], torch.tensor([toks]), torch.arange(1, n + 1)[None])  # [1, n, H]
            token = int(drafter.vocab_ids[drafter.logits(out[0, -1]).argmax()])
            expected.append(token)
            feats, toks = torch.cat([feats, out[0, -1:]]), toks + [token]
    assert list(chain.token_ids) == expected


def test_eagle_plus_ngram_is_lossless(target):
    proposer = CombinedProposer(tiny_eagle(target), NgramProposer(DraftConfig()))
    with start_stack(target, [proposer]) as stack:
        for prompt in PROMPTS:
            tokens, stats = run(stack, prompt, 40)
            assert tokens == hf_greedy(target.model, prompt, 40)
            assert all(s.drafter in ("eagle+ngram", "none") for s in stats)


def test_artifact_of_another_target_is_refused_per_session(target):
    other = tiny_loaded(seed=5)
    proposer = tiny_eagle(other)  # trained (so its manifest says) for another target, same tokenizer
    with start_stack(target, [proposer]) as stack:
        with pytest.raises(grpc.RpcError) as err:
            run(stack, PROMPTS[0], 5, draft="eagle")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "trained for target" in err.value.details()


def test_artifact_of_another_target_is_refused_at_startup(tmp_path, target):
    target_dir = tmp_path / "target"
    target.model.save_pretrained(target_dir)
    target.tokenizer.save_pretrained(target_dir)
    drafter = FeatureDrafter.init_from_target(target.model)
    good = Manifest("eagle", "good", target_identity(tiny_loaded(seed=0)), target.fingerprint, drafter.manifest_config())
    save_artifact(tmp_path / "good", drafter, good)
    proposer = load_feature_proposer(tmp_path / "good", str(target_dir))
    assert proposer.target_identity == good.target_identity
    torch.testing.assert_close(proposer.drafter.embed.weight, target.model.get_input_embeddings().weight)
    bad = Manifest("eagle", "bad", "params-sha256:0000", target.fingerprint, drafter.manifest_config())
    save_artifact(tmp_path / "bad", drafter, bad)
    with pytest.raises(FailedPrecondition, match="trained for target"):
        load_feature_proposer(tmp_path / "bad", str(target_dir))


def test_features_gap_restarts_the_cache_and_overlap_is_skipped(target):
    proposer = tiny_eagle(target)
    hidden = target.model.config.hidden_size
    proposer.start("s", [1, 2, 3, 4, 5, 6, 7, 8])
    proposer.add_features("s", [Features(0, torch.zeros(4, hidden).half())])
    proposer.add_features("s", [Features(2, torch.zeros(4, hidden).half())])  # overlaps 2..3: keeps 4..5
    assert proposer._sessions["s"].received_end == 6
    proposer.add_features("s", [Features(9, torch.zeros(2, hidden).half())])  # a gap: start again at 9
    session = proposer._sessions["s"]
    assert (session.start, session.received_end) == (9, 11)
    tokens = list(range(1, 14))  # 13 committed: positions 0..11 cached on the verifier; we have 9..10
    assert len(proposer.propose("s", tokens, 8)) == 0  # features lag the tokens: no tree
    proposer.add_features("s", [Features(11, torch.zeros(1, hidden).half())])
    assert 0 < len(proposer.propose("s", tokens, 8)) <= 8


def eagle_round(proposer, session_id, tokens, max_nodes, provisional_max=0):
    """One DraftTree round on the drafter itself: the whole grown tree is sent for verification."""
    control = GrowthControl()
    steps = []
    for step in proposer.grow(session_id, tokens, max_nodes, control, provisional_max):
        steps.append(step)
        if step.done:
            control.verify(sum(len(s.token_ids) for s in steps))
    return steps


def test_streamed_rounds_seed_kept_provisional_tokens_with_their_rows(target):
    """A chain round, then provisional tokens; two of the path's tokens get committed, with the features the
    drafter itself predicted for them. The next round is seeded with the rest of the path, grown on the
    rows kept from the last round, and equals a fresh session drafting from that history."""
    proposer = tiny_eagle(target, config=DraftConfig(branch_threshold=1.0, grow_width=1))
    prompt = PROMPTS[1]
    history = torch.randn(len(prompt) - 1, target.model.config.hidden_size).half()  # [L-1, H] positions 0..L-2
    proposer.start("a", prompt)
    proposer.add_features("a", [Features(0, history)])
    steps = eagle_round(proposer, "a", prompt, max_nodes=3, provisional_max=4)
    assert [len(s.token_ids) for s in steps if s.provisional] == [1, 1, 1, 1]
    session = proposer._sessions["a"]
    path = session.path_tokens  # 3 verified chain nodes + 4 provisional
    assert path == [t for s in steps for t in s.token_ids] and len(path) == 7
    assert session.path_out.shape[0] == 6  # every path node but the last has its row

    committed = prompt + path[:2]  # the verifier accepted two of them
    predicted = torch.cat([session.last_out[None], session.path_out[:1]]).half()  # [2, H] positions L-1, L
    proposer.add_features("a", [Features(len(prompt) - 1, predicted)])
    seeded = eagle_round(proposer, "a", committed, max_nodes=8)
    assert seeded[0].seeded == 5 and list(seeded[0].token_ids) == path[2:]

    proposer.start("b", committed)
    proposer.add_features("b", [Features(0, history), Features(len(prompt) - 1, predicted)])
    fresh = eagle_round(proposer, "b", committed, max_nodes=8)
    tokens = lambda steps: [t for s in steps for t in s.token_ids]  # noqa: E731
    probs = lambda steps: [p for s in steps for p in s.draft_probs]  # noqa: E731
    assert tokens(seeded) == tokens(fresh)
    assert probs(seeded)[5:] == pytest.approx(probs(fresh)[5:], abs=2e-2)  # fp16 features vs fp32 rows


def agreeing_pair():
    """A one-layer target with tied embeddings and an EAGLE drafter made of that very layer reading only the
    token embedding: the drafter predicts the target's next token (all but the missing first row), so
    streamed rounds get long accepted branches and kept provisional tokens. (Its greedy text is degenerate,
    one token repeated; what matters here is that every round's tree is accepted far down.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specsplit.models import LoadedModel, tokenizer_fingerprint
    from tiny import EOS_ID, VOCAB, tiny_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=258, eos_token_id=None, pad_token_id=None, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(20.0)  # sharp logits
    model.generation_config.pad_token_id = EOS_ID
    tok = tiny_tokenizer()
    return LoadedModel(model, tok, "tiny-tied", tokenizer_fingerprint(tok))


@pytest.mark.parametrize("noise", [0.0, 0.1])  # 0.1: some rounds rejected, provisional tokens dropped
def test_streamed_feature_drafter_is_lossless_with_every_trigger(noise):
    from specsplit.config import OrchestratorConfig

    target = agreeing_pair()
    proposer = tiny_eagle(target, noise=noise)
    with torch.no_grad():
        proposer.drafter.fc.weight[:, target.model.config.hidden_size:] = 0  # read the token, not the feature
    kept = rejected = 0
    for trigger, provisional in (("goodput", 16), ("edgellm", 16), ("fixed", 8)):
        config = OrchestratorConfig(trigger=trigger, provisional_max=provisional, fixed_tree_nodes=4)
        with start_stack(target, [proposer], orchestrator_config=config) as stack:
            for prompt in PROMPTS[:3]:
                tokens, stats = run(stack, prompt, 40)
                assert tokens == hf_greedy(target.model, prompt, 40), trigger
                assert all(s.drafter in ("eagle", "none") for s in stats)
                kept += sum(s.provisional_kept for s in stats)
                rejected += sum(s.num_draft_tokens - s.num_accepted for s in stats)
    assert kept > 0  # streamed rounds seeded by last round's provisional tokens
    assert rejected > 0 if noise else True
