"""OrchestratorService over gRPC: protobuf in, Orchestrator.generate, protobuf chunks out."""

from __future__ import annotations

import threading

from orchestrator.generation import GenerationRequest, Orchestrator
from orchestrator.requests import check_id
from specsplit.errors import SpecSplitError, made_no_session
from specsplit.rpc import chunk_to_pb, sampling_from_pb
from specsplit.serving import grpc_errors
from specsplit.v1 import orchestrator_pb2, orchestrator_pb2_grpc


def request_from_pb(orchestrator: Orchestrator, msg: orchestrator_pb2.GenerateRequest) -> GenerationRequest:
    if msg.resume_session_id:  # everything else comes from the session store
        check_id("resume_session_id", msg.resume_session_id)
        return GenerationRequest([], 0, resumable=True, resume_session_id=msg.resume_session_id,
                                 resume_from_token=msg.resume_from_token)
    prompt_ids = orchestrator.prompt_token_ids(
        prompt=msg.prompt,
        messages=[{"role": m.role, "content": m.content} for m in msg.messages],
        token_ids=list(msg.prompt_token_ids),
        chat_template=not msg.no_chat_template,
    )
    return GenerationRequest(
        prompt_token_ids=prompt_ids,
        max_new_tokens=msg.max_new_tokens if msg.HasField("max_new_tokens") else orchestrator.config.default_new_tokens(),
        stop=list(msg.stop),
        draft=msg.draft or "auto",
        session_id=msg.session_id,
        sampling=sampling_from_pb(msg.sampling),
        resumable=msg.resumable,
    )


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    def __init__(self, orchestrator: Orchestrator):
        self.orchestrator = orchestrator

    @grpc_errors
    def Generate(self, request, context):
        cancelled = threading.Event()
        context.add_callback(cancelled.set)  # the client went away: stop, and release downstream sessions
        try:
            generate = request_from_pb(self.orchestrator, request)
        except SpecSplitError as err:  # (tokenizing a start needs the verifier's context length: it may be unreachable)
            raise err if request.resume_session_id else made_no_session(err)
        generation = self.orchestrator.generate(generate, cancelled)
        try:
            for chunk in generation:
                yield chunk_to_pb(chunk)
        finally:
            generation.close()

    @grpc_errors
    def Cancel(self, request, context):
        check_id("session_id", request.session_id)
        return orchestrator_pb2.CancelResponse(cancelled=self.orchestrator.cancel(request.session_id))


SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"].full_name


def registration(servicer: OrchestratorServicer):
    return servicer, orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server, SERVICE_NAME
