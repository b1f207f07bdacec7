"""Packed forwards over the slot cache give every row the logits of a plain forward of its own session.

Sessions of different lengths are prefilled in one packed forward (chunked), then verified in one
packed tree forward; each row must match an unbatched HF forward of exactly its own tokens. A mask,
packing or slot bug that lets rows see each other (or padding) breaks these equalities.
"""

import torch

from specsplit.kvcache import cache_kwarg, new_cache
from specsplit.tree import TokenTree
from tiny import tiny_llama
from verifier_service.batching import pack_rows, prefill_row, verify_row
from verifier_service.lean import LeanPackedLlama
from verifier_service.slots import SlotStore, packed_forward, use_packed_attention

PREFIXES = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38], [5], [26, 53, 58, 97, 93, 23, 84], list(range(40, 75))]
ROOTS = [62, 64, 33, 83]
TREES = [
    TokenTree((11, 12, 13, 14, 15, 16, 17), (-1, -1, 0, 0, 2, 1, 5)),
    TokenTree.chain([21, 22, 23]),
    TokenTree.empty(),
    TokenTree((41, 42, 43, 44), (-1, -1, -1, 2)),
]


def packed_model(seed):
    model = tiny_llama(seed=seed)
    use_packed_attention(model)
    return model


def forward(model, store, rows):
    """Per row its [Q_b, V] logits, from one packed forward."""
    packed = pack_rows(rows, torch.float32)
    logits, _ = packed_forward(model, store, packed, cache_kwarg(model))  # [T, V]
    offsets = packed.row_offsets
    return [logits[a:b] for a, b in zip(offsets, offsets[1:])]


def prefill_all(model, store, slots, chunk):
    """Cache every prefix in batched chunks of ``chunk`` tokens (rows of different lengths together)."""
    done = [0] * len(PREFIXES)
    while any(d < len(p) for d, p in zip(done, PREFIXES)):
        rows = []
        for i, prefix in enumerate(PREFIXES):
            if done[i] < len(prefix):
                rows.append(prefill_row(slots[i], done[i], prefix[done[i]:done[i] + chunk]))
                done[i] += len(rows[-1])
        forward(model, store, rows)


def test_batched_tree_logits_match_each_session_alone():
    torch.manual_seed(0)
    model = packed_model(3)
    store = SlotStore(max_slots=8, grow_tokens=16)
    slots = [store.acquire() for _ in PREFIXES]
    slots[1], slots[3] = slots[3], slots[1]  # rows not in slot order: the gathered (non-view) path
    with torch.no_grad():
        prefill_all(model, store, slots, chunk=6)
        rows = [verify_row(s, len(p), root, tree) for s, p, root, tree in zip(slots, PREFIXES, ROOTS, TREES)]
        logits = forward(model, store, rows)
        for b, (prefix, root, tree) in enumerate(zip(PREFIXES, ROOTS, TREES)):
            reference = model(torch.tensor([prefix + [root]])).logits[0, -1]  # [V]
            assert torch.allclose(logits[b][0], reference, atol=1e-4), f"session {b} root"
            for node in range(len(tree)):
                path = [tree.token_ids[i] for i in tree.path_to(node)]
                reference = model(torch.tensor([prefix + [root] + path])).logits[0, -1]  # [V]
                assert torch.allclose(logits[b][node + 1], reference, atol=1e-4), f"session {b} node {node}"


def test_compaction_then_next_round_matches_a_fresh_prefill():
    model = packed_model(4)
    store = SlotStore(max_slots=4, grow_tokens=8)
    slots = [store.acquire() for _ in PREFIXES]  # 0, 1, 2, 3: the contiguous (view) path
    with torch.no_grad():
        prefill_all(model, store, slots, chunk=100)
        rows = [verify_row(s, len(p), root, tree) for s, p, root, tree in zip(slots, PREFIXES, ROOTS, TREES)]
        forward(model, store, rows)
        accepted = [TREES[0].path_to(4), [0, 1], [], [2, 3]]  # node paths each session "accepted"
        committed = []
        for b, (prefix, root, tree, path) in enumerate(zip(PREFIXES, ROOTS, TREES, accepted)):
            store.compact_many([(slots[b], len(prefix), (0, *(n + 1 for n in path)))])
            committed.append(prefix + [root] + [tree.token_ids[n] for n in path])
        for b, tokens in enumerate(committed):  # the slot holds exactly the committed tokens' K/V
            reference = new_cache(model)
            model(torch.tensor([tokens]), use_cache=True, **{cache_kwarg(model): reference})
            for layer in range(model.config.num_hidden_layers):
                keys, values = store.read(layer, slots[b], len(tokens))
                assert torch.allclose(keys, reference.layers[layer].keys[0], atol=1e-4), (b, layer)
                assert torch.allclose(values, reference.layers[layer].values[0], atol=1e-4), (b, layer)
        nxt = [7, 8, 9, 10]
        rows = [verify_row(s, len(c), t, TokenTree.empty()) for s, c, t in zip(slots, committed, nxt)]
        logits = forward(model, store, rows)
        for b, tokens in enumerate(committed):
            reference = model(torch.tensor([tokens + [nxt[b]]])).logits[0, -1]
            assert torch.allclose(logits[b][0], reference, atol=1e-4), b


def test_slots_are_reused_lowest_first_and_storage_grows():
    model = packed_model(5)
    store = SlotStore(max_slots=4, grow_tokens=8)
    a, b = store.acquire(), store.acquire()
    assert (a, b) == (0, 1)
    with torch.no_grad():
        forward(model, store, [prefill_row(b, 0, list(range(1, 20)))])
    assert store.keys[0].shape[0] == 2 and store.keys[0].shape[2] == 24  # slots for 0..1, 19 tokens -> 24
    store.release(a)
    assert store.acquire() == 0


def test_a_prefill_chunk_and_trees_in_one_packed_forward_each_match_their_session_alone():
    """Rows of very different lengths: several attention groups, one packed forward."""
    model = packed_model(6)
    store = SlotStore(max_slots=8, grow_tokens=16)
    slots = [store.acquire() for _ in PREFIXES]
    slots[0], slots[2] = slots[2], slots[0]
    late = list(range(100, 160))  # a new session's 60-token prompt chunk rides with the others' trees
    late_slot = store.acquire()
    with torch.no_grad():
        prefill_all(model, store, slots, chunk=100)
        rows = [verify_row(s, len(p), root, tree) for s, p, root, tree in zip(slots, PREFIXES, ROOTS, TREES)]
        rows.insert(1, prefill_row(late_slot, 0, late))
        assert len(pack_rows(rows, torch.float32).groups) > 1
        logits = forward(model, store, rows)
        reference = model(torch.tensor([late])).logits[0]  # [60, V]
        assert torch.allclose(logits[1], reference, atol=1e-4), "prefill chunk"
        del logits[1]
        for b, (prefix, root, tree) in enumerate(zip(PREFIXES, ROOTS, TREES)):
            for node in range(-1, len(tree)):
                path = [tree.token_ids[i] for i in tree.path_to(node)] if node >= 0 else []
                reference = model(torch.tensor([prefix + [root] + path])).logits[0, -1]  # [V]
                assert torch.allclose(logits[b][node + 1], reference, atol=1e-4), f"session {b} node {node}"


def test_one_tick_of_compactions_moves_each_accepted_row_after_its_own_prefix():
    torch.manual_seed(0)
    store = SlotStore(8)
    before = []
    for layer in range(2):
        keys, values = store.layer(layer, torch.zeros(1, 2, 4), 6, 20)  # like: [T, H_kv, D]
        keys.copy_(torch.randn_like(keys))
        values.copy_(torch.randn_like(values))
        before.append((keys.clone(), values.clone()))
    moves = [(0, 5, (0, 2, 3)), (3, 9, (1, 4, 5, 7)), (4, 2, (0, 1, 2)), (5, 0, (3,))]  # slot 4: a chain, no move
    store.compact_many(moves)
    for layer in range(2):
        expected = [t.clone() for t in before[layer]]  # [slots, H_kv, capacity, D]
        for slot, keep_from, rows in moves:
            for i, r in enumerate(rows):
                for t, old in zip(expected, before[layer]):
                    t[slot, :, keep_from + i] = old[slot, :, keep_from + r]
        assert torch.equal(store.keys[layer], expected[0]) and torch.equal(store.values[layer], expected[1])
    assert not torch.equal(store.keys[0], before[0][0])  # something did move


def test_the_lean_packed_forward_is_bit_identical_to_the_models_own():
    """Prefill chunks, then trees beside a new session's chunk (several attention groups, gathered slots): the
    lean forward's logits, hidden states and written K/V equal the model's own packed forward exactly."""
    model = packed_model(7)
    lean = LeanPackedLlama(model)
    stores = {"hf": SlotStore(max_slots=8, grow_tokens=16), "lean": SlotStore(max_slots=8, grow_tokens=16)}
    slots = [2, 0, 3, 1]
    late = list(range(100, 160))
    done = [0] * len(PREFIXES)
    ticks = []
    while any(d < len(p) for d, p in zip(done, PREFIXES)):
        ticks.append([prefill_row(slots[i], done[i], p[done[i]:done[i] + 6]) for i, p in enumerate(PREFIXES)
                      if done[i] < len(p)])
        done = [min(len(p), d + 6) for d, p in zip(done, PREFIXES)]
    trees = [verify_row(s, len(p), root, tree) for s, p, root, tree in zip(slots, PREFIXES, ROOTS, TREES)]
    ticks.append(trees[:1] + [prefill_row(4, 0, late)] + trees[1:])
    ticks.append(trees)  # equal rows' lengths differ: 8, 4, 1, 5
    with torch.no_grad():
        for rows in ticks:
            packed = pack_rows(rows, torch.float32)
            last = packed.num_tokens - 1
            # (2 or 3 kept rows run through the LM head as 4: ``slots.head_rows``)
            for keep in (list(range(0, packed.num_tokens, 2)), [0, last], [1, 2, last], [last]):
                expected = packed_forward(model, stores["hf"], packed, cache_kwarg(model), keep, hidden=True)
                got = lean(stores["lean"], packed, keep, hidden=True)
                assert got[0].shape == (len(keep), model.config.vocab_size)
                assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
            assert torch.equal(lean(stores["lean"], packed, [])[0], packed_forward(
                model, stores["hf"], packed, cache_kwarg(model), [])[0])  # no logits needed: the last token's
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(stores["lean"].keys[layer], stores["hf"].keys[layer])
        assert torch.equal(stores["lean"].values[layer], stores["hf"].values[layer])
