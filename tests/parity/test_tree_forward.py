"""One tree forward gives every node the logits of a plain forward along its own path."""

import pytest
import torch

from specsplit import kvcache
from specsplit.tree import TokenTree, build_buffers, full_attention_mask
from tiny import tiny_llama

TREES = {
    "chain": TokenTree.chain([11, 12, 13, 14]),
    "wide": TokenTree((11, 12, 13, 14), (-1, -1, -1, -1)),
    "mixed": TokenTree((11, 12, 13, 14, 15, 16, 17), (-1, -1, 0, 0, 2, 1, 5)),
    "single": TokenTree((42,), (-1,)),
}


@pytest.mark.parametrize("name", TREES)
def test_tree_logits_match_path_forward(name):
    model = tiny_llama(seed=1)
    tree = TREES[name]
    prefix = [3, 14, 15, 92, 65, 35]  # cached tokens
    root = 89  # the pending token
    cache = kvcache.new_cache(model)
    key = kvcache.cache_kwarg(model)  # ``cache`` or (older transformers) ``past_key_values``
    with torch.no_grad():
        model(torch.tensor([prefix]), **{key: cache}, use_cache=True)
        buffers = build_buffers(tree, root, len(prefix))
        mask = full_attention_mask(buffers.tree_attn_mask, len(prefix), torch.float32)
        logits = model(buffers.input_ids, position_ids=buffers.position_ids, attention_mask=mask,
                       **{key: cache}, use_cache=True).logits[0]  # [N+1, V]
        reference_root = model(torch.tensor([prefix + [root]])).logits[0, -1]
        assert torch.allclose(logits[0], reference_root, atol=1e-5)
        for node in range(len(tree)):
            path = [tree.token_ids[i] for i in tree.path_to(node)]
            reference = model(torch.tensor([prefix + [root] + path])).logits[0, -1]  # [V]
            assert torch.allclose(logits[node + 1], reference, atol=1e-5), f"node {node}"
            assert logits[node + 1].argmax() == reference.argmax()


def test_compaction_keeps_exactly_the_committed_path():
    model = tiny_llama(seed=2)
    prefix = [5, 6, 7]
    tree = TREES["mixed"]
    cache = kvcache.new_cache(model)
    key = kvcache.cache_kwarg(model)  # ``cache`` or (older transformers) ``past_key_values``
    with torch.no_grad():
        model(torch.tensor([prefix]), **{key: cache})
        buffers = build_buffers(tree, 8, len(prefix))
        mask = full_attention_mask(buffers.tree_attn_mask, len(prefix), torch.float32)
        model(buffers.input_ids, position_ids=buffers.position_ids, attention_mask=mask, **{key: cache})
        accepted = tree.path_to(4)  # nodes 0, 2, 4
        kvcache.compact(cache, len(prefix), (0, *(n + 1 for n in accepted)))
        committed = prefix + [8] + [tree.token_ids[n] for n in accepted]
        assert cache.get_seq_length() == len(committed)
        reference = kvcache.new_cache(model)
        model(torch.tensor([committed]), **{key: reference})
        for ours, theirs in zip(cache.layers, reference.layers):
            assert torch.allclose(ours.keys, theirs.keys, atol=1e-5)
            assert torch.allclose(ours.values, theirs.values, atol=1e-5)
        # and decoding continues exactly as from a fresh prefill
        nxt = torch.tensor([[9]])
        pos = torch.tensor([[len(committed)]])
        a = model(nxt, position_ids=pos, **{key: cache}).logits
        b = model(nxt, position_ids=pos, **{key: reference}).logits
        assert torch.allclose(a, b, atol=1e-5)
