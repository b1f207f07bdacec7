"""The op-bound proxy target of the forward and scheduling benches (``forward_cost.py``, ``turnaround.py``)."""

from __future__ import annotations


def proxy_model():
    """SmolLM2's depth and heads (30 layers, 9 query / 3 K/V heads) at hidden 72 (head size 8), random weights:
    every operation is tiny, so a forward costs what the host spends issuing operations -- what paces SmolLM2 on
    a GPU -- on any CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=72, intermediate_size=144, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()
