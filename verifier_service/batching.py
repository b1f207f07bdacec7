"""Pure pieces of batched verification: rows, how to split them into forwards, the batch tensors.

A *row* is one session's block of new tokens on top of its cached tokens: a Verify's root + tree
nodes, or a chunk of a Prefill. Rows of one forward are right-padded to the longest; the 4D mask lets
row b's query i see the row's own cached prefix ``[0, start_b)`` and the block keys its ``block_mask``
allows (tree ancestors, or causal for a prefill chunk), nothing of any other row, and no padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsplit.tree import TokenTree, tree_attn_mask


@dataclass(frozen=True)
class Row:
    slot: int  # the session's KV slot
    start: int  # tokens cached in the slot; the block's K/V go to [start, start + len)
    input_ids: tuple[int, ...]  # [Q_b] root + tree nodes, or a prompt chunk
    depths: tuple[int, ...]  # [Q_b] position of each token relative to start
    block_mask: torch.Tensor  # [Q_b, Q_b] bool, query i may attend block key j

    def __len__(self) -> int:
        return len(self.input_ids)


def verify_row(slot: int, start: int, root_token: int, tree: TokenTree) -> Row:
    """Root (the pending token) + tree nodes; positions are start + depth (root depth 0)."""
    return Row(slot, start, (root_token, *tree.token_ids), (0, *tree.depths), tree_attn_mask(tree))


def prefill_row(slot: int, start: int, token_ids: list[int]) -> Row:
    n = len(token_ids)
    return Row(slot, start, tuple(token_ids), tuple(range(n)), torch.ones(n, n, dtype=torch.bool).tril())


@dataclass(frozen=True)
class BatchInputs:
    input_ids: torch.Tensor  # [B, Q] right-padded with token 0
    position_ids: torch.Tensor  # [B, Q] start + depth; padding at start
    attention_mask: torch.Tensor  # [B, 1, Q, S] additive: 0 where allowed, dtype min elsewhere
    slots: torch.Tensor  # [B]
    starts: torch.Tensor  # [B]


def batch_inputs(rows: list[Row], dtype: torch.dtype, device: torch.device | str = "cpu") -> BatchInputs:
    q_len = max(len(r) for r in rows)
    kv_len = max(r.start for r in rows) + q_len  # S
    input_ids = torch.zeros(len(rows), q_len, dtype=torch.long)  # [B, Q]
    starts = torch.tensor([r.start for r in rows], dtype=torch.long)  # [B]
    position_ids = starts[:, None].repeat(1, q_len)  # [B, Q]
    allowed = torch.zeros(len(rows), q_len, kv_len, dtype=torch.bool)  # [B, Q, S]
    for b, row in enumerate(rows):
        n = len(row)
        input_ids[b, :n] = torch.tensor(row.input_ids)
        position_ids[b, :n] += torch.tensor(row.depths)
        allowed[b, :n, :row.start] = True  # the session's own cached prefix
        allowed[b, :n, row.start:row.start + n] = row.block_mask
        padding = torch.arange(n, q_len)  # a padding query sees only its own (padding) key: finite, never read
        allowed[b, padding, row.start + padding] = True
    zero = torch.zeros((), dtype=dtype)
    neg = torch.tensor(torch.finfo(dtype).min, dtype=dtype)
    mask = torch.where(allowed, zero, neg)[:, None]  # [B, 1, Q, S]
    return BatchInputs(input_ids.to(device), position_ids.to(device), mask.to(device),
                       torch.tensor([r.slot for r in rows], dtype=torch.long, device=device), starts.to(device))


def plan_forwards(lengths: list[int], overhead_tokens: int) -> list[list[int]]:
    """Split rows into forwards minimising total cost, a forward costing ``overhead + rows * longest``.

    Padding makes every row of a forward as long as its longest; a forward's fixed cost (reading the
    weights) makes many forwards dear. Rows sorted by length, the best split is into contiguous runs:
    a small dynamic programme. Returns row indices per forward, the forward of the shortest rows first:
    those are Verify rows, answered while the longer forwards (prefill chunks, big trees) still run.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cheapest cost of the first j rows (longest first)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # rows i..j-1 in one forward; its longest is order[i]
            cost = best[i] + overhead_tokens + (j - i) * lengths[order[i]]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups


def cost_shares(lengths: list[int], overhead_tokens: int, forward_ms: float) -> list[float]:
    """Each row's share of a forward: the fixed cost split equally, the rest by tokens (padding too).

    This is what a row really costs the verifier: with B rows the fixed cost is amortised B ways, so a
    drafted token is dearer relative to a round; a controller that maximises tokens per share of the
    verifier drafts less when the verifier is busy (and the shares of all rows add up to the forward).
    """
    weights = [overhead_tokens / len(lengths) + n for n in lengths]
    total = sum(weights)
    return [forward_ms * w / total for w in weights]
