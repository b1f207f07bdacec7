"""KV-cache helpers over Hugging Face ``Cache`` objects (the ``layers[i].keys/values`` API)."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel


class LeanCache:
    """A preallocated KV cache for ``draft_service.lean.LeanLlama``: rows are written in place, and its storage
    grows by doubling, so a step copies nothing but its own new rows.

    keys, values: [L, H_kv, capacity, D]; rows ``[0, length)`` hold the cached positions."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device):
        shape = (num_layers, num_kv_heads, 0, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)  # [L, H_kv, 0, D]
        self.values = torch.empty(shape, dtype=dtype, device=device)  # [L, H_kv, 0, D]
        self.length = 0

    def reserve(self, length: int) -> None:
        """Room for ``length`` rows (the first ``self.length`` kept)."""
        capacity = self.keys.shape[2]
        if length <= capacity:
            return
        capacity = max(length, 2 * capacity, 256)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty((old.shape[0], old.shape[1], capacity, old.shape[3]))  # [L, H_kv, capacity, D]
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep the given rows ([N], ascending), in order, as rows ``[0, N)``. (Under inference mode: the storage
        was made by forwards under it, and a compaction may run on another thread, outside it.)"""
        with torch.inference_mode():
            self.keys[:, :, :len(rows)] = self.keys.index_select(2, rows)  # [L, H_kv, N, D]
            self.values[:, :, :len(rows)] = self.values.index_select(2, rows)  # [L, H_kv, N, D]
        self.length = len(rows)


def new_cache(model: PreTrainedModel) -> DynamicCache | LeanCache:
    if hasattr(model, "new_cache"):  # a lean forward's own cache
        return model.new_cache()
    return DynamicCache(config=model.config)


def cache_kwarg(model: PreTrainedModel) -> str:
    """Name of the forward() argument that takes the cache (``cache`` in transformers >= 5.2x)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_length(cache: DynamicCache | LeanCache) -> int:
    if isinstance(cache, LeanCache):
        return cache.length
    return cache.get_seq_length()


def compact(cache: DynamicCache, keep_from: int, rows_to_keep: tuple[int, ...]) -> None:
    """Keep positions ``[0, keep_from)`` plus ``keep_from + r`` for r in rows_to_keep; drop the rest.

    After a tree forward the cache holds prefix + (root + all tree nodes); this leaves prefix + root +
    accepted path, in order, so the cache again holds exactly the committed tokens. A contiguous
    ``rows_to_keep`` (a chain) is a crop; otherwise one gather along the sequence axis per layer.
    """
    if rows_to_keep == tuple(range(len(rows_to_keep))):
        truncate(cache, keep_from + len(rows_to_keep))
        return
    if isinstance(cache, LeanCache):
        device = cache.keys.device
        cache.keep(torch.cat([torch.arange(keep_from, device=device),
                              keep_from + torch.tensor(rows_to_keep, device=device)]))  # [keep_from + R]
        return
    for layer in cache.layers:
        device = layer.keys.device
        keep = torch.cat(
            [torch.arange(keep_from, device=device), keep_from + torch.tensor(rows_to_keep, device=device)]
        )  # [keep_from + len(rows_to_keep)]
        layer.keys = layer.keys.index_select(-2, keep)  # [B, H_kv, S', D]
        layer.values = layer.values.index_select(-2, keep)  # [B, H_kv, S', D]


def truncate(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of every layer."""
    if isinstance(cache, LeanCache):
        cache.length = min(cache.length, length)
        return
    for layer in cache.layers:
        if layer.is_initialized and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]  # [B, H_kv, length, D]
            layer.values = layer.values[..., :length, :]  # [B, H_kv, length, D]


def common_length(a, b) -> int:
    """Length of the longest common start of two token id sequences: what a cache of ``a`` holds for ``b``."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def cast(cache: DynamicCache, dtype: torch.dtype) -> None:
    """Every layer's keys and values in ``dtype`` (for a forward by a copy of the model in another dtype).
    A lean cache stays in its models' shared compute dtype."""
    if isinstance(cache, LeanCache):
        return
    for layer in cache.layers:
        if layer.is_initialized and layer.keys.dtype != dtype:
            layer.keys = layer.keys.to(dtype)  # [B, H_kv, S, D]
            layer.values = layer.values.to(dtype)  # [B, H_kv, S, D]
