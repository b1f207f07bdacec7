"""A slot-based KV cache: many sessions, one packed forward.

Every session owns a *slot*. Per layer, keys and values live in one preallocated tensor
``[num_slots, H_kv, capacity, D]``; a session's committed tokens sit at positions ``[0, length)`` of
its slot. A packed forward (``verifier_service.batching.PackedBatch``) runs all rows' tokens as one
``[1, T]`` sequence: each token's new K/V are written at its own (slot, position), and attention
(``packed_attention``, registered with HF as an attention implementation) runs per attention group
over the ``[G, H_kv, S, D]`` view of the group's slots, with a 4D mask that hides, per row, everything
that is neither its own committed prefix nor its tree ancestors. The linear layers never see padding.

After acceptance the accepted rows' K/V are moved to follow the prefix inside the slot (one gather per
layer): compaction, never a re-prefill. Storage grows lazily, slots in powers of two up to
``max_slots`` and capacity in steps of ``grow_tokens``, so idle headroom costs no memory.
"""

from __future__ import annotations

import heapq

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from specsplit.errors import ResourceExhausted
from verifier_service.batching import PackedBatch


class SlotStore:
    def __init__(self, max_slots: int, grow_tokens: int = 256, scratch: bool = False):
        """scratch: keep one more slot, ``self.scratch`` (= max_slots), that no session gets: padding rows of a
        fixed-shape forward (``verifier_service.graphs``) write there. Its storage then holds all slots at once
        (a captured forward must not see the storage move as sessions arrive)."""
        self.max_slots = max_slots
        self.grow_tokens = grow_tokens
        self.scratch = max_slots if scratch else None
        self.generation = 0  # counts the storage's reallocations: what a captured graph (graphs.py) was made against
        self.keys: list[torch.Tensor] = []  # per layer [slots_alloc, H_kv, capacity, D]
        self.values: list[torch.Tensor] = []  # per layer [slots_alloc, H_kv, capacity, D]
        self._free = list(range(max_slots))  # a heap: the lowest free slot first keeps batches contiguous

    def acquire(self) -> int:
        if not self._free:
            raise ResourceExhausted(f"all {self.max_slots} KV slots are in use")
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def layer(self, layer_idx: int, like: torch.Tensor, num_slots: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer storage holding at least ``num_slots`` slots of ``length`` positions (grown if needed).

        like: [T, H_kv, D] the layer's new keys (gives heads, head size, dtype, device on first use).
        """
        while len(self.keys) <= layer_idx:
            self.keys.append(like.new_zeros(0, like.shape[1], 0, like.shape[2]))
            self.values.append(like.new_zeros(0, like.shape[1], 0, like.shape[2]))
            self.generation += 1
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        have_slots, have_len = keys.shape[0], keys.shape[2]
        if num_slots > have_slots or length > have_len:
            new_slots = have_slots if num_slots <= have_slots else min(self.max_slots, max(num_slots, 2 * have_slots))
            new_slots = self.max_slots + 1 if self.scratch is not None else new_slots
            new_len = max(have_len, -(-length // self.grow_tokens) * self.grow_tokens)
            shape = (new_slots, keys.shape[1], new_len, keys.shape[3])
            grown_k, grown_v = keys.new_zeros(shape), values.new_zeros(shape)  # [slots', H_kv, capacity', D]
            grown_k[:have_slots, :, :have_len] = keys
            grown_v[:have_slots, :, :have_len] = values
            self.keys[layer_idx], self.values[layer_idx] = keys, values = grown_k, grown_v
            self.generation += 1
        return keys, values

    def compact_many(self, moves: list[tuple[int, int, tuple[int, ...]]]) -> None:
        """In each move's slot, move block rows ``rows_to_keep`` (offsets from ``keep_from``) to ``keep_from,
        keep_from + 1, ...``; a chain's accepted rows are already in place (0, 1, 2, ...) and do not move.
        moves: (slot, keep_from, rows_to_keep), one tick's sessions, each slot at most once: one gather and one
        scatter per layer and tensor for all of them, not one per session (kernel launches dominate on a GPU)."""
        moves = [m for m in moves if m[2] != tuple(range(len(m[2])))]
        if not moves or not self.keys:
            return
        slots, src, dst = torch.tensor([  # [3, M]: one copy to the device
            [slot for slot, _, rows in moves for _ in rows],
            [keep_from + r for _, keep_from, rows in moves for r in rows],
            [keep_from + i for _, keep_from, rows in moves for i in range(len(rows))],
        ], device=self.keys[0].device)
        for keys, values in zip(self.keys, self.values):
            for t in (keys, values):
                by_position = t.transpose(1, 2)  # [slots, capacity, H_kv, D] view
                by_position[slots, dst] = by_position[slots, src]  # [M, H_kv, D]; the gather copies before the write

    def read_session(self, slot: int, length: int, num_layers: int,
                     dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """CPU copies (in ``dtype``; default the cache's) of a slot's first ``length`` positions, per layer:
        ([H_kv, length, D] keys, values), or None per layer when nothing is cached. Model thread only."""
        if length == 0:
            return [None] * num_layers
        return [tuple(t[slot, :, :length].to(device="cpu", dtype=dtype or t.dtype, copy=True) for t in pair)
                for pair in zip(self.keys, self.values)]

    def write_session(self, slot: int, layers: list, dtype: torch.dtype, device: torch.device | str) -> None:
        """Put per-layer ([H_kv, L, D] keys, values) at positions ``[0, L)`` of ``slot`` (storage grown as
        needed; None: nothing for that layer). Model thread only."""
        for layer_idx, pair in enumerate(layers):
            if pair is None:
                continue
            k, v = (t.to(device=device, dtype=dtype) for t in pair)  # [H_kv, L, D]
            keys, values = self.layer(layer_idx, k.transpose(0, 1), slot + 1, k.shape[1])
            keys[slot, :, :k.shape[1]] = k
            values[slot, :, :v.shape[1]] = v

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        """Copy positions ``[0, length)`` of slot ``source`` to the same positions of ``slot``. Model thread only."""
        self.write_session(slot, [(k[source, :, :length], v[source, :, :length])  # [H_kv, L, D] each
                                  for k, v in zip(self.keys, self.values)], self.keys[0].dtype, self.keys[0].device)

    def read(self, layer_idx: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[H_kv, length, D] keys and values of one slot (for tests and debugging)."""
        return self.keys[layer_idx][slot, :, :length], self.values[layer_idx][slot, :, :length]


def write_kv(store: SlotStore, layer_idx: int, packed: PackedBatch, keys_new: torch.Tensor,
             values_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a packed forward's new K/V of one layer, each token's at its (slot, position); keys_new, values_new:
    [T, H_kv, D]. Returns the layer's whole storage [slots_alloc, H_kv, capacity, D] (grown if needed)."""
    keys, values = store.layer(layer_idx, keys_new, packed.max_slot + 1, packed.kv_length)
    slots, positions = packed.token_slots, packed.token_positions  # [T], [T]
    keys.transpose(1, 2)[slots, positions] = keys_new
    values.transpose(1, 2)[slots, positions] = values_new
    return keys, values


class _SlotLayer(CacheLayerMixin):
    """One layer's view of a packed batch: writes each token's K/V into its slot at its position."""

    is_sliding = False

    def __init__(self, batch: "SlotBatch", layer_idx: int):
        super().__init__()
        self.batch, self.layer_idx = batch, layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states: [1, H_kv, T, D] packed -> the layer's whole storage
        [slots_alloc, H_kv, capacity, D] (``packed_attention`` reads each group's slots from it)."""
        return write_kv(self.batch.store, self.layer_idx, self.batch.packed, key_states[0].transpose(0, 1),
                        value_states[0].transpose(0, 1))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.batch.packed.kv_length, 0

    def get_seq_length(self) -> int:
        return int(self.batch.packed.token_positions.max())

    def get_max_length(self) -> int:
        return -1


class SlotBatch(Cache):
    """The ``Cache`` handed to one packed forward (a thin view over the ``SlotStore``).

    The forward must also get ``specsplit_batch=<this>`` (it reaches ``packed_attention``), the packed
    position ids and any 4D mask (``PACKED_MASK``: the real masks are per attention group).
    """

    def __init__(self, store: SlotStore, packed: PackedBatch, num_layers: int):
        self.store = store
        self.packed = packed
        self.masks = FoldedMasks(packed)
        super().__init__(layers=[_SlotLayer(self, i) for i in range(num_layers)])


class FoldedMasks:
    """One packed forward's attention masks with the query heads that share a K/V head folded into the query
    rows, built at the first layer and reused by the others."""

    def __init__(self, packed: PackedBatch):
        self.packed = packed
        self._folded: dict[int, torch.Tensor] = {}

    def get(self, group: int, rep: int) -> torch.Tensor:
        """Group ``group``'s mask for ``rep`` query heads per K/V head: [G, 1, rep * Q_g, S_g] (row j * Q_g + i
        is query i of the j-th head)."""
        if group not in self._folded:
            mask = self.packed.groups[group].attention_mask  # [G, 1, Q_g, S_g]
            self._folded[group] = mask.repeat(1, 1, rep, 1) if rep > 1 else mask
        return self._folded[group]


def packed_forward(model: torch.nn.Module, store: SlotStore, packed: PackedBatch, cache_arg: str,
                   keep: list[int] | None = None, hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One packed forward of the model itself over the slots (``model`` set up by ``use_packed_attention``):
    every token's K/V go into its slot. Returns [K, V] logits at the packed indices ``keep`` (all T when None;
    only the last token's when empty) and, if ``hidden``, the final hidden states after the final norm [T, H].
    cache_arg: the forward's cache argument (``kvcache.cache_kwarg``). ``verifier_service.lean`` computes the
    same with less host work."""
    cache = SlotBatch(store, packed, model.config.num_hidden_layers)
    rows, wanted = head_rows(keep, packed.num_tokens)
    logits_to_keep = torch.tensor(rows, device=packed.input_ids.device) if rows else 1
    out = model(input_ids=packed.input_ids,  # [1, T]
                position_ids=packed.position_ids,  # [1, T]
                attention_mask=PACKED_MASK,  # the real masks are per attention group (packed.groups)
                use_cache=True, output_hidden_states=hidden, logits_to_keep=logits_to_keep,
                specsplit_batch=cache, **{cache_arg: cache})
    return out.logits[0, :wanted], (out.hidden_states[-1][0] if hidden else None)


HEAD_MIN_ROWS = 4  # a packed forward's LM head runs on at least this many rows, or on one (``head_rows``)


def head_rows(keep: list[int] | None, total: int) -> tuple[list[int], int]:
    """The packed indices a packed forward's LM head runs on, and how many of its first rows are wanted.

    keep: the indices whose logits are wanted (all ``total`` when None; only the last token's when empty:
    returned as ``[]``, one row). A float32 matmul of 2 or 3 rows runs on a CPU as that many matrix-vector
    products, each reading the whole weight, but 4 rows as one matrix product: SmolLM2's LM head ([49152, 576],
    1 thread, the AVX-512 EPYC) took 22.9 / 34.6 ms for 2 / 3 rows and 16.9 ms for 4. So 2 or 3 indices run as 4,
    the last repeated. A matrix product's rows do not depend on each other, so the wanted rows' logits are
    exactly what they are in any forward of 4 or more kept rows: a session's small tree gets the same logits
    alone as batched with others.
    """
    rows = list(range(total)) if keep is None else list(keep)
    wanted = len(rows) or 1
    if 1 < len(rows) < HEAD_MIN_ROWS:
        rows += rows[-1:] * (HEAD_MIN_ROWS - len(rows))
    return rows, wanted


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     specsplit_batch: SlotBatch | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """HF's attention interface: a packed forward's attention by groups (``attend_groups``); plain SDPA for any
    other forward of the model. Returns ([1, T, H, D], None), the layout HF's attention functions return."""
    if specsplit_batch is None:  # any other forward of the same model (HF generate, a plain prefill)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return attend_groups(query[0].transpose(0, 1), key, value, specsplit_batch.masks, scaling)[None], None


def attend_groups(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, masks: FoldedMasks,
                  scaling: float | None) -> torch.Tensor:
    """Attention of a packed forward's queries, one padded SDPA call per attention group.

    query: [T, H, D] packed; key, value: the layer's slot storage [slots_alloc, H_kv, capacity, D].
    Returns [T, H, D].
    """
    total, heads, head_dim = query.shape
    kv_heads = key.shape[1]
    rep = heads // kv_heads  # query heads per K/V head (GQA)
    groups = masks.packed.groups
    padded = None  # [T + 1, H, D] the queries and one zero query (T) for padding, built once if needed
    out = None  # [T, H, D], allocated once a second group needs it
    for i, group in enumerate(groups):
        s, size = group.kv_length, len(group.rows)
        if group.first_slot is not None:  # a view, no copy
            first = group.first_slot
            k, v = key[first:first + size, :, :s], value[first:first + size, :, :s]
        else:
            k, v = key[:, :, :s].index_select(0, group.slots), value[:, :, :s].index_select(0, group.slots)
        if group.dense is not None:  # equal rows side by side: a view
            a, b = group.dense
            q = query[a:b].unflatten(0, (size, -1)).transpose(1, 2)  # [G, H, Q_g, D]
        else:
            if padded is None:
                padded = torch.cat([query, query.new_zeros(1, heads, head_dim)])
            q = padded[group.query_index].transpose(1, 2)  # [G, Q_g, H, D] -> [G, H, Q_g, D]
        g, q_len = q.shape[0], q.shape[2]
        # GQA without copying K/V: the query heads that share a K/V head become rows of one query block,
        # [G, H, Q_g, D] -> [G, H_kv, rep * Q_g, D] (HF's order: query head h reads K/V head h // rep).
        q = q.reshape(g, kv_heads, rep * q_len, head_dim)
        # reshape, not view: CUDA's fused kernels return [G, H_kv, rep * Q_g, D] as a transpose of
        # [G, rep * Q_g, H_kv, D], which no view can split back into heads.
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=masks.get(i, rep),
                                           scale=scaling).reshape(g, heads, q_len, head_dim)  # [G, H, Q_g, D]
        if group.dense is not None and len(groups) == 1:
            return o.transpose(1, 2).reshape(total, heads, head_dim)
        if out is None:
            out = query.new_empty(total, heads, head_dim)
        if group.dense is not None:
            out[a:b] = o.transpose(1, 2).flatten(0, 1)  # [T_g, H, D]
        else:
            out[group.token_index] = o[group.out_rows, :, group.out_offsets]  # [T_g, H, D]
    return out


PACKED_ATTENTION = "specsplit_packed"
PACKED_MASK = torch.zeros(1, 1, 1, 1)  # a 4D mask passes through HF's mask building untouched; the real ones are per group


def use_packed_attention(model: torch.nn.Module) -> None:
    """Let ``model`` run packed forwards (every other forward of it stays plain SDPA)."""
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(PACKED_ATTENTION)
