"""Prompt prefix reuse: a new session whose prompt begins like an earlier one's gets that part's K/V copied into its
slot instead of computed.

Sessions of one deployment share the start of their prompts: the chat template's system turn (SmolLM2's default
is 27 tokens of every prompt), an application's instructions, the earlier turns of a conversation sent again
with its next message. When a prompt's prefill is done its cached K/V are kept here (a copy, on the model's
device), least recently used first out once ``capacity`` tokens are held. A later prompt's longest common prefix
with a kept one, if at least ``MIN_REUSE`` tokens, is copied into the new session's slot -- a memory copy, where
computing those positions costs a forward of the whole model per chunk -- and its prefill goes on from there.
Prompts that arrive together (a burst of sessions under one long system turn) share it the same way: a prompt whose
start a prompt still being prefilled shares waits for that one's chunks to pass it, then copies it from that slot.

The K/V of a position depend only on the tokens up to it, so the copied rows are what the new session's own
prefill would compute, up to the floating-point order of a different chunking (a chunked prefill already differs
from a one-shot one the same way; the parity tests check the tokens). Sessions that need every prompt position's
hidden states (features for an EAGLE draft, Medusa) prefill in full. ``share`` and ``keep`` run on the model thread;
``clear`` on any.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple

import torch

from specsplit.kvcache import common_length
from verifier_service.slots import SlotStore

MIN_REUSE = 8  # shorter common prefixes (a BOS token, a template's first tokens) are computed: nothing to gain


class Prefilling(NamedTuple):
    """A prompt being prefilled now: ``slot`` holds the K/V of its first ``cached`` tokens."""
    slot: int
    token_ids: list[int]
    cached: int


class PrefixCache:
    def __init__(self, capacity: int):
        """capacity: prompt tokens whose K/V are kept (0: reuse nothing)."""
        self.capacity = capacity
        self._kept: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self.held = 0  # tokens held
        self._lock = threading.Lock()  # (clear from another thread)

    def share(self, store: SlotStore, slot: int, token_ids: list[int], prefilling: list[Prefilling]) -> int | None:
        """Copy into positions [0, n) of ``slot`` the longest start ``token_ids`` shares (n at least MIN_REUSE) with a
        kept prompt or with one being prefilled now (``prefilling``, whose slot holds its first ``cached``
        positions); returns n (0: nothing copied). None: a
        prompt being prefilled shares at least MIN_REUSE more tokens than any kept one but has not computed them
        yet -- wait for it (sessions that arrive together under one long system turn compute it once)."""
        if self.capacity <= 0:
            return 0
        with self._lock:
            best, kept = self._longest_kept(token_ids)
            live, shared = None, 0
            for other in prefilling:
                n = common_length(other.token_ids, token_ids)
                if n > shared:
                    live, shared = other, n
            if live is not None and shared >= MIN_REUSE and shared > kept:
                if live.cached >= shared:
                    store.copy_prefix(live.slot, slot, shared)
                    return shared
                if shared - kept >= MIN_REUSE:
                    return None
            return self._copy_kept(store, slot, best, kept)

    def _longest_kept(self, token_ids: list[int]) -> tuple[tuple[int, ...] | None, int]:
        """The kept prompt sharing the longest start with ``token_ids`` and its length ((None, 0): under MIN_REUSE)."""
        best, length = None, 0
        for kept in self._kept:
            n = common_length(kept, token_ids)
            if n > length:
                best, length = kept, n
        return (best, length) if length >= MIN_REUSE else (None, 0)

    def _copy_kept(self, store: SlotStore, slot: int, best: tuple[int, ...] | None, length: int) -> int:
        if best is None:
            return 0
        self._kept.move_to_end(best)
        layers = self._kept[best]
        store.write_session(slot, [(k[:, :length], v[:, :length]) for k, v in layers], layers[0][0].dtype,
                            layers[0][0].device)
        return length

    def keep(self, store: SlotStore, slot: int, token_ids: list[int], num_layers: int) -> None:
        """Keep the K/V of a prompt just cached at positions [0, len(token_ids)) of ``slot`` (its first ``capacity``
        tokens, if longer)."""
        with self._lock:
            self._keep(store, slot, tuple(token_ids), num_layers)

    def clear(self) -> None:
        """Let every kept prompt go (a benchmark's runs each start cold)."""
        with self._lock:
            self._kept.clear()
            self.held = 0

    def _keep(self, store: SlotStore, slot: int, key: tuple[int, ...], num_layers: int) -> None:
        key = key[:self.capacity]  # (a conversation longer than the capacity: its start)
        if len(key) < MIN_REUSE:
            return
        for kept in list(self._kept):
            if kept[:len(key)] == key:  # already held, as this prompt or a longer one
                self._kept.move_to_end(kept)
                return
            if key[:len(kept)] == kept:  # this prompt extends a kept one: keep only the longer
                self._drop(kept)
        self._kept[key] = [(k[slot, :, :len(key)].clone(), v[slot, :, :len(key)].clone())  # [H_kv, L, D] each
                           for k, v in zip(store.keys[:num_layers], store.values[:num_layers])]
        self.held += len(key)
        while self.held > self.capacity:
            self._drop(next(iter(self._kept)))

    def _drop(self, key: tuple[int, ...]) -> None:
        del self._kept[key]
        self.held -= len(key)

