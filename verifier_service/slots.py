"""A slot-based KV cache: many sessions, one batched forward.

Every session owns a *slot*. Per layer, keys and values live in one preallocated tensor
``[num_slots, H_kv, capacity, D]``; a session's committed tokens sit at positions ``[0, length)`` of
its slot. A batched forward is described by ``(slots, starts)``: row b's new K/V are written at
``[starts[b], starts[b] + Q)`` of slot ``slots[b]`` (padding included; it lands past the committed
tokens, where nothing reads it), and attention runs over the ``[B, H_kv, S, D]`` view of those slots'
first ``S`` positions. The 4D attention mask (``verifier_service.batching``) hides, per row, everything
that is neither its own committed prefix nor its tree ancestors.

After acceptance the accepted rows' K/V are moved to follow the prefix inside the slot (one gather per
layer): compaction, never a re-prefill. Storage grows lazily, slots in powers of two up to
``max_slots`` and capacity in steps of ``grow_tokens``, so idle headroom costs no memory.
"""

from __future__ import annotations

import heapq

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specsplit.errors import ResourceExhausted


class SlotStore:
    def __init__(self, max_slots: int, grow_tokens: int = 256):
        self.max_slots = max_slots
        self.grow_tokens = grow_tokens
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

        like: [B, H_kv, Q, D] the layer's new keys (gives heads, head size, dtype, device on first use).
        """
        while len(self.keys) <= layer_idx:
            self.keys.append(like.new_zeros(0, like.shape[1], 0, like.shape[3]))
            self.values.append(like.new_zeros(0, like.shape[1], 0, like.shape[3]))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        have_slots, have_len = keys.shape[0], keys.shape[2]
        if num_slots > have_slots or length > have_len:
            new_slots = have_slots if num_slots <= have_slots else min(self.max_slots, max(num_slots, 2 * have_slots))
            new_len = max(have_len, -(-length // self.grow_tokens) * self.grow_tokens)
            shape = (new_slots, keys.shape[1], new_len, keys.shape[3])
            grown_k, grown_v = keys.new_zeros(shape), values.new_zeros(shape)  # [slots', H_kv, capacity', D]
            grown_k[:have_slots, :, :have_len] = keys
            grown_v[:have_slots, :, :have_len] = values
            self.keys[layer_idx], self.values[layer_idx] = keys, values = grown_k, grown_v
        return keys, values

    def compact(self, slot: int, keep_from: int, rows_to_keep: tuple[int, ...]) -> None:
        """Move block rows ``rows_to_keep`` (offsets from ``keep_from``) to ``keep_from, keep_from + 1, ...``.

        A chain's accepted rows are already in place (0, 1, 2, ...): nothing moves.
        """
        if rows_to_keep == tuple(range(len(rows_to_keep))):
            return
        for keys, values in zip(self.keys, self.values):
            src = keep_from + torch.tensor(rows_to_keep, device=keys.device)  # [K]
            dst = slice(keep_from, keep_from + len(rows_to_keep))
            keys[slot, :, dst] = keys[slot, :, src]  # [H_kv, K, D]; the gather copies before the write
            values[slot, :, dst] = values[slot, :, src]

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
            keys, values = self.layer(layer_idx, k.unsqueeze(0), slot + 1, k.shape[1])
            keys[slot, :, :k.shape[1]] = k
            values[slot, :, :v.shape[1]] = v

    def read(self, layer_idx: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[H_kv, length, D] keys and values of one slot (for tests and debugging)."""
        return self.keys[layer_idx][slot, :, :length], self.values[layer_idx][slot, :, :length]


class _SlotLayer(CacheLayerMixin):
    """One layer's view of a batch: writes each row at its own offset, returns the rows' padded K/V."""

    is_sliding = False

    def __init__(self, batch: "SlotBatch", layer_idx: int):
        super().__init__()
        self.batch, self.layer_idx = batch, layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states: [B, H_kv, Q, D] -> keys, values [B, H_kv, S, D] for the attention."""
        b = self.batch
        q = key_states.shape[2]
        keys, values = b.store.layer(self.layer_idx, key_states, b.max_slot + 1, b.kv_length)
        rows = b.slots[:, None].expand(-1, q)  # [B, Q]
        positions = b.starts[:, None] + torch.arange(q, device=b.starts.device)  # [B, Q]
        keys.transpose(1, 2)[rows, positions] = key_states.transpose(1, 2)  # [B, Q, H_kv, D] into the slots
        values.transpose(1, 2)[rows, positions] = value_states.transpose(1, 2)
        if b.contiguous:  # slots s0, s0+1, ...: a view, no copy
            s0 = b.first_slot
            return keys[s0:s0 + len(b.slots), :, :b.kv_length], values[s0:s0 + len(b.slots), :, :b.kv_length]
        return keys[:, :, :b.kv_length].index_select(0, b.slots), values[:, :, :b.kv_length].index_select(0, b.slots)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.batch.kv_length, 0

    def get_seq_length(self) -> int:
        return int(self.batch.starts.max())

    def get_max_length(self) -> int:
        return -1


class SlotBatch(Cache):
    """The ``Cache`` handed to one batched forward (a thin view over the ``SlotStore``).

    slots: [B] the rows' slots; starts: [B] cached tokens of each row; q_len: new tokens per row (padded).
    The forward must get position ids and a 4D mask: this cache sizes nothing by itself.
    """

    def __init__(self, store: SlotStore, slots: torch.Tensor, starts: torch.Tensor, q_len: int, num_layers: int):
        self.store = store
        self.slots = slots  # [B]
        self.starts = starts  # [B]
        self.kv_length = int((starts + q_len).max())  # S: keys each row attends over (its prefix, its block, padding)
        slot_list = slots.tolist()
        self.max_slot = max(slot_list)
        self.first_slot = slot_list[0]
        self.contiguous = slot_list == list(range(slot_list[0], slot_list[0] + len(slot_list)))
        super().__init__(layers=[_SlotLayer(self, i) for i in range(num_layers)])
