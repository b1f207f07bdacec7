"""Pure pieces of batched verification: rows, how they are packed into one forward, the batch tensors.

A *row* is one session's block of new tokens on top of its cached tokens: a Verify's root + tree
nodes, or a chunk of a Prefill. All rows of a tick go through one forward *packed*: their tokens
side by side in a single ``[1, T]`` sequence, so every linear layer and the LM head see exactly the
``T`` real tokens and no padding (a 3-token tree beside a 128-token prefill chunk costs 131 tokens, not
2 x 128). Only attention is per row: rows of similar length form an *attention group*, padded to the
group's longest row, whose 4D mask lets row b's query i see the row's own cached prefix
``[0, start_b)`` and the block keys its ``block_mask`` allows (tree ancestors, or causal for a prefill
chunk), nothing of any other row, and no padding.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from specsplit.tree import TokenTree, tree_attn_mask

ATTENTION_GROUP_OVERHEAD = 8  # an extra SDPA call per layer costs about as much as this many padded queries (CPU)
GPU_ATTENTION_GROUP_OVERHEAD = 4096  # a GPU pads for free next to ~6 more kernel launches a layer: one group


def group_overhead_for(device: torch.device | str, configured: int = 0) -> int:
    """The attention-group overhead a packed forward on ``device`` plans with (``configured`` if set)."""
    if configured > 0:
        return configured
    return ATTENTION_GROUP_OVERHEAD if torch.device(device).type == "cpu" else GPU_ATTENTION_GROUP_OVERHEAD


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
class AttentionGroup:
    """Rows whose attention runs as one padded SDPA call over their slots."""

    rows: tuple[int, ...]  # [G] batch rows in the group
    slots: torch.Tensor  # [G] their KV slots
    kv_length: int  # S_g: keys each row attends over (its prefix, its block, padding)
    attention_mask: torch.Tensor  # [G, 1, Q_g, S_g] additive: 0 where allowed, dtype min elsewhere
    query_index: torch.Tensor  # [G, Q_g] packed index of row g's query i; T (a zero query) for padding
    out_rows: torch.Tensor  # [T_g] for each packed token of the group (in packed order): its row in the group
    out_offsets: torch.Tensor  # [T_g] and its offset in that row
    token_index: torch.Tensor  # [T_g] the packed indices of the group's tokens
    first_slot: int | None = None  # s0 when the slots are s0, s0 + 1, ...: the group's K/V are a view, no copy
    dense: tuple[int, int] | None = None  # (first, last + 1) packed index when the group's rows are equally
    #                                       long and packed side by side: its queries are a view, no gather


@dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor  # [1, T] every row's tokens, row after row
    position_ids: torch.Tensor  # [1, T] start + depth (the token's position in its sequence, for RoPE)
    token_slots: torch.Tensor  # [T] the slot each token's K/V go to
    token_positions: torch.Tensor  # [T] and where in that slot: start + its index in the row (the block
    #                                order the masks refer to; siblings share a depth, never a cache position)
    row_offsets: tuple[int, ...]  # [B + 1] row b's tokens are packed [row_offsets[b], row_offsets[b + 1])
    groups: tuple[AttentionGroup, ...]
    max_slot: int  # the cache must hold slots 0..max_slot
    kv_length: int  # and this many positions (the longest group's S_g)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def row_offsets(rows: list[Row]) -> list[int]:
    """[B + 1]: row b's tokens are packed at [offsets[b], offsets[b + 1])."""
    return [0, *itertools.accumulate(len(row) for row in rows)]


def pack_rows(rows: list[Row], dtype: torch.dtype, device: torch.device | str = "cpu",
              group_overhead: int = ATTENTION_GROUP_OVERHEAD) -> PackedBatch:
    """The packed forward's tensors: tokens side by side, attention grouped by row length."""
    offsets = row_offsets(rows)
    total = offsets[-1]
    input_ids = torch.tensor([t for r in rows for t in r.input_ids], dtype=torch.long)[None]  # [1, T]
    positions = torch.tensor([r.start + d for r in rows for d in r.depths], dtype=torch.long)  # [T]
    cache_positions = torch.tensor([r.start + i for r in rows for i in range(len(r))], dtype=torch.long)  # [T]
    token_slots = torch.tensor([r.slot for r in rows for _ in r.input_ids], dtype=torch.long)  # [T]
    groups = tuple(_attention_group(rows, members, offsets, total, dtype, device)
                   for members in plan_groups([len(r) for r in rows], group_overhead))
    return PackedBatch(input_ids.to(device), positions[None].to(device), token_slots.to(device),
                       cache_positions.to(device), tuple(offsets), groups, max(r.slot for r in rows),
                       max(g.kv_length for g in groups))


def _attention_group(rows: list[Row], members: list[int], offsets: list[int], total: int, dtype: torch.dtype,
                     device) -> AttentionGroup:
    members = sorted(members, key=lambda b: (rows[b].slot, b))  # slot order: contiguous slots are a view
    q_len = max(len(rows[b]) for b in members)
    kv_len = max(rows[b].start for b in members) + q_len  # S_g
    mask = attention_mask([rows[b] for b in members], q_len, kv_len, dtype)  # [G, 1, Q_g, S_g]
    query = torch.arange(q_len)  # [Q_g]
    real = query < torch.tensor([len(rows[b]) for b in members])[:, None]  # [G, Q_g] the rows' own queries
    first = torch.tensor([offsets[b] for b in members])[:, None]  # [G, 1]
    query_index = torch.where(real, first + query, total)  # [G, Q_g] packed index; T (a zero query) for padding
    out_rows = torch.tensor([g for g, b in enumerate(members) for _ in range(len(rows[b]))], dtype=torch.long)
    out_offsets = torch.tensor([i for b in members for i in range(len(rows[b]))], dtype=torch.long)
    token_index = torch.tensor([offsets[b] + i for b in members for i in range(len(rows[b]))], dtype=torch.long)
    slots = [rows[b].slot for b in members]
    first_slot = slots[0] if slots == list(range(slots[0], slots[0] + len(slots))) else None
    side_by_side = members == list(range(members[0], members[-1] + 1))
    dense = (offsets[members[0]], offsets[members[-1] + 1]) if side_by_side and all(
        len(rows[b]) == q_len for b in members) else None
    return AttentionGroup(tuple(members), torch.tensor(slots, dtype=torch.long, device=device), kv_len, mask.to(device),
                          query_index.to(device), out_rows.to(device), out_offsets.to(device), token_index.to(device),
                          first_slot, dense)


def attention_mask(rows: list[Row], q_len: int, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """[G, 1, Q, S] additive mask (0 where allowed, dtype min elsewhere) of rows padded to ``q_len`` queries over
    ``kv_len`` keys: row g's query i sees the row's cached prefix ``[0, start)`` and the block keys its
    ``block_mask`` allows; a padding query (i >= len(row)) sees only its own key, ``start + i`` (finite, never
    read). Built for all rows at once (a tick's host work grows with its rows; only the block masks go row by
    row)."""
    starts = torch.tensor([row.start for row in rows])[:, None, None]  # [G, 1, 1]
    query = torch.arange(q_len)  # [Q]
    key = torch.arange(kv_len)  # [S]
    real = query < torch.tensor([len(row) for row in rows])[:, None]  # [G, Q] the row's own queries
    allowed = (key < starts) & real[:, :, None]  # [G, Q, S]: each real query sees its session's cached prefix
    allowed |= ~real[:, :, None] & (key == starts + query[:, None])  # a padding query: only its own key
    for g, row in enumerate(rows):
        n = len(row)
        allowed[g, :n, row.start:row.start + n] = row.block_mask  # its tree ancestors (causal for a prompt chunk)
    zero = torch.zeros((), dtype=dtype)
    neg = torch.tensor(torch.finfo(dtype).min, dtype=dtype)
    return torch.where(allowed, zero, neg)[:, None]  # [G, 1, Q, S]


def plan_groups(lengths: list[int], overhead_tokens: int) -> list[list[int]]:
    """Split rows into padded groups minimising total cost, a group costing ``overhead + rows * longest``.

    Padding makes every row of a group as long as its longest; each group's fixed cost (one more call)
    makes many groups dear. Rows sorted by length, the best split is into contiguous runs: a small
    dynamic programme. Returns row indices per group, the group of the shortest rows first.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cheapest cost of the first j rows (longest first)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # rows i..j-1 in one group; its longest is order[i]
            cost = best[i] + overhead_tokens + (j - i) * lengths[order[i]]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups


def cost_shares(lengths: list[int], overhead_tokens: int, forward_ms: float) -> list[float]:
    """Each row's share of a forward: the fixed cost split equally, the rest by tokens.

    This is what a row really costs the verifier: with B rows the fixed cost is amortised B ways, so a
    drafted token is dearer relative to a round; a controller that maximises tokens per share of the
    verifier drafts less when the verifier is busy (and the shares of all rows add up to the forward).
    """
    weights = [overhead_tokens / len(lengths) + n for n in lengths]
    total = sum(weights)
    return [forward_ms * w / total for w in weights]
