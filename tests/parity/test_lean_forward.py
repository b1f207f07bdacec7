"""The draft's lean forward (draft_service/lean.py) computes what the Hugging Face forward computes.

In float32 weights its logits match the Hugging Face model's to float rounding for a prompt, single steps
and a tree-masked forward over its preallocated cache, and its cache's truncate/compact leave the rows a
DynamicCache would keep; a forward interrupted between layers leaves the cache as it was. In 16-bit weights it is a draft: its greedy tokens mostly agree.
"""

from __future__ import annotations

import pytest
import torch

from draft_service import lean, quantized
from specsplit import kvcache
from tiny import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3, layers=3).eval()


def hf_logits(model, ids, positions=None, mask=None, cache=None):
    key = kvcache.cache_kwarg(model)
    with torch.inference_mode():
        return model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                     **{key: cache}).logits[0]  # [Q, V]


def lean_logits(draft, ids, positions=None, mask=None, cache=None):
    with torch.inference_mode():
        return draft(input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache).logits[0]  # [Q, V]


def tree_mask(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """allowed: [Q, S] bool -> [1, 1, Q, S] additive"""
    return torch.where(allowed, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)[None, None]


def test_lean_matches_hugging_face_on_prompt_steps_and_a_tree(model):
    draft = lean.LeanLlama(model, torch.float32)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=generator)  # [1, 40]
    hf_cache, lean_cache = kvcache.new_cache(model), draft.new_cache()
    assert isinstance(lean_cache, kvcache.LeanCache)
    # a 30-token prompt (the SDPA path), then two single steps (the grouped-matmul path)
    torch.testing.assert_close(lean_logits(draft, ids[:, :30], cache=lean_cache),
                               hf_logits(model, ids[:, :30], cache=hf_cache), atol=1e-4, rtol=1e-4)
    for t in (30, 31):
        torch.testing.assert_close(lean_logits(draft, ids[:, t:t + 1], cache=lean_cache),
                                   hf_logits(model, ids[:, t:t + 1], cache=hf_cache), atol=1e-4, rtol=1e-4)
    assert kvcache.cache_length(lean_cache) == kvcache.cache_length(hf_cache) == 32
    # a tree of 4 nodes over the 32 cached rows: root children 0, 1; node 2 under 0; node 3 under 2
    parents = [-1, -1, 0, 2]
    allowed = torch.zeros(4, 36, dtype=torch.bool)  # [Q, S]
    allowed[:, :32] = True
    for node in range(4):  # each row sees itself and its ancestors
        ancestor = node
        while ancestor >= 0:
            allowed[node, 32 + ancestor] = True
            ancestor = parents[ancestor]
    positions = torch.tensor([[32, 32, 33, 34]])  # [1, Q] depth after the last committed token
    tree_ids = ids[:, 32:36]  # [1, 4]
    expected = hf_logits(model, tree_ids, positions, tree_mask(allowed, torch.float32), hf_cache)
    got = lean_logits(draft, tree_ids, positions, tree_mask(allowed, torch.float32), lean_cache)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # keep the path 0 -> 2 -> 3: both caches hold the same rows after compaction, and continue alike
    kvcache.compact(hf_cache, 32, (0, 2, 3))
    kvcache.compact(lean_cache, 32, (0, 2, 3))
    assert kvcache.cache_length(lean_cache) == kvcache.cache_length(hf_cache) == 35
    torch.testing.assert_close(lean_logits(draft, ids[:, 36:37], cache=lean_cache),
                               hf_logits(model, ids[:, 36:37], cache=hf_cache), atol=1e-4, rtol=1e-4)
    kvcache.truncate(hf_cache, 20)
    kvcache.truncate(lean_cache, 20)
    torch.testing.assert_close(lean_logits(draft, ids[:, 20:38], cache=lean_cache),
                               hf_logits(model, ids[:, 20:38], cache=hf_cache), atol=1e-4, rtol=1e-4)


def test_lean_cache_grows_past_its_capacity(model):
    draft = lean.LeanLlama(model, torch.float32)
    cache = draft.new_cache()
    ids = torch.randint(0, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(1))
    lean_logits(draft, ids[:, :250], cache=cache)
    assert cache.keys.shape[2] >= 250
    last = lean_logits(draft, ids[:, 250:300], cache=cache)[-1]  # past the first 256-row allocation
    assert cache.length == 300 and cache.keys.shape[2] >= 300
    torch.testing.assert_close(last, hf_logits(model, ids)[-1], atol=1e-4, rtol=1e-4)


def test_an_interrupted_forward_leaves_the_cache_as_it_was(model):
    """A forward stopped between two layers (its rows half written) raises ForwardInterrupted; the cache keeps its
    length, and the same forward run again gives what it gives uninterrupted."""
    draft = lean.LeanLlama(model, torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    cache, clean = draft.new_cache(), draft.new_cache()
    lean_logits(draft, ids[:, :30], cache=cache)
    lean_logits(draft, ids[:, :30], cache=clean)
    for after in range(len(draft.layers)):  # stopped before layer `after`
        asked = []
        with pytest.raises(lean.ForwardInterrupted), torch.inference_mode():
            draft(input_ids=ids[:, 30:40], cache=cache, stop=lambda: asked.append(1) or len(asked) > after)
        assert len(asked) == after + 1 and cache.length == 30
    again = lean_logits(draft, ids[:, 30:40], cache=cache)  # [10, V]
    torch.testing.assert_close(again, lean_logits(draft, ids[:, 30:40], cache=clean), atol=0, rtol=0)
    assert cache.length == 40


INT8 = pytest.param(torch.int8, marks=pytest.mark.skipif(not quantized.int8_available(),
                                                        reason="no weight-only int8 matmul in this torch"))
INT4 = pytest.param(quantized.INT4, marks=pytest.mark.skipif(not quantized.int4_available(),
                                                            reason="no CPU int4 matmul in this torch"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, INT8, INT4])
def test_lean_in_16_bit_or_quantized_weights_mostly_agrees(model, dtype):
    draft = lean.LeanLlama(model, dtype)
    assert draft.weight_dtype == dtype and draft.dtype == torch.float32  # float32 activations and cache
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(2))
    agree = (lean_logits(draft, ids).argmax(-1) == hf_logits(model, ids).argmax(-1)).float().mean()
    assert agree >= 0.8


def test_int8_weights_round_to_within_half_a_step_per_row():
    weight = torch.randn(48, 32, generator=torch.Generator().manual_seed(4))  # [N, K]
    weight[3] = 0.0  # an all-zero row stays zero (no division by a zero scale)
    int8 = quantized.Int8Weight.of(weight)
    assert int8.values.dtype == torch.int8 and int8.values.shape == (48, 32) and int8.scales.shape == (48,)
    scales = int8.values.abs().amax(dim=1)  # [N] the largest entry of each row maps to +-127
    assert scales[3] == 0 and bool((scales[torch.arange(48) != 3] == 127).all())
    exact_scales = weight.abs().amax(dim=1) / 127.0  # [N] before rounding to bfloat16
    assert float((int8.values.float() * exact_scales[:, None] - weight).abs().max()) <= float(exact_scales.max()) / 2 + 1e-6
    if quantized.int8_available():
        x = torch.randn(5, 32, generator=torch.Generator().manual_seed(5))  # [Q, K]
        exact = x @ weight.T  # [Q, N]
        error = (int8.matmul(x).float() - exact).norm() / exact.norm()  # bfloat16 activations and scales, int8 weights
        assert float(error) < 0.02


NO_INT4 = pytest.mark.skipif(not quantized.int4_available(), reason="no CPU int4 matmul in this torch")


@NO_INT4
def test_int4_groups_hold_sixteen_levels_between_their_min_and_max():
    generator = torch.Generator().manual_seed(6)
    groups = quantized.INT4_GROUP
    # every group of 32 along a row is low + level * step for levels 0..15 (0 and 15 present): exact in int4
    levels = torch.randint(0, 16, (48, 2, groups), generator=generator)  # [N, K/G, G]
    levels[..., 0], levels[..., 1] = 0, 15
    low = torch.randn(48, 2, 1, generator=generator)  # [N, K/G, 1]
    step = torch.rand(48, 2, 1, generator=generator) + 0.1  # [N, K/G, 1]
    weight = (low + levels * step).view(48, 2 * groups)  # [N, K]
    int4 = quantized.Int4Weight.of(weight)
    assert int4.group == groups and int4.scales_and_zeros.shape == (2, 48, 2)
    x = torch.randn(5, 2 * groups, generator=generator)  # [Q, K]
    exact = x @ weight.T  # [Q, N]
    error = (int4.matmul(x).float() - exact).norm() / exact.norm()  # only bfloat16 activations, scales and zeros
    assert float(error) < 0.02


def test_int4_fits_only_rows_of_whole_groups(model):
    from types import SimpleNamespace

    assert quantized.int4_fits(model)  # hidden 64, intermediate 128, vocab 320
    config = model.config.to_dict()
    for change in ({"hidden_size": 72}, {"vocab_size": 328}, {"head_dim": 12}):  # rows of 72, 328 rows, rows of 48
        assert not quantized.int4_fits(SimpleNamespace(config=type(model.config)(**{**config, **change})))


@NO_INT4
def test_an_int4_head_scores_its_best_ids_exactly(model):
    draft = lean.LeanLlama(model, quantized.INT4)
    head = draft.head
    assert isinstance(head, quantized.RescoredHead) and head.exact is not draft.embed  # untied: the head's own rows
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(7))  # [Q, H]
    logits = head.matmul(x)  # [Q, V]
    exact = x @ model.lm_head.weight.detach().T  # [Q, V]
    best = head.approx.matmul(x).float().topk(quantized.RESCORE_TOP, dim=-1).indices  # [Q, top] the int4 ranking
    assert float((logits.gather(1, best) - head.approx.matmul(x).float().gather(1, best)).abs().max()) > 1e-3
    torch.testing.assert_close(logits.gather(1, best), exact.gather(1, best), atol=1e-4, rtol=1e-4)
    assert bool((logits.argmax(-1) == exact.argmax(-1)).all())  # the exact best id is among the int4 head's best
    tied = tiny_llama(seed=3, layers=1)
    tied.lm_head.weight = tied.model.embed_tokens.weight  # what tied embeddings are (SmolLM2's)
    tied_draft = lean.LeanLlama(tied, quantized.INT4)
    assert tied_draft.head.exact is tied_draft.embed  # no second float copy of the table


def test_lean_refuses_other_architectures(model):
    config = model.config.to_dict()
    other = type(model)(type(model.config)(**{**config, "attention_bias": True}))
    assert lean.supports(model) and not lean.supports(other)
    with pytest.raises(ValueError, match="Llama-architecture"):
        lean.LeanLlama(other)
