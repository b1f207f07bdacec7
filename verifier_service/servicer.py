"""VerifierService over gRPC: protobuf in, TargetEngine call, protobuf out."""

from __future__ import annotations

from specsplit.rpc import VerifyTiming, sampling_from_pb, tree_from_pb, verdict_to_pb
from specsplit.serving import grpc_errors
from specsplit.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_service.engine import TargetEngine


class VerifierServicer(verifier_pb2_grpc.VerifierServiceServicer):
    def __init__(self, engine: TargetEngine):
        self.engine = engine

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
        )

    @grpc_errors
    def Prefill(self, request, context):
        committed_length, prefill_ms = self.engine.prefill(request.session_id, list(request.prompt_token_ids),
                                                           sampling_from_pb(request.sampling))
        return verifier_pb2.PrefillResponse(committed_length=committed_length, prefill_ms=prefill_ms)

    @grpc_errors
    def Verify(self, request, context):
        result = self.engine.verify(
            request.session_id, tree_from_pb(request.tree), request.expected_committed_length, request.max_commit
        )
        timing = VerifyTiming(result.verify_ms, result.queue_ms, result.cost_ms)
        return verdict_to_pb(result.verdict, result.committed_length, timing)

    @grpc_errors
    def Release(self, request, context):
        return verifier_pb2.ReleaseResponse(released=self.engine.release(request.session_id))


SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name


def registration(servicer: VerifierServicer):
    return servicer, verifier_pb2_grpc.add_VerifierServiceServicer_to_server, SERVICE_NAME
