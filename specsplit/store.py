"""Session state that outlives any one process: what a generation needs to continue elsewhere.

The orchestrator writes a ``SessionState`` after every verification round. Every write is a
compare-and-set on the session's ``round`` (the fencing token): a write of round r succeeds only if the
store holds round r - 1, so a stale orchestrator or a retried request can never overwrite newer state;
the loser gets ``StaleRound`` and must reload. Keys expire (TTL, refreshed on every write).

``InMemoryStore`` is the embedded default (one process, a dict and a lock); ``RedisStore`` shares state
between orchestrators (a Lua script does the compare-and-set atomically). ``open_store(url)`` picks one.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Protocol

from opentelemetry import trace

from specsplit.errors import FailedPrecondition, InvalidArgument, StaleRound, Unavailable
from specsplit.sampling import SamplingParams

tracer = trace.get_tracer(__name__)
RUNNING, DETACHED, FINISHED, CANCELLED = "running", "detached", "finished", "cancelled"
TERMINAL = (FINISHED, CANCELLED)


@dataclass
class SessionState:
    session_id: str
    prompt_token_ids: list[int]  # [P] what the target saw
    max_new_tokens: int  # already clipped to the model's context
    sampling: SamplingParams  # as requested
    seed: int  # per-round randomness: the request's seed, or one drawn at start (so a new replica continues)
    stop: list[str] = field(default_factory=list)
    draft: str = "auto"  # the request's draft choice
    committed_token_ids: list[int] = field(default_factory=list)  # [G'] after the prompt (may run past a stop)
    generated: int = 0  # committed tokens handed to the client stream (<= G')
    controller: dict = field(default_factory=dict)  # BudgetController state (the adaptive draft budget)
    draft_down_until: int = 0  # round until which the draft is skipped after a failure (0: healthy)
    verifier: str = ""  # replica address holding the KV cache ("" none)
    verifier_length: int = 0  # committed length of the cache there
    kv_length: int = 0  # committed length of an offloaded KV cache in the store (0: none)
    round: int = 0  # fencing token: +1 on every write
    rounds: int = 0  # verification rounds run
    status: str = RUNNING  # running, detached (client gone, resumable), finished, cancelled
    finish_reason: str = ""
    resumable: bool = False  # a dropped stream detaches instead of cancelling
    owner: str = ""  # the request that last wrote (diagnostics; makes a retried identical write idempotent)

    @property
    def token_ids(self) -> list[int]:
        """[P + G'] prompt + committed."""
        return self.prompt_token_ids + self.committed_token_ids

    def copy(self) -> "SessionState":
        return replace(self, prompt_token_ids=list(self.prompt_token_ids), stop=list(self.stop),
                       committed_token_ids=list(self.committed_token_ids), controller=dict(self.controller))

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "SessionState":
        data = json.loads(text)
        known = SamplingParams.__dataclass_fields__  # (a field a later version added is dropped, not a TypeError)
        data["sampling"] = SamplingParams(**{k: v for k, v in data["sampling"].items() if k in known})
        return cls(**data)


class SessionStore(Protocol):
    def create(self, state: SessionState) -> None:
        """Write a new session (its ``round`` must be 1); FailedPrecondition if the id exists."""

    def load(self, session_id: str) -> SessionState | None:
        """The stored state (a copy), or None if unknown or expired."""

    def commit(self, state: SessionState, after: int | None = None) -> None:
        """Write ``state`` if the store holds round ``after`` (default ``state.round - 1``; 0: no session), else raise
        StaleRound."""

    def delete(self, session_id: str) -> None: ...

    def put_kv(self, session_id: str, committed_length: int, blob: bytes) -> None:
        """Keep an offloaded KV cache (for ``committed_length`` tokens) next to the session."""

    def get_kv(self, session_id: str) -> tuple[int, bytes] | None: ...

    def drop_kv(self, session_id: str) -> None: ...


@dataclass
class StoreConfig:
    ttl_s: float = 600.0  # an abandoned session (client and orchestrator gone) is forgotten after 10 min
    finished_ttl_s: float = 60.0  # a finished session stays so a client that lost the last chunk can resume


def update(store: SessionStore, session_id: str, mutate: Callable[[SessionState], bool | None],
           attempts: int = 5) -> SessionState | None:
    """Load, apply ``mutate`` (returning False: nothing to write), commit; on StaleRound retry from fresh state."""
    for attempt in range(attempts):
        state = store.load(session_id)
        if state is None:
            return None
        if mutate(state) is False:
            return state
        state.round += 1
        try:
            store.commit(state)
            return state
        except StaleRound:
            if attempt == attempts - 1:
                raise
    return None


class InMemoryStore:
    """One process's sessions: a dict under a lock. Copies on the way in and out, like a real store."""

    def __init__(self, config: StoreConfig | None = None):
        self.config = config or StoreConfig()
        self._lock = threading.Lock()
        self._states: dict[str, tuple[SessionState, float]] = {}  # id -> (state, expires at)
        self._kv: dict[str, tuple[int, bytes, float]] = {}
        self._writes = 0

    def _expires(self, state: SessionState) -> float:
        ttl = self.config.finished_ttl_s if state.status in TERMINAL else self.config.ttl_s
        return time.monotonic() + ttl

    def _get(self, session_id: str) -> SessionState | None:
        entry = self._states.get(session_id)
        if entry is None or entry[1] < time.monotonic():
            self._states.pop(session_id, None)
            return None
        return entry[0]

    def create(self, state: SessionState) -> None:
        with self._lock:
            if self._get(state.session_id) is not None:
                raise FailedPrecondition(f"session {state.session_id!r} already exists; resume it "
                                         "(resume_session_id) or use a new session id")
            self._put(state)

    def load(self, session_id: str) -> SessionState | None:
        with self._lock:
            state = self._get(session_id)
            return state.copy() if state is not None else None

    def commit(self, state: SessionState, after: int | None = None) -> None:
        after = state.round - 1 if after is None else after
        with self._lock:
            stored = self._get(state.session_id)
            stored_round = stored.round if stored is not None else 0
            if stored_round != after:
                raise StaleRound(state.session_id, after, stored_round)
            self._put(state)

    def _put(self, state: SessionState) -> None:
        self._states[state.session_id] = (state.copy(), self._expires(state))
        self._writes += 1
        if self._writes % 256 == 0:  # forget expired sessions now and then
            now = time.monotonic()
            for key in [k for k, (_, t) in self._states.items() if t < now]:
                del self._states[key]
            for key in [k for k, (_, _, t) in self._kv.items() if t < now]:
                del self._kv[key]

    def delete(self, session_id: str) -> None:
        with self._lock:
            self._states.pop(session_id, None)
            self._kv.pop(session_id, None)

    def put_kv(self, session_id: str, committed_length: int, blob: bytes) -> None:
        with self._lock:
            self._kv[session_id] = (committed_length, blob, time.monotonic() + self.config.ttl_s)

    def get_kv(self, session_id: str) -> tuple[int, bytes] | None:
        with self._lock:
            entry = self._kv.get(session_id)
            return None if entry is None or entry[2] < time.monotonic() else entry[:2]

    def drop_kv(self, session_id: str) -> None:
        with self._lock:
            self._kv.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._states)


# KEYS[1]: the session hash. ARGV: expected round, new round, state JSON, TTL in ms.
# Returns {1, round} on success, {0, stored round} when another writer got there first. A retried
# write whose first attempt landed (reply lost) finds its own state in place and succeeds again.
_CAS = """
local stored = redis.call('HGET', KEYS[1], 'round')
if not stored then stored = '0' end
if stored ~= ARGV[1] then
  if stored == ARGV[2] and redis.call('HGET', KEYS[1], 'state') == ARGV[3] then return {1, stored} end
  return {0, stored}
end
redis.call('HSET', KEYS[1], 'round', ARGV[2], 'state', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {1, ARGV[2]}
"""


class RedisStore:
    """Sessions in Redis: ``<prefix>:session:<id>`` (hash: round, state JSON) and ``<prefix>:kv:<id>``."""

    def __init__(self, url: str, config: StoreConfig | None = None, prefix: str = "specsplit",
                 retry_s: float = 5.0):
        """retry_s: how long a call keeps retrying while Redis is unreachable before UNAVAILABLE."""
        try:
            import redis
        except ImportError:
            raise FailedPrecondition("a Redis session store needs the redis package: pip install 'specsplit[redis]'") from None

        self.url = redacted(url)  # (for messages: errors reach clients and traces)
        self.config = config or StoreConfig()
        self.prefix = prefix
        self.retry_s = retry_s
        self._errors = (redis.ConnectionError, redis.TimeoutError)
        self._redis = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=2.0)
        self._cas = self._redis.register_script(_CAS)

    def _key(self, kind: str, session_id: str) -> str:
        return f"{self.prefix}:{kind}:{session_id}"

    def _call(self, operation: str, fn):
        """fn() against Redis, retried while Redis is unreachable; a CLIENT span per operation (its retries as an
        attribute: a round's time in the store shows in its trace)."""
        deadline = time.monotonic() + self.retry_s
        delay, retries = 0.05, 0
        with tracer.start_as_current_span(f"specsplit.store.{operation}", kind=trace.SpanKind.CLIENT,
                                          attributes={"db.system.name": "redis", "db.operation.name": operation}) as span:
            while True:
                try:
                    return fn()
                except self._errors as err:
                    if time.monotonic() + delay > deadline:
                        raise Unavailable(f"session store {self.url} is unreachable: {err}") from None
                    time.sleep(delay)
                    delay, retries = min(delay * 2, 1.0), retries + 1
                    span.set_attribute("specsplit.retries", retries)

    def _ttl_ms(self, state: SessionState) -> int:
        return int(1000 * (self.config.finished_ttl_s if state.status in TERMINAL else self.config.ttl_s))

    def _write(self, state: SessionState, expected_round: int) -> tuple[bool, int]:
        ok, stored = self._call("write", lambda: self._cas(keys=[self._key("session", state.session_id)],
                                                  args=[expected_round, state.round, state.to_json(),
                                                        self._ttl_ms(state)]))
        return bool(ok), int(stored)

    def create(self, state: SessionState) -> None:
        ok, _ = self._write(state, 0)
        if not ok:
            raise FailedPrecondition(f"session {state.session_id!r} already exists; resume it "
                                     "(resume_session_id) or use a new session id")

    def load(self, session_id: str) -> SessionState | None:
        raw = self._call("load", lambda: self._redis.hget(self._key("session", session_id), "state"))
        return SessionState.from_json(raw) if raw is not None else None

    def commit(self, state: SessionState, after: int | None = None) -> None:
        after = state.round - 1 if after is None else after
        ok, stored = self._write(state, after)
        if not ok:
            raise StaleRound(state.session_id, after, stored)

    def delete(self, session_id: str) -> None:
        self._call("delete", lambda: self._redis.delete(self._key("session", session_id), self._key("kv", session_id)))

    def put_kv(self, session_id: str, committed_length: int, blob: bytes) -> None:
        key = self._key("kv", session_id)

        def put():
            pipe = self._redis.pipeline(transaction=True)
            pipe.hset(key, mapping={"length": committed_length, "data": blob})
            pipe.pexpire(key, int(1000 * self.config.ttl_s))
            pipe.execute()

        self._call("put_kv", put)

    def get_kv(self, session_id: str) -> tuple[int, bytes] | None:
        length, blob = self._call("get_kv", lambda: self._redis.hmget(self._key("kv", session_id), ["length", "data"]))
        return None if blob is None else (int(length), bytes(blob))

    def drop_kv(self, session_id: str) -> None:
        self._call("drop_kv", lambda: self._redis.delete(self._key("kv", session_id)))

    def ping(self) -> bool:
        return bool(self._call("ping", self._redis.ping))

    def unreachable(self) -> str | None:
        """Why Redis does not answer now (one try, no retries), or None if it does."""
        try:
            self._redis.ping()
        except self._errors as err:
            return str(err)
        return None


def redacted(url: str) -> str:
    """A store URL without its password (``redis://user:***@host:6379/0``, ``?password=***``): what an error, a log
    line or a trace may show. (A store's errors reach every client, as gRPC details, and the tracing backend.)"""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        netloc = f"{userinfo.split(':', 1)[0]}:***@{host}" if ":" in userinfo else netloc
    query = urllib.parse.urlencode([(k, "***" if k == "password" else v)
                                    for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)], safe="*/")
    if netloc == parts.netloc and "password=" not in parts.query:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))


def open_store(url: str | None, config: StoreConfig | None = None) -> SessionStore:
    """``None``/"" or "memory://": in this process; "redis://host:port/db": shared through Redis."""
    if not url or url == "memory://":
        return InMemoryStore(config)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(url, config)
    raise InvalidArgument(f"unknown session store URL {redacted(url)!r}: use redis://HOST:PORT/DB or leave it empty")
