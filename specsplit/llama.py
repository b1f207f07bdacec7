"""Llama-architecture pieces the lean forwards share (the draft's ``draft_service.lean``, the verifier's
``verifier_service.lean``): which models they can run, and two steps written with Hugging Face's operations in
Hugging Face's order, so a forward built from them gives bit-identical numbers."""

from __future__ import annotations

import torch


def supports(model) -> bool:
    """Whether ``model`` is a Llama-architecture causal LM the lean forwards reproduce (no biases, SiLU MLP)."""
    config = getattr(model, "config", None)
    return (
        config is not None and getattr(config, "model_type", "") == "llama"
        and not getattr(config, "attention_bias", False) and not getattr(config, "mlp_bias", False)
        and getattr(config, "hidden_act", "") == "silu" and hasattr(model, "model") and hasattr(model, "lm_head")
    )


def kv_shape(config) -> tuple[int, int]:
    """(H_kv, D): a Llama-architecture config's key/value heads and head size (hidden / heads when it names none)."""
    heads = int(config.num_attention_heads)
    return (int(getattr(config, "num_key_value_heads", None) or heads),
            int(getattr(config, "head_dim", None) or config.hidden_size // heads))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., H] -> [..., H]: LlamaRMSNorm (statistics in float32, then the weight in x's dtype)."""
    dtype = x.dtype
    h = x if dtype == torch.float32 else x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (h if dtype == torch.float32 else h.to(dtype))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: (-x2, x1) of the halves (the Llama RoPE convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
