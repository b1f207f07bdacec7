from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class TokenTree(_message.Message):
    __slots__ = ("token_ids", "parents", "draft_probs", "q_offsets", "q_token_ids", "q_probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    Q_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    Q_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedScalarFieldContainer[float]
    q_offsets: _containers.RepeatedScalarFieldContainer[int]
    q_token_ids: _containers.RepeatedScalarFieldContainer[int]
    q_probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[float]] = ..., q_offsets: _Optional[_Iterable[int]] = ..., q_token_ids: _Optional[_Iterable[int]] = ..., q_probs: _Optional[_Iterable[float]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "rejection")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REJECTION_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    rejection: bool
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., rejection: _Optional[bool] = ...) -> None: ...

class RoundStats(_message.Message):
    __slots__ = ("round", "num_draft_tokens", "num_accepted", "num_committed", "draft_ms", "verify_ms", "drafter", "tree_depth", "feature_bytes", "wasted", "provisional_kept", "num_decoded")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    FEATURE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WASTED_FIELD_NUMBER: _ClassVar[int]
    PROVISIONAL_KEPT_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODED_FIELD_NUMBER: _ClassVar[int]
    round: int
    num_draft_tokens: int
    num_accepted: int
    num_committed: int
    draft_ms: float
    verify_ms: float
    drafter: str
    tree_depth: int
    feature_bytes: int
    wasted: int
    provisional_kept: int
    num_decoded: int
    def __init__(self, round: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted: _Optional[int] = ..., num_committed: _Optional[int] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., drafter: _Optional[str] = ..., tree_depth: _Optional[int] = ..., feature_bytes: _Optional[int] = ..., wasted: _Optional[int] = ..., provisional_kept: _Optional[int] = ..., num_decoded: _Optional[int] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("data", "num_positions", "hidden_size", "first_position")
    DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    num_positions: int
    hidden_size: int
    first_position: int
    def __init__(self, data: _Optional[bytes] = ..., num_positions: _Optional[int] = ..., hidden_size: _Optional[int] = ..., first_position: _Optional[int] = ...) -> None: ...
