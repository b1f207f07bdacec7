from specsplit.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftInfoResponse(_message.Message):
    __slots__ = ("drafter", "model", "tokenizer_fingerprint", "max_nodes", "wants_features", "target_identity")
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    WANTS_FEATURES_FIELD_NUMBER: _ClassVar[int]
    TARGET_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    model: str
    tokenizer_fingerprint: str
    max_nodes: int
    wants_features: bool
    target_identity: str
    def __init__(self, drafter: _Optional[str] = ..., model: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_nodes: _Optional[int] = ..., wants_features: _Optional[bool] = ..., target_identity: _Optional[str] = ...) -> None: ...

class StartSessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "tokenizer_fingerprint", "sampling", "target_identity", "stop_token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TARGET_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_fingerprint: str
    sampling: _common_pb2.SamplingParams
    target_identity: str
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., tokenizer_fingerprint: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., target_identity: _Optional[str] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StartSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "new_token_ids", "committed_length", "max_nodes", "features")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    committed_length: int
    max_nodes: int
    features: _containers.RepeatedCompositeFieldContainer[_common_pb2.Features]
    def __init__(self, session_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., committed_length: _Optional[int] = ..., max_nodes: _Optional[int] = ..., features: _Optional[_Iterable[_Union[_common_pb2.Features, _Mapping]]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("tree", "draft_ms")
    TREE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    tree: _common_pb2.TokenTree
    draft_ms: float
    def __init__(self, tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., draft_ms: _Optional[float] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftTreeRequest(_message.Message):
    __slots__ = ("start", "verifying", "verdict")
    START_FIELD_NUMBER: _ClassVar[int]
    VERIFYING_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    start: DraftTreeStart
    verifying: int
    verdict: DraftVerdict
    def __init__(self, start: _Optional[_Union[DraftTreeStart, _Mapping]] = ..., verifying: _Optional[int] = ..., verdict: _Optional[_Union[DraftVerdict, _Mapping]] = ...) -> None: ...

class DraftVerdict(_message.Message):
    __slots__ = ("committed_token_ids",)
    COMMITTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    committed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, committed_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftTreeStart(_message.Message):
    __slots__ = ("propose", "provisional_max", "given_token_ids")
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    PROVISIONAL_MAX_FIELD_NUMBER: _ClassVar[int]
    GIVEN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    propose: ProposeRequest
    provisional_max: int
    given_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, propose: _Optional[_Union[ProposeRequest, _Mapping]] = ..., provisional_max: _Optional[int] = ..., given_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TreeGrowth(_message.Message):
    __slots__ = ("first", "token_ids", "parents", "draft_probs", "provisional", "done", "seeded", "draft_ms")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    PROVISIONAL_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    SEEDED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    first: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedScalarFieldContainer[float]
    provisional: bool
    done: bool
    seeded: int
    draft_ms: float
    def __init__(self, first: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[float]] = ..., provisional: _Optional[bool] = ..., done: _Optional[bool] = ..., seeded: _Optional[int] = ..., draft_ms: _Optional[float] = ...) -> None: ...
