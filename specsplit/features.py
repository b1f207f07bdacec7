"""The target's features on the wire: final hidden states (after the final norm) of committed positions.

A feature drafter (``specsplit.heads.FeatureDrafter``) reads the feature f_t of every committed
position t. The verifier computes them anyway -- they are what its LM head turns into logits -- so
each Prefill/Verify response carries the rows of the positions it newly cached, in float16: 2 bytes
per hidden unit per position (1152 bytes a token for SmolLM2-135M). The orchestrator forwards them to
the draft with the next Propose.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specsplit.errors import InvalidArgument

WIRE_DTYPE = np.dtype("<f2")  # float16, little-endian


@dataclass(frozen=True)
class Features:
    first_position: int  # committed position of row 0
    values: torch.Tensor  # [N, H] float16 on CPU; row i is f_{first_position + i}

    @property
    def num_positions(self) -> int:
        return int(self.values.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.values.shape[1])

    @property
    def end_position(self) -> int:
        return self.first_position + self.num_positions

    @property
    def nbytes(self) -> int:
        return self.num_positions * self.hidden_size * WIRE_DTYPE.itemsize

    @classmethod
    def of(cls, first_position: int, hidden: torch.Tensor) -> "Features":
        """hidden: [N, H] any float dtype/device."""
        return cls(first_position, hidden.detach().to("cpu", torch.float16).contiguous())

    def to_bytes(self) -> bytes:
        return self.values.numpy().astype(WIRE_DTYPE, copy=False).tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, num_positions: int, hidden_size: int, first_position: int) -> "Features":
        if len(data) != num_positions * hidden_size * WIRE_DTYPE.itemsize:
            raise InvalidArgument(f"features: {len(data)} bytes do not hold {num_positions} x {hidden_size} float16")
        array = np.frombuffer(data, dtype=WIRE_DTYPE).reshape(num_positions, hidden_size)  # [N, H]
        return cls(first_position, torch.from_numpy(array.astype(np.float16)))  # a copy: writable, native order
