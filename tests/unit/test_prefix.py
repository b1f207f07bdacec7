"""Kept prompts' K/V (``verifier_service.prefix``): what is copied, what is kept, what is let go."""

import torch

from verifier_service.prefix import MIN_REUSE, Prefilling, PrefixCache
from verifier_service.slots import SlotStore

LAYERS = 2


def store_with(slot: int, length: int, seed: int) -> SlotStore:
    """A slot store whose ``slot`` holds ``length`` positions of random K/V in each layer."""
    gen = torch.Generator().manual_seed(seed)
    store = SlotStore(max_slots=4, grow_tokens=16)
    store.write_session(slot, [(torch.randn(2, length, 8, generator=gen), torch.randn(2, length, 8, generator=gen))
                               for _ in range(LAYERS)], torch.float32, "cpu")
    return store


def test_the_longest_common_start_is_copied_into_the_new_slot():
    source = store_with(0, 30, seed=1)
    cache = PrefixCache(capacity=100)
    kept = list(range(100, 130))
    cache.keep(source, 0, kept, LAYERS)
    target = store_with(3, 1, seed=2)
    assert cache.share(target, 3, kept[:25] + [7, 8, 9], []) == 25
    for layer in range(LAYERS):
        assert torch.equal(target.read(layer, 3, 25)[0], source.read(layer, 0, 25)[0])
        assert torch.equal(target.read(layer, 3, 25)[1], source.read(layer, 0, 25)[1])
    assert cache.share(target, 3, kept[:MIN_REUSE - 1] + [7], []) == 0  # too short to bother
    assert cache.share(target, 3, [1] + kept, []) == 0  # the start differs


def test_a_prompt_already_held_adds_nothing_and_a_longer_one_replaces_it():
    store = store_with(0, 40, seed=3)
    cache = PrefixCache(capacity=100)
    cache.keep(store, 0, list(range(20)), LAYERS)
    cache.keep(store, 0, list(range(10)), LAYERS)  # a prefix of a kept prompt
    assert cache.held == 20
    cache.keep(store, 0, list(range(40)), LAYERS)  # extends it: only the longer is kept
    assert cache.held == 40


def test_least_recently_used_prompts_go_first_past_the_capacity():
    store = store_with(0, 30, seed=4)
    cache = PrefixCache(capacity=70)
    a, b, c = ([base + i for i in range(30)] for base in (1000, 2000, 3000))
    cache.keep(store, 0, a, LAYERS)
    cache.keep(store, 0, b, LAYERS)
    assert cache.share(store, 1, a, []) == 30  # a is used again: b is now the oldest
    cache.keep(store, 0, c, LAYERS)
    assert cache.held == 60
    assert cache.share(store, 1, b, []) == 0 and cache.share(store, 1, a, []) == 30
    assert cache.share(store, 1, c, []) == 30
    long = [4000 + i for i in range(80)]
    cache.keep(store_with(0, 80, seed=5), 0, long, LAYERS)  # longer than the whole capacity: its start is kept
    assert cache.held == 70 and cache.share(store, 1, long, []) == 70
    off = PrefixCache(capacity=0)
    off.keep(store, 0, a, LAYERS)
    assert off.held == 0 and off.share(store, 1, a, []) == 0


def test_a_start_shared_with_a_prompt_being_prefilled_is_copied_from_its_slot_once_computed():
    store = store_with(0, 40, seed=6)  # slot 0: a prompt being prefilled, 40 of its positions cached so far
    leader = list(range(500, 600))
    cache = PrefixCache(capacity=200)
    follower = leader[:50] + [7, 8]
    assert cache.share(store, 2, follower, [Prefilling(0, leader, 40)]) is None  # 50 shared, 40 computed: wait
    assert cache.share(store, 2, follower, [Prefilling(0, leader, 50)]) == 50
    for layer in range(LAYERS):
        assert torch.equal(store.read(layer, 2, 50)[0], store.read(layer, 0, 50)[0])
        assert torch.equal(store.read(layer, 2, 50)[1], store.read(layer, 0, 50)[1])
    assert cache.share(store, 2, leader[:MIN_REUSE - 1] + [7], [Prefilling(0, leader, 0)]) == 0  # too short to wait


def test_a_kept_start_is_copied_at_once_unless_a_prompt_being_prefilled_shares_much_more():
    store = store_with(0, 60, seed=7)
    prompt = list(range(700, 760))
    cache = PrefixCache(capacity=200)
    cache.keep(store, 0, prompt[:30], LAYERS)
    assert cache.share(store, 2, prompt[:35] + [1], [Prefilling(1, prompt, 0)]) == 30  # 5 more: not worth a wait
    assert cache.share(store, 2, prompt[:50] + [1], [Prefilling(1, prompt, 0)]) is None  # 20 more: wait for it
    assert cache.share(store, 2, prompt[:50] + [1], []) == 30
    assert PrefixCache(capacity=0).share(store, 2, prompt[:50] + [1], [Prefilling(0, prompt, 60)]) == 0  # off
