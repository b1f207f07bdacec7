from specsplit.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifierInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierInfoResponse(_message.Message):
    __slots__ = ("model", "tokenizer_fingerprint", "vocab_size", "max_context", "max_tree_nodes", "eos_token_ids", "device", "dtype", "num_sessions", "target_identity", "medusa", "medusa_max_nodes", "max_decode_steps")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TARGET_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    MEDUSA_FIELD_NUMBER: _ClassVar[int]
    MEDUSA_MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    model: str
    tokenizer_fingerprint: str
    vocab_size: int
    max_context: int
    max_tree_nodes: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    device: str
    dtype: str
    num_sessions: int
    target_identity: str
    medusa: str
    medusa_max_nodes: int
    max_decode_steps: int
    def __init__(self, model: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., num_sessions: _Optional[int] = ..., target_identity: _Optional[str] = ..., medusa: _Optional[str] = ..., medusa_max_nodes: _Optional[int] = ..., max_decode_steps: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "sampling", "return_features", "medusa")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    MEDUSA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    return_features: bool
    medusa: bool
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_features: _Optional[bool] = ..., medusa: _Optional[bool] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("committed_length", "prefill_ms", "features", "proposal", "copied_tokens")
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    COPIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    committed_length: int
    prefill_ms: float
    features: _common_pb2.Features
    proposal: _common_pb2.TokenTree
    copied_tokens: int
    def __init__(self, committed_length: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., proposal: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., copied_tokens: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "tree", "expected_committed_length", "max_commit", "decode_steps")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_COMMIT_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tree: _common_pb2.TokenTree
    expected_committed_length: int
    max_commit: int
    decode_steps: int
    def __init__(self, session_id: _Optional[str] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., expected_committed_length: _Optional[int] = ..., max_commit: _Optional[int] = ..., decode_steps: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted_token_ids", "next_token_id", "accepted_node_indices", "committed_length", "verify_ms", "queue_ms", "cost_ms", "features", "proposal", "decoded_token_ids", "busy_ms")
    ACCEPTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODE_INDICES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COST_MS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    DECODED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BUSY_MS_FIELD_NUMBER: _ClassVar[int]
    accepted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    next_token_id: int
    accepted_node_indices: _containers.RepeatedScalarFieldContainer[int]
    committed_length: int
    verify_ms: float
    queue_ms: float
    cost_ms: float
    features: _common_pb2.Features
    proposal: _common_pb2.TokenTree
    decoded_token_ids: _containers.RepeatedScalarFieldContainer[int]
    busy_ms: float
    def __init__(self, accepted_token_ids: _Optional[_Iterable[int]] = ..., next_token_id: _Optional[int] = ..., accepted_node_indices: _Optional[_Iterable[int]] = ..., committed_length: _Optional[int] = ..., verify_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., cost_ms: _Optional[float] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., proposal: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., decoded_token_ids: _Optional[_Iterable[int]] = ..., busy_ms: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class ExportSessionRequest(_message.Message):
    __slots__ = ("session_id", "expected_committed_length", "dtype")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    expected_committed_length: int
    dtype: str
    def __init__(self, session_id: _Optional[str] = ..., expected_committed_length: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("session_id", "token_ids", "sampling", "data", "return_features", "medusa")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    MEDUSA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    data: bytes
    return_features: bool
    medusa: bool
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., data: _Optional[bytes] = ..., return_features: _Optional[bool] = ..., medusa: _Optional[bool] = ...) -> None: ...

class ImportSessionResponse(_message.Message):
    __slots__ = ("committed_length", "import_ms")
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    IMPORT_MS_FIELD_NUMBER: _ClassVar[int]
    committed_length: int
    import_ms: float
    def __init__(self, committed_length: _Optional[int] = ..., import_ms: _Optional[float] = ...) -> None: ...
