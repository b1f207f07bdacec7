"""The half drafter: the target's own weights at low precision as the draft, verified by the target exactly.

Through the real gRPC services (streamed DraftTree rounds), greedy output equals HF greedy of the float32
target alone for every trigger; the draft is the saved target reloaded in float16 (and bfloat16), and it
agrees with the target well enough that whole greedy chains are accepted. Its forwards run on their own
model thread with their own torch thread count.
"""

import json
import threading
import time

import pytest
import torch

from draft_service import quantized
from draft_service.dtypes import MANY_DTYPES, STEP_DTYPES, calibrate, dtype_name, pick_step_dtype, weight_dtype
from draft_service.proposers import PREFILL_MIN_TOKENS
from orchestrator.trigger import GoodputThreshold
from specsplit.client import Client
from specsplit.config import DraftConfig, OrchestratorConfig
from specsplit.errors import InvalidArgument
from specsplit.launch import DraftProcess, colocated_threads, default_proposers, make_proposer, start_stack
from specsplit.runner import ModelRunner
from tiny import hf_greedy, tiny_loaded

PROMPTS = [[258, 72, 101, 108, 108, 111], list(range(30, 90)), [42]]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """The tiny target saved as a local HF model directory, as a real target would be."""
    loaded = tiny_loaded(seed=0, layers=2)
    path = tmp_path_factory.mktemp("tiny-target")
    loaded.model.save_pretrained(path)
    loaded.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target():
    return tiny_loaded(seed=0, layers=2)


def run(stack, prompt_ids, max_new_tokens, draft="half"):
    chunks = list(Client(stack.address).generate(prompt_token_ids=prompt_ids, max_new_tokens=max_new_tokens,
                                                 draft=draft))
    return [t for c in chunks for t in c.token_ids], [c.stats for c in chunks if c.stats is not None]


INT8 = pytest.mark.skipif(torch.int8 not in STEP_DTYPES, reason="no weight-only int8 matmul here")
INT4 = pytest.mark.skipif(quantized.INT4 not in STEP_DTYPES, reason="no CPU int4 matmul here")


@pytest.mark.parametrize("trigger,drafter,dtype", [
    ("goodput", "half", None), ("edgellm", "half", None), ("fixed", "half", None), ("goodput", "half+ngram", None),
    ("fixed", "half+ngram", None), pytest.param("goodput", "half", "int8", marks=INT8),
    pytest.param("goodput", "half", "int4", marks=INT4)])
def test_half_draft_is_lossless(target, target_dir, trigger, drafter, dtype):
    proposer = make_proposer(drafter, device="cpu", target_model=str(target_dir),
                             config=DraftConfig(grow_width=1, threads=1), draft_dtype=dtype)
    calibration = proposer.calibration  # the fastest dtypes measured here; any of them keeps the output exact
    assert proposer.name == drafter and weight_dtype(proposer.model) == calibration.step_dtype
    many = weight_dtype(proposer.prefill_model if proposer.prefill_model is not None else proposer.model)
    assert many == calibration.many_dtype
    assert proposer.prefill_from == (calibration.many_from() or PREFILL_MIN_TOKENS)  # where that dtype takes over
    assert proposer.copies == (drafter == "half+ngram")
    config = OrchestratorConfig(trigger=trigger, fixed_tree_nodes=4, tree_max_nodes=16, share_estimates=False)
    with start_stack(target, [proposer], orchestrator_config=config) as stack:
        whole = drafted = 0
        for prompt in PROMPTS:
            tokens, stats = run(stack, prompt, 40, drafter)
            assert tokens == hf_greedy(target.model, prompt, 40)
            rounds = [s for s in stats if s.num_draft_tokens]
            assert rounds and all(s.drafter == drafter for s in rounds)
            drafted += len(rounds)
            whole += sum(s.num_accepted == s.tree_depth for s in rounds)
        # 16-bit and int8 copies almost always pick the float32 target's greedy token. 4-bit groups of this tiny random
        # model's weights (hidden 64: two groups a row) do ~91% of the time (SmolLM2's: 99.4%, bench/draft_dtypes.py;
        # tests/slow/test_smollm2.py): 9-12 of 15 trees accepted whole in seven runs. The calibration picks int4 where it
        # is fastest, so the bar follows what it picked.
        assert whole >= (0.3 if calibration.step_dtype == quantized.INT4 else 0.7) * drafted, calibration.describe()


def test_calibration_keeps_the_fastest_measured_dtypes(target):
    models, calibration = calibrate(target.model, threads=1)
    assert set(calibration.step_ms) == set(STEP_DTYPES) and set(calibration.many_ms) == set(MANY_DTYPES)
    assert calibration.step_dtype == pick_step_dtype(calibration.step_ms)
    assert calibration.many_dtype == min(calibration.many_ms, key=calibration.many_ms.get)
    assert set(models) == {calibration.step_dtype, calibration.many_dtype}
    assert all(weight_dtype(model) == dtype for dtype, model in models.items())
    assert target.model.dtype == torch.float32  # the target itself is never converted
    models, given = calibrate(target.model, threads=1, step_dtypes=(torch.float16,))
    assert given.step_dtype == torch.float16 and given.step_ms == {} and weight_dtype(models[torch.float16]) == torch.float16


def test_a_calibration_is_remembered_per_machine(target, tmp_path, monkeypatch):
    """The first start times the candidates and keeps what it measured; the next one with the same machine, threads
    and candidates takes it from the file without timing (and makes only the two copies it keeps); other threads are
    timed again; an unreadable file is timed over and written anew."""
    from draft_service import dtypes

    path = tmp_path / "cache" / dtypes.CALIBRATION_FILE
    _, first = calibrate(target.model, threads=1, remember=path)
    assert not first.recalled and path.exists()

    def timed(*args):
        raise AssertionError("timed again")

    monkeypatch.setattr(dtypes, "_time", timed)
    models, again = calibrate(target.model, threads=1, remember=path)
    assert again.recalled.startswith(f"{path}, timed at ") and "as timed before" in again.describe()
    assert (again.step_dtype, again.many_dtype, again.step_ms, again.many_ms, again.many_from()) == \
        (first.step_dtype, first.many_dtype, first.step_ms, first.many_ms, first.many_from())
    assert set(models) == {again.step_dtype, again.many_dtype}
    assert all(weight_dtype(model) == dtype for dtype, model in models.items())
    with pytest.raises(AssertionError, match="timed again"):
        calibrate(target.model, threads=2, remember=path)
    written = json.loads(path.read_text())
    for entry in written.values():
        del entry["lines"]  # as an earlier version wrote it: without the two dtypes' lines it is timed again
    path.write_text(json.dumps(written))
    with pytest.raises(AssertionError, match="timed again"):
        calibrate(target.model, threads=1, remember=path)
    monkeypatch.undo()
    path.write_text("{cut short")
    _, fresh = calibrate(target.model, threads=1, remember=path)
    assert not fresh.recalled and len(json.loads(path.read_text())) == 1


def test_the_services_keep_calibrations_where_the_environment_says(tmp_path, monkeypatch):
    from draft_service.dtypes import CALIBRATION_ENV, CALIBRATION_FILE, calibration_file

    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path))
    monkeypatch.delenv(CALIBRATION_ENV)  # (the tests turn it off)
    assert calibration_file() == tmp_path / CALIBRATION_FILE
    monkeypatch.setenv(CALIBRATION_ENV, str(tmp_path / "edge.json"))
    assert calibration_file() == tmp_path / "edge.json"
    monkeypatch.setenv(CALIBRATION_ENV, "off")
    assert calibration_file() is None


def test_quantized_steps_are_kept_only_when_clearly_faster():
    int4 = quantized.INT4
    assert pick_step_dtype({torch.float16: 50.0, torch.bfloat16: 60.0, torch.int8: 30.0}) == torch.int8
    assert pick_step_dtype({torch.float16: 50.0, torch.bfloat16: 60.0, torch.int8: 45.0}) == torch.float16
    assert pick_step_dtype({torch.float16: 50.0, torch.bfloat16: 40.0}) == torch.bfloat16
    assert pick_step_dtype({torch.int8: 45.0}) == torch.int8
    assert pick_step_dtype({torch.float16: 23.0, torch.int8: 26.5, int4: 15.8}) == int4  # the AVX-512 EPYC
    assert pick_step_dtype({torch.float16: 23.0, int4: 22.0}) == torch.float16  # int4 must be 1.1x faster
    assert pick_step_dtype({torch.float16: 50.0, torch.int8: 30.0, int4: 40.0}) == torch.int8  # the fastest that pays


def test_draft_dtype_is_chosen(target, target_dir):
    (bf16,) = default_proposers("half", None, "cpu", "float32", target_model=str(target_dir), draft_dtype="bfloat16")
    assert bf16.name == "half" and weight_dtype(bf16.model) == torch.bfloat16
    if torch.int8 in STEP_DTYPES:  # int8 weights run on this CPU
        (int8,) = default_proposers("half", None, "cpu", "float32", target_model=str(target_dir), draft_dtype="int8")
        assert weight_dtype(int8.model) == torch.int8
    if quantized.INT4 in STEP_DTYPES:  # int4 weights run on this CPU
        (int4,) = default_proposers("half", None, "cpu", "float32", target_model=str(target_dir), draft_dtype="int4")
        assert weight_dtype(int4.model) == quantized.INT4 and dtype_name(int4.calibration.step_dtype) == "int4"
    with pytest.raises(InvalidArgument, match="int4 is for --draft half"):
        default_proposers("model", str(target_dir), "cpu", "float32", draft_dtype="int4")
    with pytest.raises(InvalidArgument, match="int8 is for --draft half"):
        default_proposers("model", str(target_dir), "cpu", "float32", draft_dtype="int8")
    with pytest.raises(ValueError, match="int8"):  # a Hugging Face copy of the model cannot hold int8 weights
        calibrate(target.model, threads=1, step_dtypes=(torch.int8,), lean_forward=False)
    (model,) = default_proposers("model", str(target_dir), "cpu", "float32", draft_dtype="float16")
    assert model.name == "model" and model.model.dtype == torch.float16
    (same,) = default_proposers("model", str(target_dir), "cpu", "float32")
    assert same.model.dtype == torch.float32


def test_model_runner_keeps_its_own_thread_count():
    before = torch.get_num_threads()
    runner = ModelRunner("t", threads=1)
    try:
        assert runner(torch.get_num_threads) == 1
        assert runner(lambda: threading.current_thread().name).startswith("specsplit-t")
    finally:
        runner.close()
    assert torch.get_num_threads() == before  # the caller's threads are untouched


def test_rounds_without_the_model_still_copy_spans(target, target_dir):
    """When goodput prefers rounds without the draft model (a draft step about as dear as the target's, as on
    CPUs without 16-bit matrix units), a half+ngram session still verifies the span prompt lookup finds, at
    no draft cost: the orchestrator looks it up itself and the draft service is not called."""
    proposer = make_proposer("half+ngram", device="cpu", target_model=str(target_dir), config=DraftConfig(threads=1))
    grown = []
    real_grow = proposer.grow
    proposer.grow = lambda *args, **kwargs: grown.append(args[0]) or real_grow(*args, **kwargs)
    prompt = list(range(30, 50)) * 3  # the text repeats: after its last 3-gram, lookup copies what followed before
    config = OrchestratorConfig(trigger="goodput", tree_max_nodes=16)
    with start_stack(target, [proposer], orchestrator_config=config) as stack:
        stack.orchestrator.core._learned[("trigger", "goodput", "half+ngram", True)] = GoodputThreshold(
            drafting=False, drafted=(1.0, 1000.0), plain=(1.0, 10.0), probe_every=10**6)  # never draft, never probe
        tokens, stats = run(stack, prompt, 24, "half+ngram")
    assert tokens == hf_greedy(target.model, prompt, 24)
    assert grown == [] and any(s.num_draft_tokens for s in stats)


def test_a_verifier_beside_a_draft_process_gets_the_cores_the_draft_leaves(target, target_dir):
    """Two OpenMP teams on the same cores stall each other at every barrier, so a stack whose draft runs as a
    child process on this machine gives the verifier the cores the draft leaves (at least one); lossless."""
    process = DraftProcess(["--draft", "half", "--threads", "1", "--target-model", str(target_dir)])
    assert process.threads == 1
    with start_stack(target, [], processes=[process]) as stack:
        assert stack.verifier_engine.config.threads == colocated_threads(1) >= 1
        tokens, stats = run(stack, PROMPTS[0], 16, "half")
    assert tokens == hf_greedy(target.model, PROMPTS[0], 16)
    assert any(s.drafter == "half" for s in stats)
    with start_stack(target, []) as alone:  # no draft beside it: the process's threads
        assert alone.verifier_engine.config.threads == 0


def far_verifier(monkeypatch):
    """Every verification 50 ms longer, as from a verifier 50 ms away: time for the draft to draft on meanwhile."""
    from orchestrator.generation import Orchestrator

    verify = Orchestrator._verify

    def far_verify(self, *args, **kwargs):
        time.sleep(0.05)
        return verify(self, *args, **kwargs)

    monkeypatch.setattr(Orchestrator, "_verify", far_verify)


def run_copying(target, target_dir, prompt, provisional_max):
    """96 tokens of a half+ngram session, trees and copied spans of 16 (a fixed size copies spans of its size): its
    tokens, round stats, and the tokens generated before each round."""
    proposer = make_proposer("half+ngram", device="cpu", target_model=str(target_dir), config=DraftConfig(threads=1))
    config = OrchestratorConfig(trigger="fixed", fixed_tree_nodes=16, tree_max_nodes=16, provisional_max=provisional_max)
    with start_stack(target, [proposer], orchestrator_config=config) as stack:
        tokens, stats = run(stack, prompt, 96, "half+ngram")
    return tokens, stats, [sum(s.num_committed for s in stats[:i]) for i in range(len(stats))]


@pytest.mark.parametrize("case", ["chance match", "edit point"])
def test_target_only_rounds_follow_a_copied_span_only_when_the_draft_is_far_behind(target, target_dir, monkeypatch,
                                                                                    case):
    """half+ngram: after a copied span, the target decodes alone for a round or two (COPY_BRIDGE_ROUNDS) only when
    the draft would first catch up on a span's worth of tokens (a code edit's edit point after copied lines). A
    chance match rejected at its first token (chat) leaves the draft one token behind: the next round drafts."""
    from specsplit.lookup import COPY_BRIDGE_BEHIND, COPY_BRIDGE_ROUNDS, SpanLookup

    prompt = PROMPTS[1]
    greedy = hf_greedy(target.model, prompt, 96)
    spans = []  # (tokens generated, span): the one span the orchestrator's lookup finds, right or wrong from its start

    class OneSpan(SpanLookup):
        def span(self, token_ids, drafted=(), max_len=None):
            n = len(token_ids) - len(prompt)
            if spans or n < 4:
                return []
            spans.append((n, greedy[n:n + COPY_BRIDGE_BEHIND] if case == "edit point" else [(greedy[n] + 1) % 300] * 16))
            return list(spans[0][1])

    monkeypatch.setattr("orchestrator.drafts.SpanLookup", OneSpan)  # the orchestrator's (the draft's own is as it is)
    # a fixed size copies spans of its size; no provisional tokens: none vouch for a span
    tokens, stats, generated = run_copying(target, target_dir, prompt, provisional_max=0)
    assert tokens == greedy
    copied = generated.index(spans[0][0])  # the round the span was looked up for
    assert stats[copied].num_draft_tokens == 16
    assert stats[copied].num_accepted == (16 if case == "edit point" else 0)
    after = [s.drafter for s in stats[copied + 1:copied + 1 + COPY_BRIDGE_ROUNDS + 1]]
    if case == "edit point":  # 17 tokens the draft has not seen: the target bridges, then the draft goes on
        assert after == ["none"] * COPY_BRIDGE_ROUNDS + ["half+ngram"]
    else:
        assert after[0] == "half+ngram"


def test_the_draft_drafts_on_under_a_copied_span_and_the_next_round_is_pipelined(target, target_dir, monkeypatch):
    """half+ngram with provisional drafting: a copied span's round opens the draft's stream with the span as its
    given chain, so the draft runs it and drafts on from its end while the verifier checks it. After the last copied
    span the next round starts from the kept provisional tokens (pipelined), with no target-only bridge rounds (the
    draft never fell behind), and every token is HF greedy's."""
    from specsplit.lookup import SpanLookup

    prompt = PROMPTS[1]
    greedy = hf_greedy(target.model, prompt, 96)

    class RightSpans(SpanLookup):  # the orchestrator's lookup finds HF greedy's next 16 tokens for a while
        def span(self, token_ids, drafted=(), max_len=None):
            n = len(token_ids) - len(prompt)
            return list(greedy[n:n + 16]) if 4 <= n < 40 else []

    monkeypatch.setattr("orchestrator.drafts.SpanLookup", RightSpans)
    far_verifier(monkeypatch)
    tokens, stats, generated = run_copying(target, target_dir, prompt, provisional_max=8)
    assert tokens == greedy
    after = next(i for i, n in enumerate(generated) if n >= 40)  # the first round past the copied spans
    assert all(s.drafter == "half+ngram" for s in stats)  # no round left to the target alone
    assert stats[after].provisional_kept > 0  # seeded by what the draft drafted under the last copied span


def test_under_a_span_at_an_edit_point_the_draft_drafts_on_from_the_committed_tokens(target, target_dir, monkeypatch):
    """half+ngram with provisional drafting: a copied span with no kept provisional tokens behind it (here the
    session's first round) opens the draft's round with no node budget, and the draft drafts on from the committed
    tokens while the verifier checks the span. The span breaks after two tokens; what the draft drafted past them
    and the bonus token seeds the next round (before: nothing, and that round caught up and grew a fresh tree).
    Every token is HF greedy's."""
    from specsplit.lookup import SpanLookup

    prompt = PROMPTS[1]
    greedy = hf_greedy(target.model, prompt, 96)

    class EarlySpan(SpanLookup):  # the orchestrator's lookup finds one span, in the first round: right for 2 tokens
        def span(self, token_ids, drafted=(), max_len=None):
            return [*greedy[:2], (greedy[2] + 1) % 300, *greedy[3:16]] if len(token_ids) == len(prompt) else []

    monkeypatch.setattr("orchestrator.drafts.SpanLookup", EarlySpan)
    far_verifier(monkeypatch)
    tokens, stats, _ = run_copying(target, target_dir, prompt, provisional_max=8)
    assert tokens == greedy
    assert (stats[0].num_draft_tokens, stats[0].num_accepted, stats[0].num_committed) == (16, 2, 3)
    assert stats[1].provisional_kept > 0  # seeded by what the draft drafted under the span
