"""DraftService over gRPC: protobuf in, Drafter call, protobuf out."""

from __future__ import annotations

import threading

from draft_service.drafter import Drafter, GrowthControl
from specsplit.errors import InvalidArgument
from specsplit.rpc import features_from_pb, growth_to_pb, sampling_from_pb, tree_to_pb
from specsplit.serving import grpc_errors
from specsplit.sweep import IdleSweeper
from specsplit.v1 import draft_pb2, draft_pb2_grpc


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, drafter: Drafter, model_name: str = "", idle_timeout_s: float = 300.0):
        self.drafter = drafter
        self.model_name = model_name
        self.sweeper = IdleSweeper(drafter.end, idle_timeout_s)  # sessions whose orchestrator vanished

    def close(self) -> None:
        self.sweeper.close()

    @grpc_errors
    def GetInfo(self, request, context):
        return draft_pb2.DraftInfoResponse(
            drafter=self.drafter.proposer.name,
            model=self.model_name,
            tokenizer_fingerprint=self.drafter.proposer.tokenizer_fingerprint,
            max_nodes=self.drafter.max_nodes,
            wants_features=getattr(self.drafter.proposer, "wants_features", False),
            target_identity=getattr(self.drafter.proposer, "target_identity", ""),
        )

    @grpc_errors
    def StartSession(self, request, context):
        self.drafter.start(request.session_id, list(request.prompt_token_ids), request.tokenizer_fingerprint,
                           sampling_from_pb(request.sampling), request.target_identity, list(request.stop_token_ids))
        self.sweeper.touch(request.session_id)
        return draft_pb2.StartSessionResponse()

    @grpc_errors
    def Propose(self, request, context):
        self.sweeper.touch(request.session_id)
        tree, draft_ms = self.drafter.propose(
            request.session_id, list(request.new_token_ids), request.committed_length, request.max_nodes,
            [features_from_pb(f) for f in request.features],
        )
        return draft_pb2.ProposeResponse(tree=tree_to_pb(tree), draft_ms=draft_ms)

    @grpc_errors
    def DraftTree(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "start":
            raise InvalidArgument("DraftTree: the first message must be `start`")
        start = first.start
        propose = start.propose
        self.sweeper.touch(propose.session_id)
        control = GrowthControl()
        context.add_callback(control.close)  # the orchestrator went away

        def read_rest():
            try:
                for request in request_iterator:
                    kind = request.WhichOneof("kind")
                    if kind == "verifying":
                        control.verify(request.verifying)
                    elif kind == "verdict":
                        control.conclude(list(request.verdict.committed_token_ids))
            except Exception:  # the call ended under us: same as a close
                pass
            control.close()

        threading.Thread(target=read_rest, daemon=True, name="draft-tree-requests").start()
        for step in self.drafter.grow(propose.session_id, list(propose.new_token_ids), propose.committed_length,
                                      propose.max_nodes, control, start.provisional_max,
                                      [features_from_pb(f) for f in propose.features], list(start.given_token_ids)):
            yield growth_to_pb(step)

    @grpc_errors
    def EndSession(self, request, context):
        self.sweeper.forget(request.session_id)
        self.drafter.end(request.session_id)
        return draft_pb2.EndSessionResponse()


SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


def registration(servicer: DraftServicer):
    return servicer, draft_pb2_grpc.add_DraftServiceServicer_to_server, SERVICE_NAME
