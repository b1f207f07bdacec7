"""Reading the training data written by draft_service.training.generate_data, one sequence at a time.

    from draft_service.training.dataset import iter_sequences, load_sequences, read_description
    for seq in iter_sequences():          # default dir: $SPECSPLIT_CACHE/train-data/v1
        seq.token_ids       # [T] int32   prompt + the target's greedy response
        seq.features        # [T, H] fp16 target final hidden state (after the final norm)
        seq.target_next     # [T] int32   target's greedy next token at each position
        seq.response_start  # int         index of the first response token

Only complete shards are read (they are written atomically), so a generation still running is fine.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from draft_service.training.generate_data import default_out_dir


@dataclass
class Sequence:
    token_ids: torch.Tensor  # [T] int32
    features: torch.Tensor  # [T, H] float16
    target_next: torch.Tensor  # [T] int32
    response_start: int  # index of the first response token; token_ids[:response_start] is the prompt
    prompt_index: int  # index in generate_prompts(seed)

    def __iter__(self):  # unpacks as (token_ids, features, target_next, response_start)
        return iter((self.token_ids, self.features, self.target_next, self.response_start))


def shard_paths(data_dir: str | pathlib.Path | None = None) -> list[pathlib.Path]:
    data_dir = pathlib.Path(data_dir) if data_dir is not None else default_out_dir()
    return sorted(data_dir.glob("shard-*.safetensors"))


def read_description(data_dir: str | pathlib.Path | None = None) -> dict:
    data_dir = pathlib.Path(data_dir) if data_dir is not None else default_out_dir()
    return json.loads((data_dir / "data.json").read_text())


def split_shard(tensors: dict[str, torch.Tensor]) -> list[Sequence]:
    """One shard's concatenated tensors as per-sequence views (no copies)."""
    offsets = tensors["offsets"].tolist()  # [N+1]
    assert offsets[-1] == tensors["token_ids"].shape[0] == tensors["features"].shape[0], "ragged shard"
    out = []
    for i in range(len(offsets) - 1):
        a, b = offsets[i], offsets[i + 1]
        out.append(Sequence(tensors["token_ids"][a:b], tensors["features"][a:b], tensors["target_next"][a:b],
                            int(tensors["response_start"][i]), int(tensors["prompt_index"][i])))
    return out


def iter_sequences(data_dir: str | pathlib.Path | None = None) -> Iterator[Sequence]:
    """Every sequence of every complete shard, shard by shard (one shard in memory at a time)."""
    for path in shard_paths(data_dir):
        yield from split_shard(load_file(str(path)))


def load_sequences(data_dir: str | pathlib.Path | None = None) -> list[Sequence]:
    """All sequences in memory (fine for the few hundred MB a 40-minute run makes)."""
    return list(iter_sequences(data_dir))
