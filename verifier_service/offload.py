"""KV offload: a transformers ``DynamicCache`` as compact bytes, and back.

Layout: ``b"SKV1"``, a little-endian u32 header length, a JSON header (dtype and each layer's key and
value shapes), then every layer's keys and values as raw bytes, in order. ``dtype`` can shrink the
blob (``float16`` halves an fp32 cache); the restored cache is cast back to the model's dtype. A
narrower dtype rounds the cached keys and values, which can flip a near-tie in greedy decoding; keep
the cache's own dtype (the default) where token-identical output matters more than size.
"""

from __future__ import annotations

import json
import struct

import torch
from transformers import DynamicCache

from specsplit.errors import InvalidArgument

MAGIC = b"SKV1"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cache_to_bytes(cache: DynamicCache, dtype: str | torch.dtype | None = None) -> bytes:
    """Serialize every layer's keys and values ([B, H_kv, S, D] each), optionally cast to ``dtype``."""
    target = DTYPES[dtype] if isinstance(dtype, str) and dtype else (dtype or None)
    shapes, pieces, target_name = [], [], "float32"
    for layer in cache.layers:
        if not layer.is_initialized:
            shapes.append(None)
            continue
        pair = []
        for tensor in (layer.keys, layer.values):
            t = tensor.detach().to(target or tensor.dtype).contiguous().cpu()
            pair.append(list(t.shape))
            pieces.append(t.view(torch.uint8).reshape(-1).numpy().tobytes())
            target_name = str(t.dtype).removeprefix("torch.")
        shapes.append(pair)
    header = json.dumps({"dtype": target_name if pieces else "float32", "layers": shapes}).encode()
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, *pieces])


def header_of(blob: bytes) -> dict:
    if blob[:4] != MAGIC:
        raise InvalidArgument("not a specsplit KV blob (bad magic)")
    (size,) = struct.unpack("<I", blob[4:8])
    header = json.loads(blob[8:8 + size])
    header["offset"] = 8 + size
    return header


def cached_length(blob: bytes) -> int:
    """Positions in the serialized cache (0 when empty)."""
    layers = [pair for pair in header_of(blob)["layers"] if pair]
    return layers[0][0][-2] if layers else 0


def cache_from_bytes(blob: bytes, cache: DynamicCache, device: torch.device, dtype: torch.dtype) -> DynamicCache:
    """Fill the empty ``cache`` (made for the model the blob came from) with the blob's keys and values."""
    header = header_of(blob)
    stored = DTYPES[header["dtype"]]
    offset = header["offset"]
    width = torch.empty((), dtype=stored).element_size()
    if len(header["layers"]) != len(cache.layers):
        raise InvalidArgument(f"KV blob has {len(header['layers'])} layers, this model has {len(cache.layers)}")
    for index, pair in enumerate(header["layers"]):
        if pair is None:
            continue
        tensors = []
        for shape in pair:
            size = width * _numel(shape)
            if offset + size > len(blob):
                raise InvalidArgument("KV blob is truncated")
            raw = torch.frombuffer(bytearray(blob[offset:offset + size]), dtype=torch.uint8)
            tensors.append(raw.view(stored).reshape(shape).to(device=device, dtype=dtype))
            offset += size
        cache.update(tensors[0], tensors[1], index)
    if offset != len(blob):
        raise InvalidArgument(f"KV blob has {len(blob) - offset} trailing bytes: truncated or corrupt")
    return cache


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
