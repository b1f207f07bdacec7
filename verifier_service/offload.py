"""KV offload: one session's cached keys and values as compact bytes, and back.

Layout: ``b"SKV1"``, a little-endian u32 header length, a JSON header (dtype and each layer's key and
value shapes, ``[H_kv, S, D]``), then every layer's keys and values as raw bytes, in order. A layer
with nothing cached is ``null``. ``dtype`` can shrink the blob (``float16`` halves an fp32 cache); the
imported tensors are cast back to the model's dtype. A narrower dtype rounds the cached keys and
values, which can flip a near-tie in greedy decoding; keep the cache's own dtype (the default) where
token-identical output matters more than size.

This module only converts plain tensors (``SlotStore.read_session`` / ``write_session`` move them out of
and into a slot, on the model thread).
"""

from __future__ import annotations

import json
import struct

import torch

from specsplit.errors import InvalidArgument

MAGIC = b"SKV1"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

Layers = list[tuple[torch.Tensor, torch.Tensor] | None]  # per layer (keys, values) [H_kv, S, D], or None


def target_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The dtype a blob is written in (None: the cache's own)."""
    if isinstance(dtype, torch.dtype) or not dtype:
        return dtype or None
    if dtype not in DTYPES:
        raise InvalidArgument(f"unknown KV dtype {dtype!r}; choose one of {', '.join(DTYPES)} (or empty)")
    return DTYPES[dtype]


def layers_to_bytes(layers: Layers) -> bytes:
    """Serialize CPU tensors (already in the blob's dtype) as they are."""
    shapes, pieces, dtype_name = [], [], "float32"
    for pair in layers:
        if pair is None:
            shapes.append(None)
            continue
        shape_pair = []
        for tensor in pair:
            t = tensor.detach().contiguous().cpu()
            shape_pair.append(list(t.shape))
            pieces.append(t.view(torch.uint8).reshape(-1).numpy().tobytes())
            dtype_name = str(t.dtype).removeprefix("torch.")
        shapes.append(shape_pair)
    header = json.dumps({"dtype": dtype_name, "layers": shapes}).encode()
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, *pieces])


def header_of(blob: bytes) -> dict:
    if blob[:4] != MAGIC:
        raise InvalidArgument("not a specsplit KV blob (bad magic)")
    if len(blob) < 8:
        raise InvalidArgument("KV blob is truncated")
    (size,) = struct.unpack("<I", blob[4:8])
    try:
        header = json.loads(blob[8:8 + size])
    except ValueError:
        raise InvalidArgument("KV blob header is corrupt") from None
    if header.get("dtype") not in DTYPES or not isinstance(header.get("layers"), list):
        raise InvalidArgument("KV blob header is corrupt")
    header["offset"] = 8 + size
    return header


def cached_length(blob: bytes) -> int:
    """Positions in the serialized cache (0 when empty)."""
    layers = [pair for pair in header_of(blob)["layers"] if pair]
    return layers[0][0][-2] if layers else 0


def layers_from_bytes(blob: bytes, num_layers: int, kv_shape: tuple[int, int] | None = None) -> Layers:
    """CPU tensors ([H_kv, S, D], the blob's dtype) of a blob made for a model with ``num_layers`` layers (and, if
    given, ``kv_shape`` = (H_kv, D) K/V heads and head size: a blob of another model is refused here, before its
    tensors could become the shape of an empty verifier's K/V store)."""
    header = header_of(blob)
    stored = DTYPES[header["dtype"]]
    offset = header["offset"]
    width = torch.empty((), dtype=stored).element_size()
    if len(header["layers"]) != num_layers:
        raise InvalidArgument(f"KV blob has {len(header['layers'])} layers, this model has {num_layers}")
    layers: Layers = []
    for pair in header["layers"]:
        if pair is None:
            layers.append(None)
            continue
        tensors = []
        for shape in pair:
            shape = shape[-3:] if len(shape) == 4 and shape[0] == 1 else shape  # [1, H_kv, S, D] (older blobs)
            if len(shape) != 3:
                raise InvalidArgument(f"KV blob layer shape {shape} is not [H_kv, S, D]")
            if kv_shape is not None and (shape[0], shape[2]) != tuple(kv_shape):
                raise InvalidArgument(f"KV blob layer shape {list(shape)} does not fit this model ({kv_shape[0]} K/V "
                                      f"heads of size {kv_shape[1]}): a blob of another model")
            size = width * _numel(shape)
            if offset + size > len(blob):
                raise InvalidArgument("KV blob is truncated")
            raw = torch.frombuffer(bytearray(blob[offset:offset + size]), dtype=torch.uint8)
            tensors.append(raw.view(stored).reshape(shape))
            offset += size
        layers.append((tensors[0], tensors[1]))
    if offset != len(blob):
        raise InvalidArgument(f"KV blob has {len(blob) - offset} trailing bytes: truncated or corrupt")
    lengths = {t.shape[1] for pair in layers if pair is not None for t in pair}
    if len(lengths) > 1 or (lengths and None in layers):
        raise InvalidArgument(f"KV blob layers cache different lengths ({sorted(lengths)}): corrupt")
    return layers


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
