"""CUDA graphs of the verifier's packed forward: a verification tick replayed, not issued kernel by kernel.

A small target's packed forward on a GPU is paced by the host issuing its ~1,200 kernels one by one, not by the
GPU (SmolLM2-135M on an H200: 16-17 ms through ``verifier_service.lean`` for 1 to 16 rows of 4 tokens, HF's own
decode step 23 ms; ``bench/results/concurrency_h200_eager``). A CUDA graph records those kernels once and
replays them in one launch. A graph fixes every shape and address, so a graphed tick runs a *fixed-shape*
packed batch as one attention group: R_b rows (the tick's rows rounded up to a power of two; the extra rows
write only to the store's scratch slot, ``SlotStore(scratch=True)``) of Q_b tokens each (the longest row
rounded up to a power of two, at least 4; a shorter row's padding tokens write past its block, where nothing is
read before it is written again) over S_b keys (the longest prefix plus Q_b, rounded up to the store's growth
step). The tick's tokens, positions, slots and mask are copied into the graph's own buffers, the graph is
replayed, and the real tokens' logits (and final hidden states) are gathered out.

The same weights and operations in the same order as the lean forward; only the shapes differ, by padding no
real token sees: each real query attends exactly its prefix and its tree ancestors, and the linear layers act on
tokens independently. Only verification ticks are graphed (every row a Verify's tree or a decode step); a tick with
a prompt chunk, or over ``MAX_TOKENS`` padded tokens or ``max_rows`` rows, runs the lean forward as before. A graph
is captured on a shape's first use (S_b in powers of two of the store's growth step, so few shapes) against the
store's storage: when the storage is reallocated (it grows for a longer sequence) the graphs are dropped and
captured again. All graphs write into one pair of output buffers, so a graph holds only its inputs. Off a GPU
the same happens without CUDA: a "graph" is the fixed batch over the storage as it was at capture, run again on
each replay (what the CPU tests check, stale storage included); a capture that fails is logged once and leaves
the verifier on the lean forward.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass

import torch

from verifier_service.batching import AttentionGroup, PackedBatch, Row, attention_mask
from verifier_service.lean import LeanPackedLlama
from verifier_service.slots import SlotStore

log = logging.getLogger(__name__)

MIN_QUERIES = 4  # Q_b >= 4, so a fixed batch's LM head takes its rows as they are (``slots.head_rows``)
MAX_TOKENS = 1024  # padded tokens (R_b x Q_b) a graphed tick may hold: the outputs are [1024, V] and [1024, H]
_CAPTURING = threading.Lock()  # one capture at a time in a process (two engines may share a GPU)


def bucket(n: int, least: int = 1) -> int:
    """The least power of two >= max(n, least)."""
    return 1 << (max(n, least) - 1).bit_length()


class _Frozen:
    """The slot store as a graph sees it: the layer tensors of its capture, never grown or replaced."""

    def __init__(self, store: SlotStore):
        self.keys, self.values = list(store.keys), list(store.values)

    def layer(self, layer_idx: int, like: torch.Tensor, num_slots: int, length: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer_idx], self.values[layer_idx]  # [slots_alloc, H_kv, capacity, D] each


@dataclass
class _Graph:
    tokens: torch.Tensor  # [4, R_b Q_b] its input buffer: token ids, RoPE positions, cache positions, slots
    slots: torch.Tensor  # [R_b] the rows' slots
    mask: torch.Tensor  # [R_b, 1, Q_b, S_b] additive attention mask
    batch: PackedBatch  # the fixed-shape batch over those buffers (views)
    store: _Frozen | None  # the storage it reads and writes (on a GPU only until captured: the graph holds it)
    graph: "torch.cuda.CUDAGraph | None" = None  # None off a GPU: each replay runs the fixed batch again


def fixed_batch(rows: list[Row], shape: tuple[int, int, int], scratch: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Host tensors of ``rows`` as a fixed-shape batch (R_b, Q_b, S_b): [4, R_b Q_b] token ids, RoPE positions,
    cache positions and slots; [R_b] slots; [R_b, 1, Q_b, S_b] mask; and for each real token in packed order (row
    after row, as ``batching.pack_rows`` lays them) its index in the fixed batch."""
    r_b, q_b, s_b = shape
    padded = rows + [Row(scratch, 0, (), (), torch.ones(0, 0, dtype=torch.bool))] * (r_b - len(rows))
    ids, positions, cache_positions, slots = [], [], [], []
    for row in padded:
        n = len(row)
        ids += [*row.input_ids, *[0] * (q_b - n)]
        positions += [row.start + d for d in row.depths] + list(range(row.start + n, row.start + q_b))
        cache_positions += range(row.start, row.start + q_b)
        slots += [row.slot] * q_b
    index = [b * q_b + i for b, row in enumerate(rows) for i in range(len(row))]
    return (torch.tensor([ids, positions, cache_positions, slots]), torch.tensor([row.slot for row in padded]),
            attention_mask(padded, q_b, s_b, dtype), index)


def _as_batch(tokens: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, scratch: int) -> PackedBatch:
    """The fixed-shape batch over buffers ([4, T], [R_b], [R_b, 1, Q_b, S_b]): one dense group, its K/V gathered
    by slot (never a view: the slots change from replay to replay)."""
    r_b, _, q_b, s_b = mask.shape
    total = tokens.shape[1]
    unused = tokens.new_zeros(0)
    group = AttentionGroup(tuple(range(r_b)), slots, s_b, mask, unused, unused, unused, unused, None, (0, total))
    return PackedBatch(tokens[0:1], tokens[1:2], tokens[3], tokens[2], tuple(range(0, total + 1, q_b)), (group,),
                       scratch, s_b)


class GraphedForward:
    """``GraphedForward(lean, max_rows, device, dtype)(store, rows, keep, hidden)``: what the lean forward of
    ``pack_rows(rows)`` returns ([K, V] logits at the packed indices ``keep``, [T, H] final hidden states or
    None), or None where the tick is not graphed (the caller then runs the lean forward): a graphed tick wants
    every token's logits (``keep`` is all of them: verification rows only)."""

    def __init__(self, lean: LeanPackedLlama, max_rows: int, device: torch.device | str, dtype: torch.dtype,
                 max_context: int = 1 << 30):
        self.lean = lean
        self.max_rows, self.max_context = max_rows, max_context  # (S_b's power of two stops at the context)
        self.device, self.dtype = torch.device(device), dtype
        self.capture = self.device.type == "cuda"  # off a GPU a "graph" runs its fixed batch again
        self.failed = False  # a capture failed: lean forwards from then on
        self.replays = self.captures = 0
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self._generation = -1  # the store's generation the graphs were captured against
        self._pool = None  # one memory pool for all graphs (they never run at once)
        self._stream = torch.cuda.Stream(self.device) if self.capture else None  # warm-ups and captures run here
        vocab, hidden = lean.lm_head.shape  # [V, H]
        h_kv = lean.layers[0].k.shape[0] // lean.head_dim
        self._like = torch.empty(1, h_kv, lean.head_dim, dtype=dtype, device=self.device)  # [1, H_kv, D] new K/V's
        self._logits = torch.empty(MAX_TOKENS, vocab, dtype=dtype, device=self.device)  # [MAX_TOKENS, V]
        self._hidden = torch.empty(MAX_TOKENS, hidden, dtype=dtype, device=self.device)  # [MAX_TOKENS, H]

    def shape(self, store: SlotStore, rows: list[Row]) -> tuple[int, int, int] | None:
        """(R_b, Q_b, S_b) of the rows' fixed batch, or None if it would not fit."""
        r_b, q_b = bucket(len(rows)), bucket(max(len(row) for row in rows), MIN_QUERIES)
        step = store.grow_tokens
        steps = -(-(max(row.start for row in rows) + q_b) // step)
        s_b = step * max(steps, min(bucket(steps), -(-self.max_context // step)))
        return (r_b, q_b, s_b) if r_b <= self.max_rows and r_b * q_b <= MAX_TOKENS else None

    def __call__(self, store: SlotStore, rows: list[Row], keep: list[int], hidden: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        if self.failed or store.scratch is None or len(keep) != sum(len(row) for row in rows):
            return None  # (a prompt chunk wants no logits: its tick runs the lean forward)
        shape = self.shape(store, rows)
        if shape is None:
            return None
        with torch.cuda.device(self.device) if self.capture else contextlib.nullcontext():
            graph = self._graph(store, shape)
            if graph is None:
                return None
            tokens, slots, mask, index = fixed_batch(rows, shape, store.scratch, self.dtype)
            picked = torch.tensor(index, device=self.device)  # [T] (keep is every token, in packed order)
            graph.tokens.copy_(tokens)  # (host copies before the replay: the host never waits for it)
            graph.slots.copy_(slots)
            graph.mask.copy_(mask)
            if graph.graph is not None:
                graph.graph.replay()
            else:
                self._run(graph)
            self.replays += 1
            return self._logits[picked], (self._hidden[picked] if hidden else None)  # [K, V], [K, H]: copies

    def _run(self, graph: _Graph) -> None:
        """What a graph records: the lean forward of its fixed batch, into the shared outputs."""
        logits, final = self.lean(graph.store, graph.batch, None, True)  # [T_b, V], [T_b, H]
        self._logits[:logits.shape[0]].copy_(logits)
        self._hidden[:final.shape[0]].copy_(final)

    def _graph(self, store: SlotStore, shape: tuple[int, int, int]) -> _Graph | None:
        """The shape's graph (captured now if new, or if the store's storage was reallocated since)."""
        self._forget_moved(store)  # (before growing: the graphs' hold on the old storage goes first)
        try:
            for layer_idx in range(len(self.lean.layers)):  # every slot, S_b positions: no write in a graph grows it
                store.layer(layer_idx, self._like, store.scratch + 1, shape[2])
        except torch.cuda.OutOfMemoryError:
            log.warning("no memory to grow the KV cache to %d positions for a graphed tick; it runs the lean forward",
                        shape[2])
            return None
        self._forget_moved(store)
        if shape not in self._graphs:
            try:
                with _CAPTURING:
                    self._graphs[shape] = self._capture(store, shape)
            except Exception:  # noqa: BLE001 -- any failure to capture costs speed, never a token
                log.exception("capturing a CUDA graph of the verifier's forward failed; it runs without graphs")
                self.failed = True
                self._graphs.clear()
                return None
        return self._graphs[shape]

    def _forget_moved(self, store: SlotStore) -> None:
        if store.generation != self._generation:  # reallocated: every graph reads and writes the old tensors
            self._graphs.clear()
            self._pool = None  # (its pool went with its graphs: capturing into it again fails an allocator assert)
            self._generation = store.generation

    def _capture(self, store: SlotStore, shape: tuple[int, int, int]) -> _Graph:
        start = time.perf_counter()
        tokens, slots, mask, _ = fixed_batch([], shape, store.scratch, self.dtype)  # padding rows only: the
        tokens, slots, mask = (t.to(self.device) for t in (tokens, slots, mask))  # warm-up writes the scratch slot
        graph = _Graph(tokens, slots, mask, _as_batch(tokens, slots, mask, store.scratch), _Frozen(store))
        if self.capture:
            current = torch.cuda.current_stream(self.device)
            try:
                self._stream.wait_stream(current)
                with torch.cuda.stream(self._stream):  # a first run outside the capture (kernels chosen, workspaces)
                    self._run(graph)
                current.wait_stream(self._stream)
                graph.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph.graph, pool=self._pool, stream=self._stream,
                                      capture_error_mode="thread_local"):
                    self._run(graph)
            finally:  # (a capture that fails leaves its stream current)
                torch.cuda.set_stream(current)
            self._pool = graph.graph.pool()
            graph.store = None  # the graph holds the storage's addresses; a reallocation drops the graph first
        self.captures += 1
        log.info("captured the verifier's forward for %d rows x %d tokens over %d keys in %.0f ms (%d graphs)",
                 *shape, (time.perf_counter() - start) * 1e3, len(self._graphs) + 1)
        return graph


def graphed_forward_for(forward, config, max_context: int, device: torch.device | str, dtype: torch.dtype
                        ) -> GraphedForward | None:
    """The verifier's graphed forward where ``config.cuda_graphs`` asks for it and ``forward`` (``lean.
    packed_forward_for``) is the lean one, else None. max_context: the longest sequence a session may reach."""
    if not config.cuda_graphs:
        return None
    if not isinstance(forward, LeanPackedLlama):
        log.warning("cuda_graphs needs the lean forward of a Llama-architecture target; running without graphs")
        return None
    if torch.device(device).type != "cuda":
        log.warning("cuda_graphs on %s: no CUDA graphs there; verification ticks run padded to fixed shapes without "
                    "them (slower: what the CPU tests check)", device)
    return GraphedForward(forward, config.max_batch, device, dtype, max_context)
