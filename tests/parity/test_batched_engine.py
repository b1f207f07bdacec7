"""Batching never changes a session's tokens: many sessions of different lengths verified together.

Each session drives the engine from its own thread with trees built around the target's true greedy
continuation (a right branch with a planted error at a random depth, a wrong branch, in random order),
so acceptance stops at different depths and accepted branches are often not the first (a gather
compaction), and some rounds end in a decode burst (the target decoding alone for a few ticks, riding
along with the others' verifications). Every session must end with exactly HF greedy's tokens, batched
(sessions forced into the same ticks) and one request at a time alike.
"""

import random
import threading
import time

import pytest

from specsplit.config import VerifierConfig
from specsplit.errors import InvalidArgument, ResourceExhausted
from specsplit.sampling import SamplingParams
from specsplit.tree import TokenTree
from tiny import VOCAB, before_each_forward, hf_greedy, tiny_loaded
from verifier_service.engine import TargetEngine
from verifier_service.lean import LeanPackedLlama

NEW_TOKENS = 24
PROMPT_LENGTHS = [1, 2, 5, 9, 17, 33, 40, 64, 3, 100, 12, 7]


@pytest.fixture(scope="module")
def target():
    return tiny_loaded(seed=11)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def references(target, prompts):
    return [hf_greedy(target.model, p, NEW_TOKENS + 8) for p in prompts]


def draft_tree(rng: random.Random, truth: list[int]) -> TokenTree:
    """A right branch (maybe with a planted error), a wrong branch, in random order; sometimes nothing."""
    if rng.random() < 0.15:
        return TokenTree.empty()
    right = list(truth[:rng.randint(1, 6)])
    if rng.random() < 0.5:
        right[rng.randrange(len(right))] = rng.randrange(3, VOCAB)
    wrong = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 3))]
    paths = [right, wrong] if rng.random() < 0.5 else [wrong, right]
    return TokenTree.from_paths(paths)


def drive(engine, index, prompt, reference, start, out):
    rng = random.Random(index)
    sid = f"s{index}"
    start.wait()
    engine.prefill(sid, prompt)
    committed: list[int] = []
    while len(committed) < NEW_TOKENS:
        tree = draft_tree(rng, reference[len(committed):])
        burst = rng.choice([0, 0, 0, 1, 5])  # tokens the target decodes alone after the verdict
        result = engine.verify(sid, tree, len(prompt) + len(committed), NEW_TOKENS - len(committed), burst)
        assert len(result.verdict.decoded_token_ids) <= burst
        committed.extend(result.verdict.committed_token_ids)
    engine.release(sid)
    out[index] = committed


def run_sessions(target, prompts, references, config):
    engine = TargetEngine(target, config)
    start = threading.Barrier(len(prompts))
    out: dict[int, list[int]] = {}
    threads = [threading.Thread(target=drive, args=(engine, i, p, r, start, out))
               for i, (p, r) in enumerate(zip(prompts, references))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        engine.close()
    return [out.get(i) for i in range(len(prompts))], engine


@pytest.mark.parametrize("lean_forward, cuda_graphs", [(True, False), (False, False), (True, True)],
                         ids=["lean", "hf-forward", "cuda-graphs"])
def test_batched_sessions_each_get_their_hf_greedy_tokens(target, prompts, references, lean_forward, cuda_graphs):
    """cuda-graphs: verification ticks as fixed-shape batches (padded rows and tokens, the scratch slot): CUDA graphs
    on a GPU (SPECSPLIT_TEST_DEVICE=cuda), the same batches run eagerly here."""
    config = VerifierConfig(max_batch=32, batch_wait_ms=500, prefill_chunk=16, max_sessions=16,
                            lean_forward=lean_forward, cuda_graphs=cuda_graphs)
    tokens, engine = run_sessions(target, prompts, references, config)
    assert isinstance(engine._packed_forward, LeanPackedLlama) == lean_forward
    assert (engine.stats.graphed > engine.stats.forwards // 2) == cuda_graphs  # most ticks ran the fixed shapes
    for i, reference in enumerate(references):
        assert tokens[i] == reference[:NEW_TOKENS], f"session {i} (prompt of {PROMPT_LENGTHS[i]} tokens)"
    assert engine.stats.max_rows >= len(prompts) // 2  # sessions really shared forwards
    assert engine.stats.rows > engine.stats.forwards * 2
    assert engine.num_sessions() == 0


def test_one_request_at_a_time_gives_the_same_tokens(target, prompts, references):
    config = VerifierConfig(max_batch=1, prefill_chunk=16, max_sessions=16)
    tokens, engine = run_sessions(target, prompts[:6], references[:6], config)
    assert tokens == [r[:NEW_TOKENS] for r in references[:6]]
    assert engine.stats.max_rows == 1


def test_a_long_prefill_does_not_stall_verification(target):
    engine = TargetEngine(target, VerifierConfig(prefill_chunk=8))
    long_prompt = [(7 * i) % 250 + 3 for i in range(300)]  # 38 chunks of 8
    short = [258, 1, 2, 3]
    try:
        engine.prefill("short", short)
        prefill = threading.Thread(target=engine.prefill, args=("long", long_prompt))
        prefill.start()
        while "long" not in engine._sessions:
            time.sleep(0.001)
        tokens: list[int] = []
        while prefill.is_alive() and len(tokens) < 30:
            tokens += engine.verify("short", TokenTree.empty(), len(short) + len(tokens)).verdict.committed_token_ids
        during_prefill = len(tokens)
        prefill.join(timeout=60)
        assert during_prefill >= 5  # the short session kept decoding, a token per chunk of the long prompt
        assert tokens == hf_greedy(target.model, short, len(tokens))
        assert engine.verify("long", TokenTree.empty(), 300).verdict.next_token_id == hf_greedy(
            target.model, long_prompt, 1)[0]
        # the prompt chunks' share of the forward time is accounted for apart (the concurrency bench reports it)
        stats = engine.stats
        assert 0 < stats.prefill_ms < stats.forward_ms
        before_prefill, before_forward = stats.prefill_ms, stats.forward_ms
        engine.prefill("alone", short)  # a tick of one prompt chunk only: all its forward time is prefill
        assert stats.prefill_ms - before_prefill == pytest.approx(stats.forward_ms - before_forward)
    finally:
        engine.close()


def test_session_cap_answers_resource_exhausted_at_once(target):
    engine = TargetEngine(target, VerifierConfig(max_sessions=2))
    try:
        engine.prefill("a", [5, 6, 7])
        engine.prefill("b", [5, 6])
        start = time.perf_counter()
        with pytest.raises(ResourceExhausted, match="max_sessions=2"):
            engine.prefill("c", [5])
        assert time.perf_counter() - start < 0.1
        engine.release("a")
        assert engine.prefill("c", [5, 9])[0] == 2  # a released slot is reused at once
    finally:
        engine.close()


def test_prefill_backlog_cap_answers_resource_exhausted_at_once(target, monkeypatch):
    engine = TargetEngine(target, VerifierConfig(prefill_chunk=8, max_queued_prefill_tokens=100))
    gate = threading.Event()
    before_each_forward(engine, monkeypatch, lambda: gate.wait(10))  # holds the model thread until the gate opens
    try:
        first = threading.Thread(target=engine.prefill, args=("long", list(range(3, 93))))
        first.start()
        time.sleep(0.2)
        start = time.perf_counter()
        with pytest.raises(ResourceExhausted, match="max_queued_prefill_tokens=100"):
            engine.prefill("more", list(range(3, 53)))
        assert time.perf_counter() - start < 0.1
        gate.set()
        first.join(timeout=30)
        assert engine.session("long").committed_length == 90
        assert engine.prefill("more", list(range(3, 53)))[0] == 50  # the backlog drained
    finally:
        gate.set()
        engine.close()


def test_a_failed_forward_changes_no_session(target, monkeypatch):
    engine = TargetEngine(target, VerifierConfig())
    prompt = [258, 1, 2, 3, 4]
    failing = threading.Event()

    def boom():
        if failing.is_set():
            raise RuntimeError("boom")

    before_each_forward(engine, monkeypatch, boom)
    try:
        engine.prefill("s", prompt)
        failing.set()
        with pytest.raises(RuntimeError, match="boom"):
            engine.verify("s", TokenTree.chain([7, 8]), len(prompt))
        failing.clear()
        first = engine.verify("s", TokenTree.empty(), len(prompt)).verdict.next_token_id
        second = engine.verify("s", TokenTree.empty(), len(prompt) + 1).verdict.next_token_id
        assert [first, second] == hf_greedy(target.model, prompt, 2)
    finally:
        engine.close()


def test_a_decode_burst_is_the_target_decoding_alone(target, prompts, references):
    engine = TargetEngine(target, VerifierConfig(max_decode_steps=8))
    prompt, reference = prompts[4], references[4]
    try:
        engine.prefill("s", prompt)
        first = engine.verify("s", TokenTree.chain([reference[0], 5]), len(prompt), 0, 6)
        assert first.verdict.accepted_token_ids == (reference[0],)
        assert first.verdict.decoded_token_ids == tuple(reference[2:8])
        assert list(first.verdict.committed_token_ids) == reference[:8]
        assert first.committed_length == len(prompt) + 8
        assert 0 < first.busy_ms <= first.verify_ms  # the model working, 7 ticks (alone here: the verifier hardly idles)
        second = engine.verify("s", TokenTree.empty(), len(prompt) + 8, 3, 8)  # max_commit ends it early
        assert list(second.verdict.committed_token_ids) == reference[8:11]
        with pytest.raises(InvalidArgument, match="max_decode_steps"):
            engine.verify("s", TokenTree.empty(), len(prompt) + 11, 0, 9)
    finally:
        engine.close()


def test_a_decode_burst_stops_after_an_eos_token():
    loaded = tiny_loaded(seed=11, eos=False)
    prompt = [258, 40, 41, 42]
    greedy = hf_greedy(loaded.model, prompt, 12)
    stop = next(i for i in range(2, 12) if greedy[i] not in greedy[:i])  # its first appearance
    loaded.model.generation_config.eos_token_id = greedy[stop]
    engine = TargetEngine(loaded)
    try:
        engine.prefill("s", prompt)
        result = engine.verify("s", TokenTree.empty(), len(prompt), 0, 20)
        assert list(result.verdict.committed_token_ids) == greedy[:stop + 1]
    finally:
        engine.close()


def test_a_seeded_sampled_burst_draws_what_single_steps_draw(target):
    prompt = [258, 9, 8, 7]
    sampling = SamplingParams(temperature=1.5, seed=3)
    engines = [TargetEngine(target), TargetEngine(target)]
    try:
        for engine in engines:
            engine.prefill("s", prompt, sampling)
        burst = engines[0].verify("s", TokenTree.empty(), len(prompt), 0, 9).verdict.committed_token_ids
        steps = [engines[1].verify("s", TokenTree.empty(), len(prompt) + i).verdict.next_token_id for i in range(10)]
        assert list(burst) == steps
        assert len(set(steps)) > 3  # really sampled, not a constant
    finally:
        for engine in engines:
            engine.close()


def test_a_tick_does_not_wait_for_a_session_whose_round_trip_is_longer(target, prompts, references):
    """A far edge (its next Verify comes 0.4 s after each answer) must not hold a near one's ticks for the whole
    batch wait (0.25 s) every round: once the verifier has seen its turnaround, the near session runs alone."""
    engine = TargetEngine(target, VerifierConfig(batch_wait_ms=250))
    near, far = prompts[3], prompts[5]
    done = threading.Event()

    def far_edge():
        engine.prefill("far", far)
        length = len(far)
        while not done.is_set():
            time.sleep(0.4)
            length = engine.verify("far", TokenTree.empty(), length).committed_length

    thread = threading.Thread(target=far_edge)
    try:
        thread.start()
        engine.prefill("near", near)
        time.sleep(1.0)  # the far session's turnaround is measured
        committed, start = [], time.perf_counter()
        while len(committed) < 12:
            result = engine.verify("near", TokenTree.empty(), len(near) + len(committed))
            committed.extend(result.verdict.committed_token_ids)
        assert time.perf_counter() - start < 12 * 0.25 / 2  # waiting for the far session: >= 12 x 0.25 s
        assert committed == references[3][:12]
    finally:
        done.set()
        thread.join(timeout=10)
        engine.close()
