"""The verifier's packed forward of a Llama-architecture target without Hugging Face's module machinery.

A forward of a small target on a GPU is paced by the host issuing operations one by one, not by the GPU
(SmolLM2-135M on an H200: ~20 ms for a packed forward of one row, HF's own decode step 16-19 ms, whatever the
rows). Each of the model's ~300 module calls a forward costs Python time on top of its kernels (hooks, keyword
plumbing, output records), and the packed cache goes through HF's ``Cache`` interface in every layer. This
forward calls the same weights with the same operations in the same order -- embedding, RoPE, RMSNorm, the
seven projections, SiLU, the slot writes (``slots.write_kv``) and grouped attention (``slots.attend_groups``) --
so its logits and hidden states are *bit-identical* to ``slots.packed_forward`` of the model itself
(``tests/parity/test_slot_cache.py`` checks with ``torch.equal``): everything the verifier's losslessness rests on
is unchanged; only the host work around the kernels is less. The weights are the model's own tensors (no
copies), in its dtype and on its device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specsplit.kvcache import cache_kwarg
from specsplit.llama import rms_norm, supports
from verifier_service.batching import PackedBatch
from verifier_service.slots import (FoldedMasks, SlotStore, attend_groups, head_rows, packed_forward, use_packed_attention,
                                    write_kv)


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor  # [H]
    input_eps: float
    q: torch.Tensor  # [Hq D, H]
    k: torch.Tensor  # [Hkv D, H]
    v: torch.Tensor  # [Hkv D, H]
    o: torch.Tensor  # [H, Hq D]
    post_norm: torch.Tensor  # [H]
    post_eps: float
    gate: torch.Tensor  # [I, H]
    up: torch.Tensor  # [I, H]
    down: torch.Tensor  # [H, I]


class LeanPackedLlama:
    """``LeanPackedLlama(model)(store, packed, keep, hidden)``: what ``slots.packed_forward`` returns, computed
    from the same weights with less host work per layer."""

    def __init__(self, model: torch.nn.Module):
        if not supports(model):
            raise ValueError(f"the lean packed forward runs Llama-architecture models, not {type(model).__name__}")
        inner = model.model
        attention = inner.layers[0].self_attn
        self.head_dim = int(attention.head_dim)
        self.scaling = float(attention.scaling)
        self.rotary = inner.rotary_emb  # the model's own RoPE: cos and sin exactly as its forward makes them
        self.embed = inner.embed_tokens.weight.detach()  # [V, H]
        self.layers = [
            _Layer(layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon,
                   layer.self_attn.q_proj.weight.detach(), layer.self_attn.k_proj.weight.detach(),
                   layer.self_attn.v_proj.weight.detach(), layer.self_attn.o_proj.weight.detach(),
                   layer.post_attention_layernorm.weight.detach(), layer.post_attention_layernorm.variance_epsilon,
                   layer.mlp.gate_proj.weight.detach(), layer.mlp.up_proj.weight.detach(),
                   layer.mlp.down_proj.weight.detach())
            for layer in inner.layers[:model.config.num_hidden_layers]
        ]
        self.norm, self.norm_eps = inner.norm.weight.detach(), inner.norm.variance_epsilon  # [H]
        self.lm_head = model.lm_head.weight.detach()  # [V, H]

    def __call__(self, store: SlotStore, packed: PackedBatch, keep: list[int] | None = None,
                 hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One packed forward over the slots (every token's K/V written into its slot). Returns [K, V] logits at
        the packed indices ``keep`` (all T when None; only the last token's when empty) and, if ``hidden``, the
        final hidden states after the final norm [T, H]."""
        total = packed.num_tokens
        x = F.embedding(packed.input_ids[0], self.embed)  # [T, H]
        cos, sin = self.rotary(x[None], packed.position_ids)  # [1, T, D] each
        cos = cos[0].unsqueeze(1)  # [T, 1, D]
        # HF rotates as x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1). Here the sign rides on sin:
        # roll(x) * (-sin1, sin2) = (x2 * -sin1, x1 * sin2), exactly the same products, in one operation less.
        half = self.head_dim // 2
        sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1).unsqueeze(1)  # [T, 1, D]
        masks = FoldedMasks(packed)
        split = (total, -1, self.head_dim)
        for index, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, layer.input_eps)  # [T, H]
            q = F.linear(h, layer.q).view(split)  # [T, Hq, D]
            k = F.linear(h, layer.k).view(split)  # [T, Hkv, D]
            q = (q * cos) + (q.roll(half, -1) * sin)  # [T, Hq, D]
            k = (k * cos) + (k.roll(half, -1) * sin)  # [T, Hkv, D]
            keys, values = write_kv(store, index, packed, k, F.linear(h, layer.v).view(split))  # [slots, Hkv, cap, D]
            attended = attend_groups(q, keys, values, masks, self.scaling)  # [T, Hq, D]
            x = x + F.linear(attended.reshape(total, -1), layer.o)  # [T, H]
            h = rms_norm(x, layer.post_norm, layer.post_eps)  # [T, H]
            x = x + F.linear(F.silu(F.linear(h, layer.gate)) * F.linear(h, layer.up), layer.down)  # [T, H]
        x = rms_norm(x, self.norm, self.norm_eps)  # [T, H]
        rows, wanted = head_rows(keep, total)
        if keep is None and len(rows) == total:  # every token, in order: no gather (none in a CUDA graph either)
            kept = x  # [T, H]
        else:
            kept = x[torch.tensor(rows, device=x.device)] if rows else x[-1:]  # [K', H] (K' = max(K, 4) if K > 1)
        return F.linear(kept, self.lm_head)[:wanted], (x if hidden else None)  # [K, V], [T, H]


def packed_forward_for(model: torch.nn.Module, lean: bool = True):
    """The packed forward a verifier runs for ``model``, ``(store, packed, keep=, hidden=) -> ([K, V] logits,
    [T, H] final hidden states | None)``: the lean one where it runs the model and ``lean``, else the model's own
    (set up here for packed attention; its other forwards stay plain SDPA)."""
    use_packed_attention(model)
    if lean and supports(model):
        return LeanPackedLlama(model)
    return functools.partial(packed_forward, model, cache_arg=cache_kwarg(model))
