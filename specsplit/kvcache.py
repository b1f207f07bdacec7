"""KV-cache helpers over Hugging Face ``Cache`` objects (the ``layers[i].keys/values`` API)."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel


def new_cache(model: PreTrainedModel) -> DynamicCache:
    return DynamicCache(config=model.config)


def cache_kwarg(model: PreTrainedModel) -> str:
    """Name of the forward() argument that takes the cache (``cache`` in transformers >= 5.2x)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_length(cache: DynamicCache) -> int:
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
    for layer in cache.layers:
        device = layer.keys.device
        keep = torch.cat(
            [torch.arange(keep_from, device=device), keep_from + torch.tensor(rows_to_keep, device=device)]
        )  # [keep_from + len(rows_to_keep)]
        layer.keys = layer.keys.index_select(-2, keep)  # [B, H_kv, S', D]
        layer.values = layer.values.index_select(-2, keep)  # [B, H_kv, S', D]


def truncate(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of every layer."""
    for layer in cache.layers:
        if layer.is_initialized and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]  # [B, H_kv, length, D]
            layer.values = layer.values[..., :length, :]  # [B, H_kv, length, D]


def cast(cache: DynamicCache, dtype: torch.dtype) -> None:
    """Every layer's keys and values in ``dtype`` (for a forward by a copy of the model in another dtype)."""
    for layer in cache.layers:
        if layer.is_initialized and layer.keys.dtype != dtype:
            layer.keys = layer.keys.to(dtype)  # [B, H_kv, S, D]
            layer.values = layer.values.to(dtype)  # [B, H_kv, S, D]
