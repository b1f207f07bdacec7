"""The draft side's core: sessions, their committed tokens, and a proposer that drafts trees."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from opentelemetry import trace

from draft_service.proposers import Proposer
from specsplit.growth import GrowthStep
from specsplit.errors import FailedPrecondition, InvalidArgument, NotFound
from specsplit.features import Features
from specsplit.sampling import SamplingParams
from specsplit.tree import TokenTree

tracer = trace.get_tracer(__name__)
END_WAIT_S = 2.0  # an ended session's last round that holds it longer leaves its state unreusable
TURN_WAIT_S = 5.0  # a round that reached its session before the round sent ahead of it waits this long for it


@dataclass
class DraftSession:
    token_ids: list[int]  # committed tokens: prompt + generated
    stop_token_ids: tuple[int, ...] = ()  # the target's EOS ids: a grown branch ends at one
    # held by the running round; notified when a round adds its tokens or ends
    lock: threading.Condition = field(default_factory=lambda: threading.Condition(threading.Lock()))
    rounds: int = 0  # rounds that reached the session and have not ended (under ``_count``)
    _count: threading.Lock = field(default_factory=threading.Lock)

    @contextmanager
    def turn(self):
        """One round's hold on the session: its lock, the round counted while it waits and runs."""
        with self._count:
            self.rounds += 1
        try:
            with self.lock:
                yield
        finally:
            with self._count:
                self.rounds -= 1
            with self.lock:
                self.lock.notify_all()  # a round waiting for the tokens of this one gives up once no other is left


class Drafter:
    def __init__(self, proposer: Proposer, max_nodes: int = 64):
        self.proposer = proposer
        self.max_nodes = max_nodes
        self._sessions: dict[str, DraftSession] = {}

    def start(self, session_id: str, prompt_token_ids: list[int], tokenizer_fingerprint: str,
              sampling: SamplingParams | None = None, target_identity: str = "", stop_token_ids=()) -> None:
        if not session_id:
            raise InvalidArgument("session_id is empty")
        if not prompt_token_ids:
            raise InvalidArgument("prompt is empty: give at least one token")
        mine = self.proposer.tokenizer_fingerprint
        if mine and tokenizer_fingerprint != mine:
            raise FailedPrecondition(
                f"tokenizer mismatch: this draft's tokenizer has fingerprint {mine}, the verifier's is "
                f"{tokenizer_fingerprint or '(none given)'}; a draft must share the target's tokenizer"
            )
        trained_for = getattr(self.proposer, "target_identity", "")
        if trained_for and target_identity != trained_for:
            raise FailedPrecondition(
                f"draft artifact {getattr(self.proposer, 'artifact', '')!r} was trained for target {trained_for}; "
                f"the verifier serves {target_identity or '(an unnamed target)'}: it reads that model's features; "
                "pair it with its own target or train one for this target"
            )
        sampling = sampling or SamplingParams()
        sampling.check_seeded()
        self._sessions[session_id] = DraftSession(list(prompt_token_ids), tuple(stop_token_ids))
        self.proposer.start(session_id, list(prompt_token_ids), sampling)

    def propose(self, session_id: str, new_token_ids: list[int], committed_length: int, max_nodes: int,
                features: list[Features] = ()) -> tuple[TokenTree, float]:
        """features: the target's features the verifier returned since the previous call (feature drafters)."""
        session = self._session(session_id)
        with session.turn():
            self._extend(session_id, session, new_token_ids, committed_length)
            start = time.perf_counter()
            with tracer.start_as_current_span("specsplit.draft.propose") as span:
                self._add_features(session_id, features, span)
                tree = self.proposer.propose(session_id, session.token_ids, min(max_nodes, self.max_nodes),
                                             session.stop_token_ids)
                span.set_attribute("specsplit.num_draft_tokens", len(tree))
            return tree, (time.perf_counter() - start) * 1e3

    def grow(self, session_id: str, new_token_ids: list[int], committed_length: int, max_nodes: int,
             control: "GrowthControl", provisional_max: int = 0, features: list[Features] = (),
             given: list[int] = ()) -> Iterator[GrowthStep]:
        """A DraftTree round: the proposer's growth steps (a proposer without ``grow``: its tree, in one step).
        features: as for ``propose``. given: a chain verified in place of a grown tree (a copied span), which the
        proposer runs and drafts provisionally on from (only proposers that take ``given``)."""
        if given and not getattr(self.proposer, "grows_from_given", False):
            raise InvalidArgument(f"draft {self.proposer.name!r} cannot draft on from a given chain")
        session = self._session(session_id)
        with session.turn():  # the next round of this session waits until this one has finished its forward
            self._extend(session_id, session, new_token_ids, committed_length)
            budget = min(max_nodes, self.max_nodes)
            with tracer.start_as_current_span("specsplit.draft.grow") as span:
                self._add_features(session_id, features, span)
                grow = getattr(self.proposer, "grow", None)
                if grow is None:
                    start = time.perf_counter()
                    tree = self.proposer.propose(session_id, session.token_ids, budget, session.stop_token_ids)
                    yield GrowthStep(0, tree.token_ids, tree.parents, tree.draft_probs, done=True,
                                     draft_ms=(time.perf_counter() - start) * 1e3)
                    return
                nodes = provisional = 0
                options = {"given": list(given)} if given else {}
                for step in grow(session_id, session.token_ids, budget, control, provisional_max,
                                 stop_token_ids=session.stop_token_ids, **options):
                    if step.provisional:
                        provisional += len(step.token_ids)
                    else:
                        nodes += len(step.token_ids)
                    yield step
                span.set_attribute("specsplit.num_draft_tokens", nodes)
                span.set_attribute("specsplit.num_provisional", provisional)

    def _add_features(self, session_id: str, features: list[Features], span) -> None:
        if features and getattr(self.proposer, "wants_features", False):
            self.proposer.add_features(session_id, features)
            span.set_attribute("specsplit.feature_bytes", sum(f.nbytes for f in features))

    def _session(self, session_id: str) -> DraftSession:
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"unknown draft session {session_id!r}: call StartSession first")
        return session

    @staticmethod
    def _extend(session_id: str, session: DraftSession, new_token_ids: list[int], committed_length: int) -> None:
        """Add a round's newly committed tokens (``session.lock`` held), in the order the orchestrator sent the rounds:
        each call runs on its own handler thread and the lock is not first come first served, so a round can reach
        the session before the one sent ahead of it (both waiting out a long forward of the round before them, as a
        cold draft's first is). It then waits, up to TURN_WAIT_S, until the session holds what the round builds on,
        while another round of the session is on its way (with none, the request is wrong: it fails at once)."""
        before = committed_length - len(new_token_ids)
        session.lock.wait_for(lambda: len(session.token_ids) >= before or session.rounds < 2, TURN_WAIT_S)
        if len(session.token_ids) != before:
            raise FailedPrecondition(
                f"draft session {session_id!r} has {len(session.token_ids)} committed tokens; "
                f"{len(new_token_ids)} new ones make {len(session.token_ids) + len(new_token_ids)}, "
                f"not the {committed_length} the request says"
            )
        session.token_ids.extend(new_token_ids)
        session.lock.notify_all()

    def num_sessions(self) -> int:
        return len(self._sessions)

    def end(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is None:
            self.proposer.end(session_id)
            return
        idle = threading.Event()  # set once no round of the session runs (its state may then be reused)
        self.proposer.end(session_id, idle)
        if session.lock.acquire(blocking=False):
            idle.set()
            session.lock.release()
        else:  # its last round is still finishing a forward (the orchestrator ends a session once it has its tokens)
            threading.Thread(target=_set_when_free, args=(session.lock, idle), daemon=True, name="draft-end").start()


def _set_when_free(lock: threading.Condition, idle: threading.Event) -> None:
    if lock.acquire(timeout=END_WAIT_S):
        idle.set()
        lock.release()


class GrowthControl:
    """What the orchestrator said during a DraftTree round; set by the thread reading its requests."""

    def __init__(self):
        self._cond = threading.Condition()
        self.verifying: int | None = None  # nodes sent for verification
        self.closed = False  # the orchestrator ended the round (or went away)
        self.committed: list[int] | None = None  # [C] the verdict's committed tokens, when the round ended on one

    def verify(self, num_nodes: int) -> None:
        with self._cond:
            if self.verifying is None:
                self.verifying = num_nodes
            self._cond.notify_all()

    def conclude(self, committed: list[int]) -> None:
        """The verdict came: the round is over, its committed tokens these."""
        self.committed = list(committed)
        self.close()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.verifying is not None or self.closed, timeout)
