"""The one place protobuf meets the core: conversions, plus typed client adapters that speak
domain objects (the orchestrator's view of a draft or verifier service)."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.accept import Verdict
from specsplit.serving import open_channel
from specsplit.errors import InvalidArgument
from specsplit.features import Features
from specsplit.sampling import SamplingParams
from specsplit.stream import Chunk, RoundStats
from specsplit.tls import call_failure
from specsplit.tree import GrowthStep, SparseDist, TokenTree
from specsplit.v1 import common_pb2, draft_pb2, draft_pb2_grpc, orchestrator_pb2, verifier_pb2, verifier_pb2_grpc

KV_CHUNK = 1 << 20  # an imported KV cache travels in 1 MiB pieces
VERIFIER_SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name


def tree_to_pb(tree: TokenTree) -> common_pb2.TokenTree:
    msg = common_pb2.TokenTree(token_ids=tree.token_ids, parents=tree.parents, draft_probs=tree.draft_probs)
    if any(q is not None for q in tree.node_q):
        offsets = [0]
        for q in tree.node_q:
            if q is not None:
                msg.q_token_ids.extend(q.token_ids)
                msg.q_probs.extend(q.probs)
            offsets.append(len(msg.q_token_ids))
        msg.q_offsets.extend(offsets)
    return msg


def tree_from_pb(msg: common_pb2.TokenTree) -> TokenTree:
    node_q: tuple = ()
    n = len(msg.token_ids)
    if msg.q_offsets:
        off = list(msg.q_offsets)
        if len(off) != n + 1 or off[0] != 0 or off[-1] != len(msg.q_token_ids) or len(msg.q_probs) != off[-1] \
                or any(a > b for a, b in zip(off, off[1:])):
            raise InvalidArgument(f"malformed tree: q_offsets must have num_nodes + 1 = {n + 1} non-decreasing "
                                  f"entries from 0 to len(q_token_ids) = {len(msg.q_token_ids)} = len(q_probs)")
        node_q = tuple(SparseDist(tuple(msg.q_token_ids[a:b]), tuple(msg.q_probs[a:b])) if b > a else None
                       for a, b in zip(off, off[1:]))
    return TokenTree(tuple(msg.token_ids), tuple(msg.parents), tuple(msg.draft_probs), node_q)


def features_to_pb(features: Features) -> common_pb2.Features:
    return common_pb2.Features(data=features.to_bytes(), num_positions=features.num_positions,
                               hidden_size=features.hidden_size, first_position=features.first_position)


def features_from_pb(msg: common_pb2.Features) -> Features:
    return Features.from_bytes(msg.data, msg.num_positions, msg.hidden_size, msg.first_position)
def growth_to_pb(step: GrowthStep) -> draft_pb2.TreeGrowth:
    return draft_pb2.TreeGrowth(first=step.first, token_ids=step.token_ids, parents=step.parents,
                                draft_probs=step.draft_probs, provisional=step.provisional, done=step.done,
                                seeded=step.seeded, draft_ms=step.draft_ms)


def growth_from_pb(msg: draft_pb2.TreeGrowth) -> GrowthStep:
    return GrowthStep(msg.first, tuple(msg.token_ids), tuple(msg.parents), tuple(msg.draft_probs), msg.provisional,
                      msg.done, msg.seeded, msg.draft_ms)


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                    rejection=params.rejection)
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def sampling_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(msg.temperature, msg.top_k, msg.top_p or 1.0, msg.seed if msg.HasField("seed") else None,
                          msg.rejection)


@dataclass(frozen=True)
class VerifyTiming:
    verify_ms: float  # arrival to answer in the verifier, queueing included
    queue_ms: float = 0.0  # of which waiting for the batch it rode in
    cost_ms: float = 0.0  # its share of the batched forward (0: the verifier did not say)
    call_ms: float = 0.0  # the caller's wall time of the Verify: verify_ms + network + serialization (0: not timed)
    busy_ms: float = 0.0  # of verify_ms, the verifier's model working, not idling (0: not said)


def verdict_to_pb(verdict: Verdict, committed_length: int, timing: VerifyTiming, features: Features | None = None,
                  proposal: TokenTree | None = None) -> verifier_pb2.VerifyResponse:
    msg = verifier_pb2.VerifyResponse(
        accepted_token_ids=verdict.accepted_token_ids, accepted_node_indices=verdict.accepted_nodes,
        next_token_id=verdict.next_token_id, decoded_token_ids=verdict.decoded_token_ids,
        committed_length=committed_length,
        verify_ms=timing.verify_ms, queue_ms=timing.queue_ms, cost_ms=timing.cost_ms, busy_ms=timing.busy_ms,
    )
    if features is not None:
        msg.features.CopyFrom(features_to_pb(features))
    if proposal is not None:
        msg.proposal.CopyFrom(tree_to_pb(proposal))
    return msg


def prefill_to_pb(committed_length: int, prefill_ms: float, features: Features | None = None,
                  proposal: TokenTree | None = None, copied_tokens: int = 0) -> verifier_pb2.PrefillResponse:
    msg = verifier_pb2.PrefillResponse(committed_length=committed_length, prefill_ms=prefill_ms,
                                       copied_tokens=copied_tokens)
    if features is not None:
        msg.features.CopyFrom(features_to_pb(features))
    if proposal is not None:
        msg.proposal.CopyFrom(tree_to_pb(proposal))
    return msg


@dataclass(frozen=True)
class VerifierReply:
    """What a Prefill or Verify answered besides the verdict: features and a Medusa proposal, if asked."""

    committed_length: int
    features: Features | None = None
    proposal: TokenTree | None = None
    verdict: Verdict | None = None  # Verify only
    timing: VerifyTiming | None = None  # Verify only
    prefill_ms: float = 0.0  # Prefill only: arrival to answer in the verifier, queueing included
    copied_tokens: int = 0  # Prefill only: prompt tokens copied from a kept prompt, not computed


def _extras_from_pb(msg) -> tuple[Features | None, TokenTree | None]:
    features = features_from_pb(msg.features) if msg.HasField("features") else None
    proposal = tree_from_pb(msg.proposal) if msg.HasField("proposal") else None
    return features, proposal


def verdict_from_pb(msg: verifier_pb2.VerifyResponse) -> Verdict:
    return Verdict(tuple(msg.accepted_node_indices), tuple(msg.accepted_token_ids), msg.next_token_id,
                   tuple(msg.decoded_token_ids))


def chunk_to_pb(chunk: Chunk) -> orchestrator_pb2.GenerateChunk:
    msg = orchestrator_pb2.GenerateChunk(text=chunk.text, token_ids=chunk.token_ids, session_id=chunk.session_id,
                                         prompt_token_ids=chunk.prompt_token_ids or [],
                                         finish_reason=chunk.finish_reason)
    if chunk.stats is not None:
        st = chunk.stats
        msg.stats.CopyFrom(common_pb2.RoundStats(
            round=st.round, num_draft_tokens=st.num_draft_tokens, num_accepted=st.num_accepted,
            num_committed=st.num_committed, draft_ms=st.draft_ms, verify_ms=st.verify_ms, drafter=st.drafter,
            tree_depth=st.tree_depth, feature_bytes=st.feature_bytes, wasted=st.wasted, provisional_kept=st.provisional_kept,
            num_decoded=st.num_decoded))
    return msg


def generate_request_to_pb(prompt, messages, prompt_token_ids, max_new_tokens, temperature, top_k, top_p, seed, stop,
                           draft, chat_template, session_id, resumable=False, rejection_sampling=False):
    for m in messages or ():  # checked here: past this point a malformed message is a protobuf or KeyError
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"a chat message is a dict with str 'role' and 'content', got {m!r}")
    if seed is not None and not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    # The int32 fields (protobuf's own range error names none of them).
    for name, values in (("max_new_tokens", [max_new_tokens]), ("top_k", [top_k]),
                         ("prompt_token_ids", prompt_token_ids or ())):
        bad = [v for v in values if v is not None and not -2**31 <= v < 2**31]
        if bad:
            raise ValueError(f"{name} must fit in 32 bits, got {bad[0]}")
    msg = orchestrator_pb2.GenerateRequest(
        prompt=prompt or "",
        messages=[orchestrator_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()],
        prompt_token_ids=list(prompt_token_ids or ()),
        no_chat_template=not chat_template,
        sampling=sampling_to_pb(SamplingParams(temperature, top_k, top_p, seed, rejection_sampling)),
        stop=[stop] if isinstance(stop, str) else list(stop or ()),  # (one string is one stop string, not its letters)
        draft=draft,
        session_id=session_id,
        resumable=resumable,
    )
    if max_new_tokens is not None:
        msg.max_new_tokens = max_new_tokens
    return msg


def chunk_from_pb(msg: orchestrator_pb2.GenerateChunk) -> Chunk:
    stats = None
    if msg.HasField("stats"):
        st = msg.stats
        stats = RoundStats(st.round, st.num_draft_tokens, st.num_accepted, st.num_committed, st.draft_ms,
                           st.verify_ms, st.drafter, st.tree_depth, st.feature_bytes, st.wasted, st.provisional_kept,
                           st.num_decoded)
    return Chunk(msg.text, list(msg.token_ids), stats, msg.session_id, list(msg.prompt_token_ids) or None,
                 msg.finish_reason)


@dataclass(frozen=True)
class VerifierInfo:
    model: str
    tokenizer_fingerprint: str
    vocab_size: int
    max_context: int
    max_tree_nodes: int
    eos_token_ids: tuple[int, ...]
    num_sessions: int = 0  # sessions holding a KV cache there when asked
    target_identity: str = ""  # the exact target weights (a trained draft's manifest must name them)
    medusa: str = ""  # the Medusa heads' artifact name ("": no self-speculation there)
    medusa_max_nodes: int = 0
    max_decode_steps: int = 0  # tokens a Verify decodes alone at most (0: not said, a verifier from before it did)


@dataclass(frozen=True)
class DraftInfo:
    drafter: str
    model: str
    tokenizer_fingerprint: str
    max_nodes: int
    wants_features: bool = False  # forward the verifier's features with each Propose
    target_identity: str = ""  # the target it was trained for ("": any)


class Unresponsive(grpc.RpcError):
    """A call cut short (``RemoteVerifier.cut_calls``): its replica stopped answering health checks (hung, or the
    link to it partitioned, where a call would otherwise wait out its whole deadline). UNAVAILABLE: a failover."""

    def __init__(self, address: str):
        super().__init__()
        self._details = f"verifier replica {address} stopped answering health checks; the call was cut short"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details

    __str__ = details


class RemoteVerifier:
    def __init__(self, address: str):
        self.address = address
        self.channel = open_channel(address)
        self.stub = verifier_pb2_grpc.VerifierServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.health_error = ""  # why the last health check failed (specsplit.tls.call_failure)
        self._calls: set = set()  # Prefill and Verify calls in flight (``cut_calls`` ends them)
        self._calls_lock = threading.Lock()

    def _call(self, method, request, timeout: float):
        """A unary call that ``cut_calls`` can end before its deadline (then ``Unresponsive``)."""
        future = method.future(request, timeout=timeout)
        with self._calls_lock:
            self._calls.add(future)
        try:
            return future.result()
        except grpc.FutureCancelledError:
            raise Unresponsive(self.address) from None
        finally:
            with self._calls_lock:
                self._calls.discard(future)

    def cut_calls(self) -> int:
        """End the Prefill and Verify calls in flight (they raise ``Unresponsive``); how many there were."""
        with self._calls_lock:
            calls = list(self._calls)
        for call in calls:
            call.cancel()
        return len(calls)

    def info(self, timeout: float) -> VerifierInfo:
        r = self.stub.GetInfo(verifier_pb2.VerifierInfoRequest(), timeout=timeout)
        return VerifierInfo(r.model, r.tokenizer_fingerprint, r.vocab_size, r.max_context, r.max_tree_nodes,
                            tuple(r.eos_token_ids), r.num_sessions, r.target_identity, r.medusa, r.medusa_max_nodes,
                            r.max_decode_steps)

    def healthy(self, timeout: float) -> bool:
        """grpc.health.v1 says the verifier service is SERVING."""
        try:
            r = self.health_stub.Check(health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE), timeout=timeout)
        except grpc.RpcError as err:
            self.health_error = call_failure(err)
            return False
        self.health_error = "" if r.status == health_pb2.HealthCheckResponse.SERVING else "NOT_SERVING"
        return not self.health_error

    def prefill(self, session_id: str, prompt_token_ids: list[int], timeout: float,
                sampling: SamplingParams | None = None) -> int:
        return self.prefill_reply(session_id, prompt_token_ids, timeout, sampling).committed_length

    def prefill_reply(self, session_id: str, prompt_token_ids: list[int], timeout: float,
                      sampling: SamplingParams | None = None, return_features: bool = False,
                      medusa: bool = False) -> VerifierReply:
        r = self._call(self.stub.Prefill,
                       verifier_pb2.PrefillRequest(session_id=session_id, prompt_token_ids=prompt_token_ids,
                                                   sampling=sampling_to_pb(sampling or SamplingParams()),
                                                   return_features=return_features, medusa=medusa), timeout)
        return VerifierReply(r.committed_length, *_extras_from_pb(r), prefill_ms=r.prefill_ms,
                             copied_tokens=r.copied_tokens)

    def verify(self, session_id: str, tree: TokenTree, expected_committed_length: int, max_commit: int,
               timeout: float, decode_steps: int = 0) -> tuple[Verdict, VerifyTiming]:
        reply = self.verify_reply(session_id, tree, expected_committed_length, max_commit, timeout, decode_steps)
        return reply.verdict, reply.timing

    def verify_reply(self, session_id: str, tree: TokenTree, expected_committed_length: int, max_commit: int,
                     timeout: float, decode_steps: int = 0) -> VerifierReply:
        """decode_steps: after the verdict the target decodes alone up to this many more tokens (a burst)."""
        start = time.perf_counter()
        r = self._call(self.stub.Verify,
                       verifier_pb2.VerifyRequest(session_id=session_id, tree=tree_to_pb(tree),
                                                  expected_committed_length=expected_committed_length,
                                                  max_commit=max_commit, decode_steps=decode_steps), timeout)
        return VerifierReply(r.committed_length, *_extras_from_pb(r), verdict_from_pb(r),
                             VerifyTiming(r.verify_ms, r.queue_ms, r.cost_ms, (time.perf_counter() - start) * 1e3,
                                          r.busy_ms))

    def release(self, session_id: str, timeout: float) -> bool:
        return self.stub.Release(verifier_pb2.ReleaseRequest(session_id=session_id), timeout=timeout).released

    def export_session(self, session_id: str, expected_committed_length: int, timeout: float, dtype: str = "") -> bytes:
        chunks = self.stub.ExportSession(
            verifier_pb2.ExportSessionRequest(session_id=session_id, expected_committed_length=expected_committed_length,
                                              dtype=dtype), timeout=timeout)
        return b"".join(chunk.data for chunk in chunks)

    def import_session(self, session_id: str, token_ids: list[int], blob: bytes, timeout: float,
                       sampling: SamplingParams | None = None, return_features: bool = False,
                       medusa: bool = False) -> int:
        def chunks():
            yield verifier_pb2.KvChunk(session_id=session_id, token_ids=token_ids,
                                       sampling=sampling_to_pb(sampling or SamplingParams()), data=blob[:KV_CHUNK],
                                       return_features=return_features, medusa=medusa)
            for start in range(KV_CHUNK, len(blob), KV_CHUNK):
                yield verifier_pb2.KvChunk(data=blob[start:start + KV_CHUNK])

        return self.stub.ImportSession(chunks(), timeout=timeout).committed_length

    def close(self) -> None:
        self.channel.close()


class RemoteDraft:
    def __init__(self, address: str):
        self.address = address
        self.channel = open_channel(address)
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel)

    def info(self, timeout: float) -> DraftInfo:
        r = self.stub.GetInfo(draft_pb2.DraftInfoRequest(), timeout=timeout)
        return DraftInfo(r.drafter, r.model, r.tokenizer_fingerprint, r.max_nodes, r.wants_features, r.target_identity)

    def start(self, session_id: str, prompt_token_ids: list[int], tokenizer_fingerprint: str, timeout: float,
              sampling: SamplingParams | None = None, target_identity: str = "", stop_token_ids=()) -> None:
        self.stub.StartSession(
            draft_pb2.StartSessionRequest(session_id=session_id, prompt_token_ids=prompt_token_ids,
                                          tokenizer_fingerprint=tokenizer_fingerprint,
                                          sampling=sampling_to_pb(sampling or SamplingParams()),
                                          target_identity=target_identity, stop_token_ids=list(stop_token_ids)),
            timeout=timeout)

    def propose(self, session_id: str, new_token_ids: list[int], committed_length: int, max_nodes: int,
                timeout: float, features: list[Features] = ()) -> tuple[TokenTree, float]:
        r = self.stub.Propose(
            draft_pb2.ProposeRequest(session_id=session_id, new_token_ids=new_token_ids,
                                     committed_length=committed_length, max_nodes=max_nodes,
                                     features=[features_to_pb(f) for f in features]),
            timeout=timeout)
        return tree_from_pb(r.tree), r.draft_ms

    def draft_tree(self, session_id: str, new_token_ids: list[int], committed_length: int, max_nodes: int,
                   provisional_max: int, timeout: float, features: list[Features] = (),
                   given: list[int] = ()) -> "TreeStream":  # given: DraftTreeStart.given_token_ids
        start = draft_pb2.DraftTreeStart(
            propose=draft_pb2.ProposeRequest(session_id=session_id, new_token_ids=new_token_ids,
                                             committed_length=committed_length, max_nodes=max_nodes,
                                             features=[features_to_pb(f) for f in features]),
            provisional_max=provisional_max, given_token_ids=list(given))
        return TreeStream(self.stub, start, timeout)

    def end(self, session_id: str, timeout: float) -> None:
        self.stub.EndSession(draft_pb2.EndSessionRequest(session_id=session_id), timeout=timeout)

    def close(self) -> None:
        self.channel.close()


class TreeStream:
    """One DraftTree round seen from the orchestrator: growth steps arrive on a queue filled by a reader thread."""

    _END = object()

    def __init__(self, stub, start: draft_pb2.DraftTreeStart, timeout: float):
        self._requests: queue.Queue = queue.Queue()
        self._requests.put(draft_pb2.DraftTreeRequest(start=start))
        self._steps: queue.Queue = queue.Queue()
        self.ended = False
        self._call = stub.DraftTree(iter(self._requests.get, None), timeout=timeout)
        threading.Thread(target=self._read, daemon=True, name="draft-tree-reader").start()

    def _read(self) -> None:
        try:
            for msg in self._call:
                self._steps.put(growth_from_pb(msg))
        except grpc.RpcError as err:
            self._steps.put(err)
        self._steps.put(self._END)

    def next(self, timeout: float | None = None) -> GrowthStep | None:
        """The next step (blocking); None when the stream ended. Raises the stream's RpcError."""
        if self.ended:
            return None
        item = self._steps.get(timeout=timeout)
        return self._item(item)

    def ready(self) -> list[GrowthStep]:
        """Steps that have already arrived (never blocks)."""
        steps = []
        while not self.ended:
            try:
                item = self._item(self._steps.get_nowait())
            except (queue.Empty, grpc.RpcError):
                break
            if item is None:
                break
            steps.append(item)
        return steps

    def _item(self, item):
        if item is self._END:
            self.ended = True
            return None
        if isinstance(item, grpc.RpcError):
            self.ended = True
            raise item
        return item

    def verifying(self, num_nodes: int) -> None:
        self._requests.put(draft_pb2.DraftTreeRequest(verifying=num_nodes))

    def close(self, committed: list[int] | None = None) -> None:
        """End the round (half-close), on the verdict's ``committed`` tokens when it has one (``DraftVerdict``)."""
        if committed is not None:
            verdict = draft_pb2.DraftVerdict(committed_token_ids=committed)
            self._requests.put(draft_pb2.DraftTreeRequest(verdict=verdict))
        self._requests.put(None)


RpcError, StatusCode = grpc.RpcError, grpc.StatusCode  # (for callers that keep grpc out of their imports)
