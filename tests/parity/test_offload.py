"""KV offload: a session's cache exported from one engine and imported into another continues exactly."""

import pytest
import torch

from specsplit.errors import FailedPrecondition, InvalidArgument
from specsplit.tree import TokenTree
from tiny import hf_greedy, tiny_loaded
from verifier_service import offload
from verifier_service.engine import TargetEngine

PROMPT = [258, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]


@pytest.fixture(scope="module")
def target():
    return tiny_loaded(seed=0)


def slot_kv(engine, session_id):
    """Per layer ([H_kv, L, D] keys, values) of the session's cached positions, read from its slot."""
    session = engine.session(session_id)
    return [engine._store.read(i, session.slot, session.cached_length) for i in range(engine._num_layers)]


def decode(engine, session_id, n):
    out = []
    for _ in range(n):
        length = engine.session(session_id).committed_length
        out.extend(engine.verify(session_id, TokenTree.empty(), length).verdict.committed_token_ids)
    return out


def test_export_import_continues_token_identical(target):
    a, b = TargetEngine(target), TargetEngine(target)
    a.prefill("s", PROMPT)
    first = decode(a, "s", 6)
    tokens = a.session("s").token_ids
    blob = a.export_session("s", len(tokens))
    assert offload.cached_length(blob) == len(tokens) - 1
    assert b.import_session("s", tokens, blob)[0] == len(tokens)
    assert b.session("s").slot >= 0
    for (ka, va), (kb, vb) in zip(slot_kv(a, "s"), slot_kv(b, "s")):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert first + decode(b, "s", 10) == hf_greedy(target.model, PROMPT, 16)


def test_float16_blob_is_half_the_size_and_close(target):
    engine = TargetEngine(target)
    engine.prefill("s", PROMPT)
    n = len(PROMPT)
    full, half = engine.export_session("s", n), engine.export_session("s", n, dtype="float16")
    header = offload.header_of(half)
    assert header["dtype"] == "float16"
    assert len(half) - header["offset"] == (len(full) - offload.header_of(full)["offset"]) // 2
    other = TargetEngine(target)
    other.import_session("s", PROMPT, half)
    for (ka, _), (kb, _) in zip(slot_kv(engine, "s"), slot_kv(other, "s")):
        assert kb.dtype == torch.float32
        torch.testing.assert_close(ka, kb, atol=2e-2, rtol=1e-3)


def test_bad_blobs_and_lengths_are_refused(target):
    engine = TargetEngine(target)
    engine.prefill("s", PROMPT)
    blob = engine.export_session("s", len(PROMPT))
    with pytest.raises(FailedPrecondition, match="the export expected"):
        engine.export_session("s", len(PROMPT) + 1)
    other = TargetEngine(target)
    with pytest.raises(InvalidArgument, match="caches 12 positions"):
        other.import_session("t", PROMPT + [5], blob)
    with pytest.raises(InvalidArgument, match="truncated"):
        other.import_session("t", PROMPT, blob[:-10])
    with pytest.raises(InvalidArgument, match="bad magic"):
        other.import_session("t", PROMPT, b"nope" + blob[4:])
    assert other.num_sessions() == 0


def test_import_and_export_while_other_sessions_are_batched(target):
    """Export and import are bookkeeping on the model thread: sessions verified meanwhile stay HF-exact."""
    import threading

    from specsplit.config import VerifierConfig

    a = TargetEngine(target)
    b = TargetEngine(target, VerifierConfig(batch_wait_ms=5.0))
    prompts = {"x": [258, 9, 8, 7], "y": [258, 40, 41, 42, 43, 44, 45]}
    for sid, prompt in prompts.items():
        b.prefill(sid, prompt)
    outs, errors = {}, []

    def run(sid):
        try:
            outs[sid] = decode(b, sid, 20)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=run, args=(sid,)) for sid in prompts]
    for t in threads:
        t.start()
    a.prefill("s", PROMPT)
    first = decode(a, "s", 3)
    tokens = list(a.session("s").token_ids)
    b.import_session("s", tokens, a.export_session("s", len(tokens)))
    rest = decode(b, "s", 5)
    blob = b.export_session("s", len(tokens) + 5)
    for t in threads:
        t.join()
    assert not errors
    assert first + rest == hf_greedy(target.model, PROMPT, 8)
    assert offload.cached_length(blob) == len(tokens) + 4
    for sid, prompt in prompts.items():
        assert outs[sid] == hf_greedy(target.model, prompt, 20)
    a.close()
    b.close()


def test_one_token_session_round_trips_and_release_frees_the_slot(target):
    from specsplit.config import VerifierConfig

    a, b = TargetEngine(target), TargetEngine(target, VerifierConfig(max_sessions=1))
    a.prefill("s", [258])
    blob = a.export_session("s", 1)
    assert offload.cached_length(blob) == 0
    b.import_session("s", [258], blob)
    assert decode(b, "s", 6) == hf_greedy(target.model, [258], 6)
    assert b.release("s") and b.num_sessions() == 0
    b.prefill("t", PROMPT)  # the only slot is free again
    assert b._store.num_free == 0 and decode(b, "t", 3) == hf_greedy(target.model, PROMPT, 3)
    assert b.release("t")
    b.import_session("u", [258], blob)  # and again, after a release
    a.close()
    b.close()


def test_seeded_sampled_session_continues_identically_after_import(target):
    """Per-round reseeding: the exporting engine and the importing one draw the same continuation."""
    from specsplit.sampling import SamplingParams

    sampling = SamplingParams(temperature=1.5, seed=1234)
    a, b = TargetEngine(target), TargetEngine(target)
    a.prefill("s", PROMPT, sampling)
    decode(a, "s", 4)
    tokens = list(a.session("s").token_ids)
    b.import_session("s", tokens, a.export_session("s", len(tokens)), sampling)
    assert decode(a, "s", 12) == decode(b, "s", 12)
    c = TargetEngine(target)  # a re-prefill of the committed tokens draws the same too
    c.prefill("s", tokens, sampling)
    assert decode(c, "s", 12) == a.session("s").token_ids[len(tokens):]
    for engine in (a, b, c):
        engine.close()


LONG = [258] + [(7 * i) % 200 + 3 for i in range(30)]  # [31] longer than the prefix cache's MIN_REUSE


@pytest.mark.parametrize("dtype", ["", "float16"])
def test_only_an_exact_import_is_kept_for_later_prompts(target, dtype):
    """An imported cache is kept on Release for later prompts that share its start only if it is what this verifier
    computes: a float16 blob's rounded K/V, copied into other sessions, could change their tokens."""
    source, engine = TargetEngine(target), TargetEngine(target)
    source.prefill("s", LONG)
    engine.import_session("s", LONG, source.export_session("s", len(LONG), dtype=dtype))
    assert engine.session("s").exact_kv == (dtype == "")
    engine.release("s")
    other = LONG[:24] + [5, 6, 7]
    copied = engine.prefill("t", other).copied_tokens
    assert copied == (24 if dtype == "" else 0)
    length = engine.session("t").committed_length
    assert engine.verify("t", TokenTree.empty(), length).verdict.committed_token_ids == tuple(hf_greedy(target.model, other, 1))


def test_a_blob_of_another_model_is_refused_even_by_an_empty_verifier(target):
    """A blob whose heads or head size differ is refused before it is written (on an empty verifier it would have
    set the K/V store's shape, and every later forward would have failed)."""
    engine = TargetEngine(target)
    kv_heads, head_dim = engine._kv_shape
    wrong = [(torch.zeros(kv_heads + 1, len(PROMPT) - 1, head_dim),) * 2 for _ in range(engine._num_layers)]
    with pytest.raises(InvalidArgument, match="another model"):
        engine.import_session("s", PROMPT, offload.layers_to_bytes(wrong))
    assert "s" not in engine._sessions
    engine.prefill("s", PROMPT)  # the verifier is untouched
    assert decode(engine, "s", 6) == hf_greedy(target.model, PROMPT, 6)


def test_a_failed_prefix_copy_fails_that_prefill_only(target):
    """Copying a shared start can fail (the K/V store growing past the device's memory): that Prefill is answered
    with the error, its slot and admitted prompt tokens are given back, and the verifier goes on."""
    engine = TargetEngine(target)
    engine.prefill("a", LONG)
    share, calls = engine._prefixes.share, []

    def failing_share(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return share(*args, **kwargs)

    engine._prefixes.share = failing_share
    free = engine._store.num_free
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.prefill("b", LONG[:20] + [9, 9])
    assert "b" not in engine._sessions and engine._sessions._queued_prefill_tokens == 0
    engine.prefill("b", LONG[:20] + [9, 9])  # the same id again, now that the copy works
    assert engine._store.num_free == free - 1
    length = engine.session("b").committed_length
    assert list(engine.verify("b", TokenTree.empty(), length).verdict.committed_token_ids) == \
        hf_greedy(target.model, LONG[:20] + [9, 9], 1)
