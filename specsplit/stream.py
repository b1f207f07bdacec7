"""What a generation stream carries, shared by the orchestrator (producer) and the SDK (consumer)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoundStats:
    round: int
    num_draft_tokens: int  # nodes in the verified tree
    num_accepted: int  # draft tokens the target agreed with
    num_committed: int  # tokens this round added to the output (accepted + recovered/bonus, cut at a stop)
    draft_ms: float
    verify_ms: float
    drafter: str  # "ngram", "model", "eagle", "eagle+ngram", "medusa" or "none" (target-only round)
    tree_depth: int = 0  # depth of the verified tree
    feature_bytes: int = 0  # target features (float16) the verifier sent this round for the draft
    wasted: int = 0  # drafted tokens that were not committed: tree nodes off the accepted path + dropped provisional
    provisional_kept: int = 0  # tree nodes that were last round's provisional tokens (drafted under a verification)
    num_decoded: int = 0  # of the round's tokens, those the target decoded alone after the verdict (a decode burst)


@dataclass(frozen=True)
class Chunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]  # new token ids since the previous chunk
    stats: RoundStats | None = None
    session_id: str = ""
    prompt_token_ids: list[int] | None = None  # first chunk only: what the target saw
    finish_reason: str = ""  # last chunk only: "length", "eos", "stop", "cancelled", "error" (a resumed session that
    # had failed on its orchestrator)
