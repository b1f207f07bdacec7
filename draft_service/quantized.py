"""Quantized weights for the lean draft forward (``draft_service/lean.py``) on a CPU: int8 and int4.

A one-token draft step reads every weight once, so on a CPU it is paced by the bytes it reads: float16 2 bytes a
weight, int8 1, int4 in groups of 32 0.625 (with each group's bfloat16 scale and zero). The draft's tokens are
proposals the float32 target verifies exactly, so quantizing the draft changes how often a draft token is
accepted (measured by ``bench/draft_dtypes.py``), never the output.

- ``Int8Weight``: one scale per output row (symmetric), PyTorch's weight-only int8 matmul.
- ``Int4Weight``: groups of ``INT4_GROUP`` weights along a row, each with its own scale and zero (asymmetric,
  round to nearest), PyTorch's CPU int4 matmul (where its kernel runs, ``draft_service/int4_kernel.py``'s
  ``PackedInt4Weight`` holds the same levels instead). Groups of 64 lost 13% of the greedy agreement on SmolLM2
  (86.9% against 99.8%, 8 prompts x 64 tokens); groups of 32 lost almost nothing in the layers.
- ``RescoredHead``: an LM head is where 4 bits hurt most (SmolLM2, int4 layers and head: 94.1% agreement with
  the float32 target), because the argmax over 49,152 logits turns on small differences. So the int4 head only
  ranks: the ``RESCORE_TOP`` best ids of each row are scored again exactly, against the float32 rows (for tied
  embeddings, the embedding table the draft holds anyway), and those exact logits replace the estimates (99.5%).
  The other logits stay estimates; a draft's probabilities are its own (it samples from what it reports).

Measured (``python bench/draft_dtypes.py --repeats 15 --tokens 96 --every 1``: 1 thread, SmolLM2, a step on a
200-token cache; agreement teacher-forced over the float32 target's 96-token greedy answers to the 16 bench prompts),
an AVX-512 AMD EPYC, 2026-12-01 (``bench/results/draft_dtypes_avx512/``): float32 56.2 ms / 100%, float16 24.1 ms /
99.9%, bfloat16 46.4 ms / 99.3%, int8 27.1 ms / 97.6%, int4 17.0 ms / 99.4%. (A probe the same day: int4 with the
head's int4 logits as they are 15.1 ms / 94.1%, rescoring the best 4 ids 99.3%, the best 16 99.5%.) For prompts int4
does not pay (a 256-token prompt 766 ms against bfloat16's 390 ms): the many-token candidates stay float.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4 = torch.uint4  # the dtype that names int4 draft weights (4-bit values with a zero point per group)
INT4_GROUP = 32  # weights sharing one int4 scale and zero, along a row
RESCORE_TOP = 16  # ids per row whose logits an int4 head scores again exactly


def int8_available(device: torch.device | str = "cpu") -> bool:
    """Whether int8 weights (``Int8Weight``) run here: PyTorch's weight-only int8 matmul, on a CPU."""
    return torch.device(device).type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")


def int4_available(device: torch.device | str = "cpu") -> bool:
    """Whether int4 weights (``Int4Weight``) run here: PyTorch's CPU int4 matmul, on a CPU."""
    return (torch.device(device).type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
            and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"))


def int4_fits(model) -> bool:
    """Whether every weight a lean copy of ``model`` holds packs into int4 groups: rows a multiple of INT4_GROUP
    long, and a multiple of 16 rows (PyTorch's packed layout)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, inner, heads = config.hidden_size, config.intermediate_size, config.num_attention_heads * head_dim
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    shapes = ((qkv, hidden), (hidden, heads), (2 * inner, hidden), (hidden, inner), (config.vocab_size, hidden))
    return all(rows % 16 == 0 and cols % INT4_GROUP == 0 for rows, cols in shapes)


@dataclass(frozen=True)
class Int8Weight:
    """A linear's weight as int8 with one scale per output row (symmetric): weight ~ values * scales[:, None].

    ``python bench/draft_dtypes.py`` on a Sapphire Rapids CPU (1 thread, SmolLM2, a step on a 200-token cache):
    float32 51 ms, float16 54, bfloat16 50, int8 33 ms; greedy agreement with the float32 target (teacher-forced,
    8 prompts x 64 tokens) float16 99.8%, bfloat16 98.4%, int8 97.7%. Slower than float16 on the AVX-512 EPYC
    (27.1 vs 24.1 ms)."""

    values: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N] bfloat16

    @staticmethod
    def of(weight: torch.Tensor) -> "Int8Weight":
        weight = weight.float()  # [N, K]
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [N]
        values = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()  # [N, K]
        return Int8Weight(values, scales.to(torch.bfloat16))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [Q, K] -> [Q, N] in bfloat16."""
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.values, self.scales)


def int4_levels(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] weights in groups of ``group`` along a row -> (levels [N, K/G, G] uint8 in 0..15, scale [N, K/G, 1], low
    [N, K/G, 1]), float32: weight ~ low + levels * scale (round to nearest, the group's min and max the levels 0 and
    15)."""
    weight = weight.float()  # [N, K]
    rows, cols = weight.shape
    grouped = weight.view(rows, cols // group, group)  # [N, K/G, G]
    low = grouped.amin(dim=-1, keepdim=True)  # [N, K/G, 1]
    scale = ((grouped.amax(dim=-1, keepdim=True) - low) / 15).clamp(min=1e-12)  # [N, K/G, 1]
    levels = torch.round((grouped - low) / scale).clamp(0, 15).to(torch.uint8)  # [N, K/G, G]
    return levels, scale, low


@dataclass(frozen=True)
class Int4Weight:
    """A linear's weight in int4 groups: weight[n, g*G:(g+1)*G] ~ values * scale[g, n] + low[g, n], values in 0..15
    (G = INT4_GROUP; round to nearest, the group's min and max spanning the 16 levels)."""

    packed: torch.Tensor  # PyTorch's packed int4 layout of the [N, K] values (uint8)
    scales_and_zeros: torch.Tensor  # [K / G, N, 2] bfloat16: each group's scale, and its value at level 8
    group: int

    @staticmethod
    def of(weight: torch.Tensor, group: int = INT4_GROUP) -> "Int4Weight":
        levels, scale, low = int4_levels(weight, group)  # [N, K/G, G], [N, K/G, 1], [N, K/G, 1]
        values = levels.to(torch.int32).view(weight.shape)  # [N, K]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 2)
        # the kernel computes (value - 8) * scale + zero: zero is the group's value at level 8
        zeros = low + 8 * scale  # [N, K/G, 1]
        scales_and_zeros = torch.stack([scale[..., 0].t(), zeros[..., 0].t()], dim=-1)  # [K/G, N, 2]
        return Int4Weight(packed, scales_and_zeros.to(torch.bfloat16).contiguous(), group)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [Q, K] -> [Q, N] in bfloat16."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, self.group,
                                                          self.scales_and_zeros)


@dataclass(frozen=True)
class RescoredHead:
    """An LM head that ranks with int4 weights and scores its best ``top`` ids per row exactly."""

    approx: Int4Weight
    exact: torch.Tensor  # [V, H] the head's weights in float32 (tied: the embedding table itself)
    top: int = RESCORE_TOP

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [Q, H] float32 -> [Q, V] float32 logits: exact for each row's ``top`` best ids, estimates elsewhere."""
        logits = self.approx.matmul(x).float()  # [Q, V]
        best = logits.topk(min(self.top, logits.shape[-1]), dim=-1).indices  # [Q, top]
        exact = torch.einsum("qth,qh->qt", self.exact[best], x.float())  # [Q, top]
        return logits.scatter_(1, best, exact)
