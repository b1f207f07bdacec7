"""Chaos with separate processes: kill -9 a verifier replica, kill -9 an orchestrator, restart Redis.

Every generation must complete token-identical to a run without the fault (greedy), with no token lost
and none repeated.
"""

import threading
import time

from redis_server import RedisServer
from specsplit.client import Client
from specsplit.rpc import RemoteVerifier
from tiny import hf_greedy, wait_for

PROMPTS = [[258, *range(1 + 3 * i, 14 + 3 * i)] + [1 + 3 * i, 2 + 3 * i] for i in range(16)]


def tokens_of(chunks):
    return [t for c in chunks for t in c.token_ids]


class Generations:
    """One generation per prompt, each in a thread, reading as fast as the server sends."""

    def __init__(self, address, prompts, max_new_tokens, resume=False, **client_kwargs):
        self.prompts = prompts
        self.chunks = {i: [] for i in range(len(prompts))}
        self.errors, self.streams, self.done = [], {}, set()
        self.threads = [threading.Thread(target=self._run, args=(i, address, max_new_tokens, resume, client_kwargs),
                                         daemon=True) for i in range(len(prompts))]
        for t in self.threads:
            t.start()

    def _run(self, i, address, max_new_tokens, resume, client_kwargs):
        try:
            stream = Client(address, **client_kwargs).generate(prompt_token_ids=self.prompts[i],
                                                               max_new_tokens=max_new_tokens, resume=resume)
            self.streams[i] = stream
            for chunk in stream:
                self.chunks[i].append(chunk)
            self.done.add(i)
        except Exception as err:  # noqa: BLE001 - reported by the test
            self.errors.append(f"{i}: {err!r}")

    def wait_until_each_has(self, n_tokens, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline and not self.errors:
            if all(len(tokens_of(c)) >= n_tokens for c in self.chunks.values()):
                return {i: len(tokens_of(c)) for i, c in self.chunks.items()}
            time.sleep(0.01)
        raise AssertionError(f"generations did not get going: {self.errors}")

    def join(self, timeout=180):
        for t in self.threads:
            t.join(timeout=timeout)
        assert not self.errors, self.errors
        return {i: tokens_of(c) for i, c in self.chunks.items()}


def test_kill9_a_verifier_replica_while_16_sessions_generate(model_dir, services):
    path, loaded = model_dir
    v1, v2, draft = (services.spawn("verifier", "--target-model", str(path)),
                     services.spawn("verifier", "--target-model", str(path)), services.spawn("draft"))
    addresses = [services.address(p) for p in (v1, v2, draft)]
    _, orch = services.start("orchestrator", "--verifiers", ",".join(addresses[:2]), "--drafts", addresses[2],
                             "--target-model", str(path))
    gens = Generations(orch, PROMPTS, 160)
    at_kill = gens.wait_until_each_has(4)  # every session is mid-generation
    held = [RemoteVerifier(a).info(timeout=5).num_sessions for a in addresses[:2]]
    # Sessions are spread over both; kill the busier (a health check that timed out under load may
    # have steered some new sessions away from one).
    doomed = 0 if held[0] >= held[1] else 1
    services.kill9((v1, v2)[doomed])
    results = gens.join()
    assert held[doomed] >= 4  # sessions were on the replica that died
    assert sum(len(results[i]) > at_kill[i] for i in results) >= 12  # and most were still generating
    for i, prompt in enumerate(PROMPTS):
        assert results[i] == hf_greedy(loaded.model, prompt, 160), i
    assert wait_for(lambda: RemoteVerifier(addresses[1 - doomed]).info(timeout=5).num_sessions == 0)  # all released


def test_kill9_the_orchestrator_and_resume_through_the_sdk(model_dir, services, redis_server):
    path, loaded = model_dir
    verifier, draft = services.spawn("verifier", "--target-model", str(path)), services.spawn("draft")
    v_addr, d_addr = services.address(verifier), services.address(draft)
    common = ["--verifiers", v_addr, "--drafts", d_addr, "--target-model", str(path), "--redis-url", redis_server.url]
    o1, o2 = services.spawn("orchestrator", *common), services.spawn("orchestrator", *common)
    addresses = [services.address(o1), services.address(o2)]
    prompts = PROMPTS[:4]
    gens = Generations(addresses, prompts, 160, resume=True)
    at_kill = gens.wait_until_each_has(4)
    services.kill9(o1)  # every stream was on the first orchestrator
    results = gens.join()
    for i, prompt in enumerate(prompts):
        assert results[i] == hf_greedy(loaded.model, prompt, 160), i  # none lost, none repeated
        assert len(results[i]) > at_kill[i] and gens.streams[i].reconnects >= 1
        assert sum(1 for c in gens.chunks[i] if c.prompt_token_ids) == 1


def test_kill9_the_only_orchestrator_and_the_cli_resumes_on_it_restarted(model_dir, services, redis_server):
    """`specsplit generate --orchestrator ADDR` with one address resumes too: its orchestrator killed mid-generation
    and started again on the same address (systemd's Restart=), the CLI goes on after the last token it printed
    (it failed UNAVAILABLE: only several addresses made the session resumable)."""
    import json
    import os
    import subprocess
    import sys

    from redis_server import free_port
    from tiny import EOS_ID

    path, loaded = model_dir
    prompt = next(p for p in ("abcabcabcabc", "hello world", "the quick brown fox", "0123456789")
                  if EOS_ID not in hf_greedy(loaded.model, list(loaded.tokenizer(p)["input_ids"]), 200))
    v_addr = services.address(services.spawn("verifier", "--target-model", str(path)))
    # (one token a round: the tiny model would decode all 200 in bursts before the kill)
    orchestrator = ["--listen", f"127.0.0.1:{free_port()}", "--verifiers", v_addr, "--target-model", str(path),
                    "--redis-url", redis_server.url, "--burst-max", "1"]
    first = services.spawn("orchestrator", *orchestrator)
    address = services.address(first)
    env = dict(os.environ, HF_HUB_OFFLINE="1", SPECSPLIT_THREADS="1")
    client = subprocess.Popen([sys.executable, "-m", "specsplit.cli", "generate", prompt, "--orchestrator", address,
                               "--max-new-tokens", "200", "--no-chat-template", "--json"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert wait_for(lambda: RemoteVerifier(v_addr).info(timeout=5).num_sessions == 1, timeout=60)  # generating
        services.kill9(first)
        services.address(services.spawn("orchestrator", *orchestrator))
        out, err = client.communicate(timeout=120)
        assert client.returncode == 0, err
        result = json.loads(out)
        assert result["token_ids"] == hf_greedy(loaded.model, result["prompt_token_ids"], 200)  # none lost or repeated
        assert "UNAVAILABLE" in err  # (it said why it stalled)
    finally:
        if client.poll() is None:
            client.kill()


def test_restart_redis_with_aof_and_resume(model_dir, services, tmp_path):
    path, loaded = model_dir
    redis = RedisServer(data_dir=str(tmp_path), appendonly=True).start()
    try:
        verifier = services.spawn("verifier", "--target-model", str(path))
        # one token a round (a store write each) and 300 tokens: the generations are still running when Redis stops
        _, orch = services.start("orchestrator", "--verifiers", services.address(verifier), "--target-model", str(path),
                                 "--redis-url", redis.url, "--store-retry-s", "0.5", "--burst-max", "1")
        prompts = PROMPTS[:2]
        gens = Generations(orch, prompts, 300, resume=True, reconnect_s=60)
        gens.wait_until_each_has(4)
        redis.stop()  # SIGTERM: the AOF is flushed; the orchestrator's writes now fail
        time.sleep(1.5)  # longer than --store-retry-s: the streams break, the SDK keeps trying to resume
        redis.start()  # same port and directory: the sessions come back from the AOF
        results = gens.join()
        for i, prompt in enumerate(prompts):
            assert results[i] == hf_greedy(loaded.model, prompt, 300), i
            assert gens.streams[i].reconnects >= 1
    finally:
        redis.stop()


def test_kill9_redis_without_persistence_under_live_streams(model_dir, services):
    """Redis dies and comes back empty (no AOF, no snapshot) while two resumable streams run: their orchestrator, which
    holds the sessions, writes them again and goes on; every token as the target alone's, and no verifier session left
    held after (before: each stream failed with FAILED_PRECONDITION, 'another writer', holding its verifier session
    until the idle timeout)."""
    path, loaded = model_dir
    redis = RedisServer().start()
    try:
        _, verifier = services.start("verifier", "--target-model", str(path))
        _, orch = services.start("orchestrator", "--verifiers", verifier, "--target-model", str(path),
                                 "--redis-url", redis.url, "--store-retry-s", "5", "--burst-max", "1")
        prompts = PROMPTS[:2]
        gens = Generations(orch, prompts, 300, resume=True, reconnect_s=60)
        gens.wait_until_each_has(4)
        redis.stop(kill=True)
        redis.start()  # same port, nothing in it
        results = gens.join()
        for i, prompt in enumerate(prompts):
            assert results[i] == hf_greedy(loaded.model, prompt, 300), i
        assert wait_for(lambda: RemoteVerifier(verifier).info(timeout=5).num_sessions == 0)
    finally:
        redis.stop()


def test_a_hung_verifier_replica_s_sessions_move_within_seconds(model_dir, services):
    """A replica that stops answering without closing its connections (SIGSTOP here; a partitioned link looks the
    same): after three failed health checks its calls in flight are cut short and their sessions move, in seconds
    (before, each waited out its 60 s Verify deadline). Every output as the target alone's."""
    import os
    import signal

    path, loaded = model_dir
    (p1, v1), (p2, v2) = (services.start("verifier", "--target-model", str(path)) for _ in range(2))
    _, orch = services.start("orchestrator", "--verifiers", f"{v1},{v2}", "--target-model", str(path),
                             "--burst-max", "1")
    prompts = PROMPTS[:4]
    gens = Generations(orch, prompts, 200)
    gens.wait_until_each_has(4)
    held = [RemoteVerifier(a).info(timeout=5).num_sessions for a in (v1, v2)]
    hung = (p1, p2)[0 if held[0] >= held[1] else 1]
    os.kill(hung.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        results = gens.join(timeout=60)
        took = time.monotonic() - start
    finally:
        os.kill(hung.pid, signal.SIGCONT)
    assert max(held) >= 1 and took < 30, (held, took)
    for i, prompt in enumerate(prompts):
        assert results[i] == hf_greedy(loaded.model, prompt, 200), i


def test_kill9_the_draft_then_restart_it_on_its_port(model_dir, services):
    """The edge box's draft dies under live sessions (kill -9): every generation goes on target-only and ends as the
    target alone's, none failed. Started again on the same address (systemd's Restart=), the draft drafts again for
    the orchestrator within seconds, without the orchestrator being restarted."""
    from redis_server import free_port

    path, loaded = model_dir
    draft = ["--listen", f"127.0.0.1:{free_port()}", "--draft", "model", "--draft-model", str(path)]
    d_addr = services.address(services.spawn("draft", *draft))
    _, verifier = services.start("verifier", "--target-model", str(path))
    _, orch = services.start("orchestrator", "--verifiers", verifier, "--drafts", d_addr, "--target-model", str(path),
                             "--trigger", "fixed", "--fixed-tree-nodes", "4", "--burst-max", "1")
    prompts = PROMPTS[:4]
    gens = Generations(orch, prompts, 300)
    gens.wait_until_each_has(4)
    services.kill9(services.procs[0])
    results = gens.join()
    for i, prompt in enumerate(prompts):
        assert results[i] == hf_greedy(loaded.model, prompt, 300), i
    assert any(c.stats.drafter == "none" for c in gens.chunks[0] if c.stats)  # rounds without the draft were run
    services.address(services.spawn("draft", *draft))
    start = time.monotonic()

    def drafted() -> bool:
        chunks = list(Client(orch).generate(prompt_token_ids=PROMPTS[5], max_new_tokens=20))
        assert tokens_of(chunks) == hf_greedy(loaded.model, PROMPTS[5], 20)
        return any(c.stats.num_draft_tokens for c in chunks if c.stats)

    assert wait_for(drafted, timeout=60), "the orchestrator never drafted on the restarted draft"
    assert time.monotonic() - start < 15
