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
    original = a.session("s").cache
    restored = b.session("s").cache
    for la, lb in zip(original.layers, restored.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
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
    for la, lb in zip(engine.session("s").cache.layers, other.session("s").cache.layers):
        assert lb.keys.dtype == torch.float32
        torch.testing.assert_close(la.keys, lb.keys, atol=2e-2, rtol=1e-3)


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
