"""A prompt that starts like an earlier one copies that part's K/V (``verifier_service.prefix``) and still gets
exactly HF greedy's tokens: a shared system turn, a prompt kept whole, a conversation's next turn."""

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from specsplit.config import VerifierConfig
from specsplit.launch import start_verifier
from specsplit.rpc import RemoteVerifier
from specsplit.tree import TokenTree
from tiny import hf_greedy, tiny_loaded
from verifier_service.engine import TargetEngine
from verifier_service.prefix import MIN_REUSE

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def target():
    return tiny_loaded(seed=5, eos=False)  # (greedy runs its NEW_TOKENS whatever it decodes)


def generate(engine, session_id: str, prompt: list[int], truth: list[int]) -> list[int]:
    """Greedy through the engine: trees of the true continuation with a wrong token planted now and then."""
    rng = random.Random(session_id)
    engine.prefill(session_id, prompt)
    committed: list[int] = []
    while len(committed) < NEW_TOKENS:
        path = list(truth[len(committed):len(committed) + rng.randint(1, 4)])
        if rng.random() < 0.3:
            path[-1] = (path[-1] + 1) % 250 + 3
        result = engine.verify(session_id, TokenTree.chain(path), len(prompt) + len(committed), NEW_TOKENS - len(committed))
        committed.extend(result.verdict.committed_token_ids)
    engine.release(session_id)
    return committed


def test_prompts_sharing_a_start_reuse_its_kv_and_keep_their_hf_greedy_tokens(target):
    rng = random.Random(1)
    system = [rng.randrange(3, 256) for _ in range(20)]
    first = system + [rng.randrange(3, 256) for _ in range(15)]
    answer = hf_greedy(target.model, first, NEW_TOKENS)
    prompts = [  # (prompt, prompt tokens whose K/V are copied: its longest common start with an earlier prompt)
        (first, 0),
        (system + [rng.randrange(3, 256) for _ in range(9)], 20),  # another user message under the same system turn
        (list(first), len(first) - 1),  # the same prompt again: every cached position copied, no forward
        # the conversation's next turn: the first session's prompt and answer were kept when it ended (the answer's
        # last token is the one it never cached)
        (first + answer + [rng.randrange(3, 256) for _ in range(6)], len(first) + NEW_TOKENS - 1),
        (system[:MIN_REUSE - 1] + [300, 301], 0),  # too short a common start: computed
    ]
    engine = TargetEngine(target, VerifierConfig(prefill_chunk=8))
    try:
        for i, (prompt, reused) in enumerate(prompts):
            before = engine.stats.prefix_tokens
            forwards = engine.stats.forwards
            assert generate(engine, f"s{i}", prompt, hf_greedy(target.model, prompt, NEW_TOKENS + 4)) == \
                hf_greedy(target.model, prompt, NEW_TOKENS), f"prompt {i}"
            assert engine.stats.prefix_tokens - before == reused, f"prompt {i}"
            if i == 2:
                assert engine.stats.forwards - forwards <= NEW_TOKENS  # the Verify forwards only, no prompt chunk
    finally:
        engine.close()


def test_sessions_arriving_together_under_one_system_turn_compute_it_once(target):
    """A burst of new sessions sharing a long start: the first computes it, the others wait for its chunks to pass
    the shared part and copy it from its slot; every session still gets HF greedy's tokens."""
    rng = random.Random(2)
    system = [rng.randrange(3, 256) for _ in range(48)]
    prompts = [system + [rng.randrange(3, 256) for _ in range(6 + 3 * i)] for i in range(4)]
    for prompt in prompts[1:]:
        assert prompt[48] != prompts[0][48]  # (so each shares exactly the system turn with the others)
    # The first prompt's prefill takes 27 ticks; two works a tick: the prompts waiting for it must not take the
    # places of the works that compute.
    engine = TargetEngine(target, VerifierConfig(prefill_chunk=2, max_batch=2))
    try:
        start = threading.Barrier(len(prompts))

        def run(i: int) -> list[int]:
            start.wait()
            return generate(engine, f"s{i}", prompts[i], hf_greedy(target.model, prompts[i], NEW_TOKENS + 4))

        with ThreadPoolExecutor(len(prompts)) as pool:
            tokens = list(pool.map(run, range(len(prompts))))
        assert tokens == [hf_greedy(target.model, prompt, NEW_TOKENS) for prompt in prompts]
        assert engine.stats.prefix_tokens == 48 * (len(prompts) - 1)  # (with kept prompts only: 0, they all overlap)
    finally:
        engine.close()


def test_off_computes_every_prompt_and_sessions_needing_hidden_states_prefill_in_full(target):
    prompt = list(range(3, 40))
    engine = TargetEngine(target, VerifierConfig(prefix_cache_tokens=0))
    try:
        engine.prefill("a", prompt)
        engine.prefill("b", prompt)
        assert engine.stats.prefix_tokens == 0
    finally:
        engine.close()
    engine = TargetEngine(target, VerifierConfig())
    try:
        engine.prefill("a", prompt)
        features = engine.prefill("b", prompt, return_features=True).features  # an EAGLE draft's session
        assert engine.stats.prefix_tokens == 0
        assert features.num_positions == len(prompt) - 1
    finally:
        engine.close()


def test_the_prefill_answer_says_how_many_prompt_tokens_were_copied(target):
    """Over gRPC: the orchestrator learns the verifier's prefill rate per computed token, not per copied one."""
    server = start_verifier(target, config=VerifierConfig())
    try:
        client = RemoteVerifier(server.address)
        prompt = list(range(3, 60))
        assert client.prefill_reply("a", prompt, timeout=30).copied_tokens == 0
        assert client.prefill_reply("b", prompt[:40] + [300, 301], timeout=30).copied_tokens == 40
    finally:
        server.stop(1.0)
        server.core.close()
