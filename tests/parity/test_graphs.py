"""A fixed-shape (CUDA-graph) tick gives every real token what the lean packed forward gives it.

Rows padded to R_b x Q_b tokens over S_b keys, padding rows in the scratch slot: each real token's logits and final
hidden state must match the lean forward of the same rows, and each session's cached K/V must be the same (the
padding writes nowhere a session reads). Here the fixed batches run eagerly; with SPECSPLIT_TEST_DEVICE=cuda they
are captured and replayed as CUDA graphs.
"""

import pytest
import torch

from specsplit.errors import ResourceExhausted
from tiny import DEVICE, tiny_llama
from verifier_service.batching import pack_rows, prefill_row, verify_row
from verifier_service.graphs import MAX_TOKENS, GraphedForward, bucket, fixed_batch
from verifier_service.lean import LeanPackedLlama
from verifier_service.slots import SlotStore, use_packed_attention

from test_slot_cache import PREFIXES, ROOTS, TREES


def lean_model():
    model = tiny_llama(seed=5).to(DEVICE)
    use_packed_attention(model)
    return LeanPackedLlama(model)


def test_fixed_shape_ticks_give_each_token_the_lean_forwards_logits():
    lean = lean_model()
    stores = {"lean": SlotStore(max_slots=8, grow_tokens=16), "fixed": SlotStore(max_slots=8, grow_tokens=16,
                                                                                scratch=True)}
    graphed = GraphedForward(lean, max_rows=8, device=DEVICE, dtype=torch.float32)
    slots = [2, 0, 3, 1]  # not in slot order
    with torch.inference_mode():
        for store in stores.values():  # the prompts, through the lean forward in both
            lean(store, pack_rows([prefill_row(s, 0, p) for s, p in zip(slots, PREFIXES)], torch.float32, DEVICE), [])
        starts = [len(p) for p in PREFIXES]
        # Which sessions each tick verifies (trees of 8, 4, 1 and 5 tokens): all four; again further on; three;
        # all four after a prompt chunk ran the lean forward and grew the KV storage (so the graphs are captured
        # again: on a GPU a capture into the dropped graphs' memory pool failed in the concurrency bench); three
        # whose shape was captured before the storage moved (replaying that graph would write the old storage).
        for round_, chosen in enumerate([(0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2), (0, 1, 2, 3), (0, 2, 3)]):
            if round_ == 3:
                chunk = list(range(100, 160))
                for store in stores.values():
                    lean(store, pack_rows([prefill_row(slots[1], starts[1], chunk)], torch.float32, DEVICE), [])
                starts[1] += len(chunk)
            rows = [verify_row(slots[i], starts[i], ROOTS[i], TREES[i]) for i in chosen]
            keep = list(range(sum(len(r) for r in rows)))  # a verification tick wants every token's logits
            expected = lean(stores["lean"], pack_rows(rows, torch.float32, DEVICE), keep, hidden=round_ != 1)
            assert graphed(stores["fixed"], rows, keep[:-1]) is None  # (a prompt chunk's tick: not graphed)
            got = graphed(stores["fixed"], rows, keep, hidden=round_ != 1)
            assert got is not None and got[0].shape == expected[0].shape
            torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
            if round_ == 1:
                assert got[1] is None
            else:
                torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)
            assert torch.equal(got[0].argmax(-1), expected[0].argmax(-1))
            for i, row in zip(chosen, rows):
                starts[i] += len(row)  # (all of a block cached)
    # rows x tokens x keys: (4, 8, 64) three times, one capture; (4, 8, 128) and (4, 8, 64) over the new storage
    assert not graphed.failed and graphed.replays == 5 and graphed.captures == 3
    for layer in range(len(lean.layers)):
        for slot, length in zip(slots, starts):
            for name in ("keys", "values"):
                torch.testing.assert_close(getattr(stores["fixed"], name)[layer][slot, :, :length],
                                           getattr(stores["lean"], name)[layer][slot, :, :length], rtol=1e-5, atol=1e-5)


def test_the_fixed_shape_pads_rows_tokens_and_keys():
    rows = [verify_row(s, start, root, tree) for s, start, root, tree in zip([2, 0, 3], [10, 1, 7], ROOTS, TREES)]
    store = SlotStore(max_slots=8, grow_tokens=16, scratch=True)
    graphed = GraphedForward(lean_model(), max_rows=8, device=DEVICE, dtype=torch.float32)
    assert graphed.shape(store, rows) == (4, 8, 32)  # 3 rows -> 4; longest 8 tokens; 10 + 8 keys -> 2 steps of 16
    assert graphed.shape(store, [verify_row(0, 40, 1, TREES[0])]) == (1, 8, 64)  # 48 keys -> 4 steps (a power of 2)
    near_the_end = GraphedForward(graphed.lean, max_rows=8, device=DEVICE, dtype=torch.float32, max_context=40)
    assert near_the_end.shape(store, [verify_row(0, 40, 1, TREES[0])]) == (1, 8, 48)  # no more steps than the context
    assert graphed.shape(store, rows[2:]) == (1, 4, 16)  # at least 4 tokens a row
    assert graphed.shape(store, rows * 3) is None  # 9 rows > max_rows
    long = [prefill_row(0, 0, list(range(3, 3 + MAX_TOKENS + 1)))]
    assert graphed.shape(store, long) is None  # a prefill chunk past MAX_TOKENS runs the lean forward
    tokens, slots, mask, index = fixed_batch(rows, (4, 8, 32), store.scratch, torch.float32)
    assert tokens.shape == (4, 32) and slots.tolist() == [2, 0, 3, 8] and mask.shape == (4, 1, 8, 32)
    assert index == [*range(0, 8), *range(8, 12), 16]  # each real token's place in the fixed batch
    assert tokens[3].tolist() == [2] * 8 + [0] * 8 + [3] * 8 + [8] * 8  # the padding row writes the scratch slot
    assert tokens[2, 8:16].tolist() == list(range(1, 9))  # row 2's padding tokens write past its block
    visible = mask[:, 0] == 0  # [R_b, Q_b, S_b]
    assert visible[1, 0].nonzero().flatten().tolist() == [0, 1]  # its prefix and itself
    assert visible[1, 5].nonzero().flatten().tolist() == [6]  # a padding query sees only its own key
    assert visible[3].sum(-1).tolist() == [1] * 8
    assert bucket(5) == 8 and bucket(1, 4) == 4 and bucket(16) == 16
    assert sorted(store.acquire() for _ in range(8)) == list(range(8))  # no session ever gets the scratch slot
    with pytest.raises(ResourceExhausted):
        store.acquire()
