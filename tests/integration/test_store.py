"""The session store contract, on both backends: compare-and-set on the round, TTLs, KV blobs.

The Redis backend runs against a private redis-server (tests/redis_server.py); in CI (CI or
SPECSPLIT_REQUIRE_SLOW set) a missing redis-server fails these tests instead of skipping them.
"""

import threading
import time
import uuid

import pytest

from specsplit.errors import FailedPrecondition, StaleRound, Unavailable
from specsplit.sampling import SamplingParams
from specsplit.store import FINISHED, InMemoryStore, RedisStore, SessionState, StoreConfig, open_store, update


def new_state(session_id=None, **kwargs) -> SessionState:
    fields = dict(session_id=session_id or uuid.uuid4().hex, prompt_token_ids=[258, 1, 2, 3], max_new_tokens=32,
                  sampling=SamplingParams(0.7, 20, 0.9, 5), seed=5, stop=["\n\n"], round=1)
    fields.update(kwargs)
    return SessionState(**fields)


@pytest.fixture(params=["memory", "redis"])
def make_store(request):
    def make(config=None):
        if request.param == "memory":
            return InMemoryStore(config)
        server = request.getfixturevalue("redis_server")
        return RedisStore(server.url, config, prefix=f"test-{uuid.uuid4().hex[:8]}")

    return make


def test_create_load_roundtrip(make_store):
    store = make_store()
    state = new_state(committed_token_ids=[7, 8], generated=2, controller={"accepted": 1.5, "verify_ms": {"4": 2.0}},
                      verifier="127.0.0.1:1", verifier_length=6)
    store.create(state)
    loaded = store.load(state.session_id)
    assert loaded == state and loaded is not state
    assert loaded.token_ids == [258, 1, 2, 3, 7, 8]
    assert store.load("nope") is None


def test_create_refuses_a_taken_id(make_store):
    store = make_store()
    state = new_state()
    store.create(state)
    with pytest.raises(FailedPrecondition, match="already exists"):
        store.create(new_state(state.session_id, prompt_token_ids=[258, 9]))


def test_commit_is_compare_and_set_on_the_round(make_store):
    store = make_store()
    state = new_state()
    store.create(state)
    state.round = 2
    state.committed_token_ids.append(9)
    store.commit(state)
    for wrong_round in (2, 4):  # a repeated write, and one from the future
        stale = store.load(state.session_id)
        stale.round = wrong_round
        stale.committed_token_ids.append(99)
        with pytest.raises(StaleRound, match="at round 2, this write expected round") as info:
            store.commit(stale)
        assert isinstance(info.value, FailedPrecondition)  # maps to FAILED_PRECONDITION
    assert store.load(state.session_id).committed_token_ids == [9]


def test_two_racing_writers_one_wins_the_loser_retries_from_fresh_state(make_store):
    store = make_store()
    state = new_state()
    store.create(state)
    barrier = threading.Barrier(2)
    outcome = {}

    def writer(token):
        mine = store.load(state.session_id)  # both read round 1
        barrier.wait()
        mine.committed_token_ids.append(token)
        mine.round += 1
        try:
            store.commit(mine)
            outcome[token] = "won"
        except StaleRound as err:
            outcome[token] = str(err)
            update(store, state.session_id, lambda fresh: fresh.committed_token_ids.append(token))

    threads = [threading.Thread(target=writer, args=(t,)) for t in (10, 20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(v == "won" for v in outcome.values()) == [False, True]
    loser = next(v for v in outcome.values() if v != "won")
    assert "another writer committed first" in loser
    final = store.load(state.session_id)
    assert final.round == 3
    winner = next(t for t, v in outcome.items() if v == "won")
    assert final.committed_token_ids == [winner, 30 - winner]  # the loser's token went on top of the winner's


def test_many_writers_lose_no_update(make_store):
    store = make_store()
    state = new_state()
    store.create(state)

    def writer(base):
        for i in range(15):
            update(store, state.session_id, lambda s: s.committed_token_ids.append(base + i), attempts=200)

    threads = [threading.Thread(target=writer, args=(100 * k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = store.load(state.session_id)
    assert sorted(final.committed_token_ids) == sorted(100 * k + i for k in range(4) for i in range(15))
    assert final.round == 1 + 4 * 15


def test_sessions_expire_and_the_ttl_is_refreshed_by_commits(make_store):
    store = make_store(StoreConfig(ttl_s=0.6, finished_ttl_s=0.2))
    state = new_state()
    store.create(state)
    for _ in range(3):  # 3 x 0.3 s > one TTL: only the commits keep it alive
        time.sleep(0.3)
        state.round += 1
        store.commit(state)
    assert store.load(state.session_id) is not None
    state.round += 1
    state.status = FINISHED
    store.commit(state)
    time.sleep(0.35)
    assert store.load(state.session_id) is None  # a finished session is kept for a shorter time


def test_offloaded_kv_blobs(make_store):
    store = make_store()
    blob = bytes(range(256)) * 1000
    store.put_kv("s1", 17, blob)
    assert store.get_kv("s1") == (17, blob)
    store.drop_kv("s1")
    assert store.get_kv("s1") is None
    store.put_kv("s2", 3, b"x")
    store.delete("s2")
    assert store.get_kv("s2") is None


def test_a_retried_write_whose_first_attempt_landed_succeeds(redis_server):
    store = RedisStore(redis_server.url, prefix=f"test-{uuid.uuid4().hex[:8]}")
    state = new_state()
    store.create(state)
    state.round = 2
    store.commit(state)
    store.commit(state)  # the same write again (its reply was lost): not a conflict
    state.committed_token_ids.append(5)
    with pytest.raises(StaleRound):  # a different write of the same round is
        store.commit(state)


def test_unreachable_redis_is_unavailable():
    from redis_server import binary, free_port

    binary()  # the redis client library is what is under test; skip/fail like the rest without a server
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", retry_s=0.3)
    start = time.perf_counter()
    with pytest.raises(Unavailable, match="unreachable"):
        store.load("x")
    assert time.perf_counter() - start < 5


def test_open_store():
    assert isinstance(open_store(None), InMemoryStore) and isinstance(open_store("memory://"), InMemoryStore)
    assert isinstance(open_store("redis://127.0.0.1:1/0"), RedisStore)  # connects lazily
    with pytest.raises(Exception, match="unknown session store URL"):
        open_store("mysql://x")


def test_each_redis_operation_is_a_span_with_its_retries(redis_server):
    """A round's time in the store shows in its trace: a CLIENT span per Redis operation."""
    from opentelemetry import trace
    from tiny import span_exporter

    exporter = span_exporter()
    store = RedisStore(redis_server.url, prefix=f"test-{uuid.uuid4().hex[:8]}")
    state = new_state()
    store.create(state)
    state.round = 2
    store.commit(state)
    assert store.load(state.session_id) == state
    spans = [s for s in exporter.get_finished_spans() if s.name.startswith("specsplit.store.")]
    exporter.shutdown()
    assert [s.name for s in spans] == ["specsplit.store.write", "specsplit.store.write", "specsplit.store.load"]
    assert all(s.kind == trace.SpanKind.CLIENT and s.attributes["db.system.name"] == "redis" for s in spans)


def test_a_store_s_errors_never_show_its_password():
    """A store's errors reach every client (gRPC details) and the traces: the URL in them has no password (the deploy
    guide's is ``rediss://:PASSWORD@host:6380/0``)."""
    from redis_server import free_port
    from specsplit.errors import InvalidArgument

    store = RedisStore(f"rediss://:s3cret@127.0.0.1:{free_port()}/0?password=s3cret", retry_s=0)
    with pytest.raises(Unavailable) as err:
        store.load("some-session")
    assert "s3cret" not in str(err.value) and "rediss://:***@127.0.0.1" in str(err.value), err.value
    assert "s3cret" not in (store.unreachable() or "") + store.url
    with pytest.raises(InvalidArgument) as err:
        open_store("redis+tls://user:s3cret@host:6380/0")
    assert "s3cret" not in str(err.value) and "user:***@host" in str(err.value)
