"""VerifierService over gRPC: protobuf in, TargetEngine call, protobuf out."""

from __future__ import annotations

from specsplit.errors import InvalidArgument
from specsplit.models import target_identity
from specsplit.rpc import VerifyTiming, prefill_to_pb, sampling_from_pb, tree_from_pb, verdict_to_pb
from specsplit.serving import grpc_errors
from specsplit.sweep import IdleSweeper
from specsplit.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_service.engine import TargetEngine

KV_CHUNK_BYTES = 1 << 20  # an exported cache travels in 1 MiB pieces, far below any message limit


class VerifierServicer(verifier_pb2_grpc.VerifierServiceServicer):
    def __init__(self, engine: TargetEngine):
        self.engine = engine
        # Sessions whose orchestrator vanished (killed mid-generation) are freed after idle_timeout_s.
        self.sweeper = IdleSweeper(engine.release, engine.config.idle_timeout_s)

    def close(self) -> None:
        self.sweeper.close()

    @grpc_errors
    def GetInfo(self, request, context):
        e = self.engine
        return verifier_pb2.VerifierInfoResponse(
            model=e.loaded.name,
            tokenizer_fingerprint=e.loaded.fingerprint,
            vocab_size=e.vocab_size,
            max_context=e.max_context,
            max_tree_nodes=e.config.max_tree_nodes,
            eos_token_ids=e.eos_token_ids,
            device=str(e.device),
            dtype=str(e.dtype).removeprefix("torch."),
            num_sessions=e.num_sessions(),
            target_identity=target_identity(e.loaded),
            medusa=(e.medusa.name or "medusa") if e.medusa is not None else "",
            medusa_max_nodes=e.medusa.max_nodes if e.medusa is not None else 0,
            max_decode_steps=e.config.max_decode_steps,
        )

    @grpc_errors
    def Prefill(self, request, context):
        result = self.engine.prefill(request.session_id, list(request.prompt_token_ids),
                                     sampling_from_pb(request.sampling), request.return_features, request.medusa)
        self.sweeper.touch(request.session_id)
        return prefill_to_pb(*result)

    @grpc_errors
    def Verify(self, request, context):
        self.sweeper.touch(request.session_id)
        result = self.engine.verify(
            request.session_id, tree_from_pb(request.tree), request.expected_committed_length, request.max_commit,
            request.decode_steps)
        self.sweeper.touch(request.session_id)
        timing = VerifyTiming(result.verify_ms, result.queue_ms, result.cost_ms, busy_ms=result.busy_ms)
        return verdict_to_pb(result.verdict, result.committed_length, timing, result.features, result.proposal)

    @grpc_errors
    def Release(self, request, context):
        self.sweeper.forget(request.session_id)
        return verifier_pb2.ReleaseResponse(released=self.engine.release(request.session_id))

    @grpc_errors
    def ExportSession(self, request, context):
        self.sweeper.touch(request.session_id)
        blob = self.engine.export_session(request.session_id, request.expected_committed_length, request.dtype)
        for start in range(0, max(len(blob), 1), KV_CHUNK_BYTES):
            yield verifier_pb2.KvChunk(data=blob[start:start + KV_CHUNK_BYTES])

    @grpc_errors
    def ImportSession(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or not first.session_id:
            raise InvalidArgument("ImportSession: the first chunk must name the session and its committed tokens")
        blob = b"".join([first.data, *(chunk.data for chunk in request_iterator)])
        committed_length, import_ms = self.engine.import_session(first.session_id, list(first.token_ids), blob,
                                                                 sampling_from_pb(first.sampling),
                                                                 first.return_features, first.medusa)
        self.sweeper.touch(first.session_id)
        return verifier_pb2.ImportSessionResponse(committed_length=committed_length, import_ms=import_ms)


SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name


def registration(servicer: VerifierServicer):
    return servicer, verifier_pb2_grpc.add_VerifierServiceServicer_to_server, SERVICE_NAME
