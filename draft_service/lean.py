"""A lean forward of a Llama-architecture model for the draft's small forwards (one step, one tree depth).

A Hugging Face forward of SmolLM2 on one CPU thread spends about half its time outside the weight matmuls
(measured on the AVX2-only EPYC, bfloat16: 28.7 ms of matrix-vector products + 7.2 ms LM head in a 68 ms
step): per-module dispatch, a ``torch.cat`` that copies every layer's whole KV cache each step (allocations
past glibc's mmap threshold fault their pages in again each time), and the CPU flash-attention kernel,
which costs more in bfloat16 for one query than the step's matmuls of that layer. This forward keeps the
same math with less around it:

- q/k/v and gate/up projections fused into one matmul each (4 weight matmuls a layer instead of 7);
- a preallocated KV cache (``specsplit.kvcache.LeanCache``): new keys and values are written in place;
- attention of a few queries as two small matmuls over grouped heads, in float32; longer forwards (a prompt)
  through ``scaled_dot_product_attention``.

Weights may be kept in a 16-bit dtype (the matmuls then run in it), as int8 or as int4 (``draft_service/quantized.py``:
the matmuls fed bfloat16 activations; int4 through ``draft_service/int4_kernel.py``'s kernel where that runs) while
activations, attention and the cache stay float32, so a step model and a many-token model of other weight dtypes share
one cache with no casts. It is a draft: its
tokens are proposals the float32 target verifies exactly, so it changes the chance a draft token is accepted
(measured by the benches), never the output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draft_service import int4_kernel
from draft_service.quantized import INT4, Int4Weight, Int8Weight, RescoredHead, int4_available, int4_fits, int8_available
from specsplit.kvcache import LeanCache
from specsplit.llama import kv_shape, rms_norm, rotate_half, supports

FEW_QUERIES = 16  # forwards of at most this many tokens attend with plain matmuls; longer ones through SDPA


class ForwardInterrupted(Exception):
    """A lean forward's ``stop()`` said its result is no longer wanted: it ended between two layers, the cache as
    before it (rows past ``LeanCache.length`` are free to overwrite)."""


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H] q, k and v projections stacked (each weight here may be quantized)
    o: torch.Tensor  # [H, Hq D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H] gate and up projections stacked
    down: torch.Tensor  # [H, I]


@dataclass
class LeanOutput:
    logits: torch.Tensor  # [1, Q', V]


class LeanLlama:
    """Called like a Hugging Face causal LM by the draft (``input_ids``, ``position_ids``, a 4-D additive
    ``attention_mask``, ``cache``, ``logits_to_keep``); ``new_cache()`` makes the cache it writes."""

    def __init__(self, model, weight_dtype: torch.dtype | None = None, compute_dtype: torch.dtype | None = None):
        """weight_dtype: the weights' dtype (torch.int8: ``Int8Weight``; ``quantized.INT4``: ``Int4Weight`` with a
        ``RescoredHead``; both CPU only); default the model's."""
        if not supports(model):
            raise ValueError(f"the lean forward supports Llama-architecture models, not {type(model).__name__}")
        if weight_dtype == torch.int8 and not int8_available(model.device):
            raise ValueError(f"int8 draft weights run on a CPU with PyTorch's weight-only int8 matmul, not on "
                             f"{model.device} with torch {torch.__version__}; use float16 or bfloat16")
        if weight_dtype == INT4 and not (int4_available(model.device) and int4_fits(model)):
            raise ValueError(f"int4 draft weights run on a CPU with PyTorch's int4 matmul and rows in groups of 32, "
                             f"not {model.device} with torch {torch.__version__} and this model; use float16 or bfloat16")
        config = model.config
        self.config = config
        self.device = model.device
        self.weight_dtype = weight_dtype or model.dtype
        # float32 activations on a CPU (16-bit elementwise ops are slower there); the weights' dtype on a GPU.
        self.dtype = compute_dtype or (torch.float32 if self.device.type == "cpu" else self.weight_dtype)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads, self.head_dim = kv_shape(config)
        self.eps = config.rms_norm_eps
        self._rotary = model.model.rotary_emb

        def weight(*linears) -> torch.Tensor | Int8Weight | Int4Weight | int4_kernel.PackedInt4Weight:
            stacked = torch.cat([lin.weight.detach() for lin in linears])  # [N, K]
            if self.weight_dtype == torch.int8:
                return Int8Weight.of(stacked)
            if self.weight_dtype == INT4:
                native = int4_kernel.available(self.device) and int4_kernel.fits(*stacked.shape)
                return int4_kernel.PackedInt4Weight.of(stacked) if native else Int4Weight.of(stacked)
            return stacked.to(self.weight_dtype).contiguous()

        def norm(module) -> torch.Tensor:
            return module.weight.detach().to(self.dtype).contiguous()

        self.embed = model.model.embed_tokens.weight.detach().to(self.dtype)  # [V, H]
        self.layers = [
            _Layer(norm(layer.input_layernorm),
                   weight(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                   weight(layer.self_attn.o_proj), norm(layer.post_attention_layernorm),
                   weight(layer.mlp.gate_proj, layer.mlp.up_proj), weight(layer.mlp.down_proj))
            for layer in model.model.layers
        ]
        self.norm = norm(model.model.norm)  # [H]
        self.head = weight(model.lm_head)  # [V, H]
        if self.weight_dtype == INT4:  # the int4 head only ranks; its best ids are scored against float32 rows
            head = model.lm_head.weight.detach()  # [V, H]
            tied = head.data_ptr() == model.model.embed_tokens.weight.data_ptr() and self.dtype == torch.float32
            self.head = RescoredHead(self.head, self.embed if tied else head.float().contiguous())

    def new_cache(self) -> LeanCache:
        return LeanCache(len(self.layers), self.num_kv_heads, self.head_dim, self.dtype, self.device)

    def __call__(self, *args, **kwargs) -> LeanOutput:
        return self.forward(*args, **kwargs)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache: LeanCache | None = None,
                logits_to_keep: int = 0, stop: Callable[[], bool] | None = None, **_ignored) -> LeanOutput:
        """input_ids: [1, Q]; position_ids: [1, Q] (default: right after the cache); attention_mask: [1, 1, Q, S]
        additive over the cache's S = past + Q rows (None: causal). Appends the Q new rows to ``cache``.
        stop(): asked before each layer; once true the forward raises ``ForwardInterrupted``, the cache unchanged (a
        draft forward whose tokens the verdict already made moot holds up the session's next round for nothing)."""
        if input_ids.shape[0] != 1:
            raise ValueError("the lean forward runs one sequence at a time")
        cache = cache if cache is not None else self.new_cache()
        num_new = input_ids.shape[1]
        past = cache.length
        total = past + num_new
        if position_ids is None:
            position_ids = torch.arange(past, total, device=self.device)[None]  # [1, Q]
        x = self.embed[input_ids[0]]  # [Q, H]
        cos, sin = self._rotary(x[None], position_ids)  # [1, Q, D] each
        cos, sin = cos[0, :, None].to(self.dtype), sin[0, :, None].to(self.dtype)  # [Q, 1, D]
        mask = self._mask(attention_mask, num_new, total)
        cache.reserve(total)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        for index, layer in enumerate(self.layers):
            if stop is not None and stop():
                raise ForwardInterrupted
            qkv = self._linear(rms_norm(x, layer.input_norm, self.eps), layer.qkv)  # [Q, (Hq + 2 Hkv) D]
            # q and k rotated together (one set of elementwise ops, not two: ~15 us a layer on one CPU thread)
            qk = qkv[:, :q_size + kv_size].view(num_new, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = qk * cos + rotate_half(qk) * sin  # [Q, Hq + Hkv, D]
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # [Q, Hq, D], [Q, Hkv, D]
            v = qkv[:, q_size + kv_size:].view(num_new, self.num_kv_heads, self.head_dim)  # [Q, Hkv, D]
            cache.keys[index, :, past:total] = k.transpose(0, 1)  # [Hkv, Q, D]
            cache.values[index, :, past:total] = v.transpose(0, 1)  # [Hkv, Q, D]
            attended = self._attend(q, cache.keys[index, :, :total], cache.values[index, :, :total], mask)  # [Q, Hq D]
            x = x + self._linear(attended, layer.o)  # [Q, H]
            gate, up = self._linear(rms_norm(x, layer.post_norm, self.eps), layer.gate_up).chunk(2, dim=-1)  # [Q, I] each
            x = x + self._linear(F.silu(gate) * up, layer.down)  # [Q, H]
        cache.length = total
        if logits_to_keep:
            x = x[-logits_to_keep:]  # [Q', H]
        logits = self._linear(rms_norm(x, self.norm, self.eps), self.head)  # [Q', V]
        return LeanOutput(logits[None])

    def _mask(self, attention_mask, num_new: int, total: int) -> torch.Tensor | None:
        """The additive mask as [Q, S] in the compute dtype; None for a single causal query (it sees all)."""
        if attention_mask is not None:
            return attention_mask[0, 0].to(self.dtype)  # [Q, S]
        if num_new == 1:
            return None
        past = total - num_new
        rows = torch.arange(num_new, device=self.device)[:, None]  # [Q, 1]
        cols = torch.arange(total, device=self.device)[None]  # [1, S]
        blocked = cols > past + rows  # [Q, S]
        return torch.zeros(blocked.shape, dtype=self.dtype, device=self.device).masked_fill_(
            blocked, torch.finfo(self.dtype).min)  # [Q, S]

    def _attend(self, q, keys, values, mask) -> torch.Tensor:
        """q: [Q, Hq, D]; keys, values: [Hkv, S, D]; mask: [Q, S] additive or None. Returns [Q, Hq D]."""
        num_new = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        if num_new > FEW_QUERIES:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, enable_gqa=True)  # [1, Hq, Q, D]
            return out[0].transpose(0, 1).reshape(num_new, -1)
        # head h reads kv head h // group: [Hkv, group * Q, D] rows ordered (group member, query)
        grouped = q.view(num_new, self.num_kv_heads, group, self.head_dim).permute(1, 2, 0, 3)
        grouped = grouped.reshape(self.num_kv_heads, group * num_new, self.head_dim)  # [Hkv, G Q, D]
        scores = torch.matmul(grouped, keys.transpose(1, 2)) * self.head_dim ** -0.5  # [Hkv, G Q, S]
        if mask is not None:
            scores = (scores.view(self.num_kv_heads, group, num_new, -1) + mask).view_as(scores)
        out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [Hkv, G Q, D]
        out = out.view(self.num_kv_heads, group, num_new, self.head_dim).permute(2, 0, 1, 3)  # [Q, Hkv, G, D]
        return out.reshape(num_new, -1)  # [Q, Hq D]

    def _linear(self, x: torch.Tensor, weight) -> torch.Tensor:
        """x: [Q, K] in the compute dtype, weight: [N, K] (a tensor or a quantized weight) -> [Q, N] in the compute
        dtype."""
        if not isinstance(weight, torch.Tensor):  # Int8Weight, Int4Weight, RescoredHead
            return weight.matmul(x).to(self.dtype)
        if weight.dtype == x.dtype:
            return F.linear(x, weight)
        return F.linear(x.to(weight.dtype), weight).to(self.dtype)

