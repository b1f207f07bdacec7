"""Batched verification's pure parts: attention grouping, cost shares, the packed batch tensors, the scheduler."""

import time

import pytest
import torch

from specsplit.errors import Unavailable
from specsplit.tree import TokenTree
from verifier_service.batching import (ATTENTION_GROUP_OVERHEAD, GPU_ATTENTION_GROUP_OVERHEAD, cost_shares,
                                      group_overhead_for, pack_rows, plan_groups, prefill_row, verify_row)
from verifier_service.scheduler import Scheduler, Work
from verifier_service.slots import head_rows


def test_equal_rows_share_one_attention_group():
    assert plan_groups([5, 5, 5, 5], overhead_tokens=8) == [[0, 1, 2, 3]]


def test_one_long_row_gets_its_own_group_when_padding_costs_more_than_a_call():
    # 7 rows of 2 padded to 60 waste 7 * 58 queries, far more than a second call's 8.
    groups = plan_groups([2, 2, 60, 2, 2, 2, 2, 2], overhead_tokens=8)
    assert groups == [[0, 1, 3, 4, 5, 6, 7], [2]]


def test_padding_is_kept_when_calls_are_dear():
    assert len(plan_groups([2, 2, 60, 2, 2, 2, 2, 2], overhead_tokens=10_000)) == 1


def test_plan_covers_every_row_once():
    lengths = [1, 9, 3, 65, 17, 2, 33, 5, 5, 128]
    groups = plan_groups(lengths, overhead_tokens=8)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))


def test_cost_shares_add_up_and_split_the_fixed_cost():
    shares = cost_shares([1, 1, 1, 1], overhead_tokens=32, forward_ms=100.0)
    assert shares == [25.0] * 4
    shares = cost_shares([1, 9], overhead_tokens=32, forward_ms=100.0)
    assert abs(sum(shares) - 100.0) < 1e-9
    assert shares[1] > shares[0]  # the bigger tree pays for its tokens


def test_alone_a_row_pays_the_whole_forward():
    assert cost_shares([17], overhead_tokens=32, forward_ms=80.0) == [80.0]


def test_pack_rows_packs_tokens_and_masks_each_row_to_itself():
    tree = TokenTree((11, 12, 13), (-1, -1, 0))
    rows = [verify_row(slot=3, start=5, root_token=7, tree=tree), prefill_row(slot=0, start=2, token_ids=[4, 5])]
    packed = pack_rows(rows, torch.float32, group_overhead=10_000)  # one attention group
    assert packed.input_ids.tolist() == [[7, 11, 12, 13, 4, 5]]  # no padding in the packed sequence
    assert packed.position_ids.tolist() == [[5, 6, 6, 7, 2, 3]]
    assert packed.token_slots.tolist() == [3, 3, 3, 3, 0, 0]
    assert packed.token_positions.tolist() == [5, 6, 7, 8, 2, 3]  # nodes 0 and 1 share a depth, not a cache position
    assert packed.row_offsets == (0, 4, 6)
    (group,) = packed.groups
    assert group.rows == (1, 0) and group.slots.tolist() == [0, 3] and group.kv_length == 9  # in slot order
    assert group.first_slot is None and group.dense is None  # slots 0, 3 are gathered; rows 2 and 4 padded
    assert group.query_index.tolist() == [[4, 5, 6, 6], [0, 1, 2, 3]]  # 6 = T: the zero padding query
    assert group.token_index.tolist() == [4, 5, 0, 1, 2, 3]
    assert list(zip(group.out_rows.tolist(), group.out_offsets.tolist())) == [(0, 0), (0, 1), (1, 0), (1, 1),
                                                                               (1, 2), (1, 3)]
    allowed = group.attention_mask[:, 0] == 0  # [G, Q, S], S = 5 + 4
    assert allowed.shape == (2, 4, 9)
    assert allowed[1, 3].tolist() == [True] * 5 + [True, True, False, True]  # node 2: prefix, root, node 0, itself
    assert allowed[1, 2].tolist() == [True] * 5 + [True, False, True, False]  # node 1: prefix, root, itself
    assert allowed[0, 1].tolist() == [True, True, True, True] + [False] * 5  # prefix 2 + causal chunk
    assert allowed[0, 2].tolist() == [False] * 4 + [True] + [False] * 4  # padding sees only its own key


def test_pack_rows_never_lets_a_row_see_past_its_own_prefix():
    rows = [prefill_row(0, 10, [1]), prefill_row(1, 0, [2, 3, 4])]
    (group,) = pack_rows(rows, torch.float32, group_overhead=10_000).groups
    allowed = group.attention_mask[:, 0] == 0  # [2, 3, 13]
    assert not allowed[1, :, 3:].any()  # the short session cannot see positions the long one fills


def test_a_long_prefill_chunk_gets_its_own_attention_group_but_shares_the_packed_forward():
    rows = [verify_row(0, 40, 7, TokenTree.chain([1, 2])), prefill_row(1, 0, list(range(100, 164))),
            verify_row(2, 30, 8, TokenTree.empty())]
    packed = pack_rows(rows, torch.float32)
    assert packed.num_tokens == 3 + 64 + 1
    assert sorted(g.rows for g in packed.groups) == [(0, 2), (1,)]
    dense = {g.rows: g.dense for g in packed.groups}
    assert dense[(1,)] == (3, 67) and dense[(0, 2)] is None  # a lone row is a view; unequal rows are gathered
    assert {g.rows: g.first_slot for g in packed.groups} == {(1,): 1, (0, 2): None}
    assert packed.max_slot == 2 and packed.kv_length == 64
    covered = sorted(i for g in packed.groups for i in g.token_index.tolist())
    assert covered == list(range(packed.num_tokens))  # every packed token's attention is computed exactly once


class Recorder:
    """A run_tick that records each tick's works and answers them."""

    def __init__(self, delay: float = 0.0):
        self.ticks: list[list[str]] = []
        self.delay = delay

    def __call__(self, works):
        self.ticks.append([w.name for w in works])
        time.sleep(self.delay)
        for w in works:
            w.future.set_result(w.name)
        return []


def named(key, tokens, name):
    work = Work(key, tokens)
    work.name = name
    return work


def test_scheduler_batches_up_to_max_batch_and_tokens():
    rec = Recorder(delay=0.05)
    sched = Scheduler(rec, max_batch=3, max_tokens=10, wait_s=0.0)
    try:
        blocker = sched.submit(named("x", 1, "first"))  # occupies the thread while the rest queue up
        time.sleep(0.01)
        futures = [sched.submit(named(k, 4, k)) for k in "abcde"]
        assert [f.result(timeout=5) for f in [blocker, *futures]] == ["first", *"abcde"]
    finally:
        sched.close()
    assert rec.ticks[1:] == [["a", "b"], ["c", "d"], ["e"]]  # 4 + 4 tokens fit in 10, a third does not


def test_scheduler_never_puts_two_works_of_one_session_in_a_tick():
    rec = Recorder(delay=0.05)
    sched = Scheduler(rec, max_batch=8, max_tokens=100, wait_s=0.0)
    try:
        sched.submit(named("x", 1, "first"))
        time.sleep(0.01)
        futures = [sched.submit(named(k, 1, n)) for k, n in [("a", "a1"), ("b", "b1"), ("a", "a2"), ("c", "c1")]]
        [f.result(timeout=5) for f in futures]
    finally:
        sched.close()
    assert rec.ticks[1:] == [["a1", "b1"], ["a2", "c1"]]


def test_scheduler_waits_for_the_sessions_expected_back_but_not_for_the_others():
    rec = Recorder()
    expected = [{"a", "b"}]
    asked = []

    def expect(deadline):
        asked.append(deadline)
        return {id(k) for k in expected[0]}

    sched = Scheduler(rec, max_batch=8, max_tokens=100, wait_s=0.3, expected=expect)
    try:
        first = sched.submit(named("a", 1, "a"))
        time.sleep(0.1)
        second = sched.submit(named("b", 1, "b"))  # within the wait: same tick
        first.result(timeout=5), second.result(timeout=5)
        assert rec.ticks == [["a", "b"]]
        expected[0] = {"a"}  # b is idle, or will not be back before the deadline
        start = time.perf_counter()
        sched.submit(named("a", 1, "alone")).result(timeout=5)
        assert time.perf_counter() - start < 0.2  # the only expected session is in: no waiting
        expected[0] = {"c"}  # a (new) and c (expected back) share a tick though c comes late
        first = sched.submit(named("a", 1, "a2"))
        time.sleep(0.1)
        second = sched.submit(named("c", 1, "c"))
        first.result(timeout=5), second.result(timeout=5)
        assert rec.ticks[-1] == ["a2", "c"]
        assert all(d > 0 for d in asked)
    finally:
        sched.close()


def test_busy_time_counts_the_ticks_not_the_waiting_for_sessions_on_their_way_back():
    """What a work's answer less its submission in ``busy_s`` tells a caller: the model's working time, without the
    tick's wait for a session expected back (the idling a round trip causes a batching verifier)."""
    rec = Recorder(delay=0.05)
    sched = Scheduler(rec, max_batch=8, max_tokens=100, wait_s=0.3, expected=lambda deadline: {id("a"), id("b")})
    try:
        work = named("a", 1, "a")
        start, future = time.perf_counter(), sched.submit(work)
        time.sleep(0.2)  # b comes late: the tick waits for it
        sched.submit(named("b", 1, "b")).result(timeout=5)
        future.result(timeout=5)
        wall, busy = time.perf_counter() - start, sched.busy_s() - work.busy_at_submit
        assert rec.ticks == [["a", "b"]]
        assert 0.05 <= busy < 0.15 and wall >= 0.25  # one tick's work; the 0.2 s wait for b is not
    finally:
        sched.close()


class Continuing(Recorder):
    """Runs ticks whose works named "p..." continue for ``chunks`` ticks each (a long prompt's chunks)."""

    def __init__(self, chunks: int):
        super().__init__(delay=0.01)
        self.chunks, self.left = chunks, {}

    def __call__(self, works):
        self.ticks.append([w.name for w in works])
        time.sleep(self.delay)
        going = []
        for w in works:
            self.left[w.name] = self.left.get(w.name, self.chunks) - 1
            if w.name.startswith("p") and self.left[w.name] > 0:
                going.append(w)
            else:
                w.future.set_result(w.name)
        return going


@pytest.mark.parametrize("limit", ["tokens", "rows"])
def test_work_that_waits_goes_before_work_that_continues(limit):
    """Four long prompts fill every tick with their chunks (by tokens, or by rows); a Verify that arrives meanwhile
    runs in the next tick, not after all their chunks; and a session's works keep their order."""
    rec = Continuing(chunks=6)
    max_batch, max_tokens = (8, 128) if limit == "tokens" else (4, 1000)
    sched = Scheduler(rec, max_batch=max_batch, max_tokens=max_tokens, wait_s=0.0)
    try:
        sessions = [object() for _ in range(4)]
        prompts = [sched.submit(named(sessions[i], 32, f"p{i}")) for i in range(4)]
        time.sleep(0.025)
        verify = sched.submit(named("v", 1, "v"))
        behind = sched.submit(named(sessions[0], 1, "k0-verify"))  # the session of prompt p0: after its chunks
        assert verify.result(timeout=5) == "v"
        [f.result(timeout=5) for f in [*prompts, behind]]
    finally:
        sched.close()
    at = next(i for i, tick in enumerate(rec.ticks) if "v" in tick)
    assert at <= 4  # (a tick or two after it came; before: once every prompt was done, tick 6 or later)
    assert max(i for i, tick in enumerate(rec.ticks) if "p0" in tick) < rec.ticks.index(
        next(t for t in rec.ticks if "k0-verify" in t))


def test_closing_runs_what_was_queued_then_refuses_new_work():
    rec = Recorder(delay=0.05)
    sched = Scheduler(rec, max_batch=1, max_tokens=10, wait_s=0.0)
    running, waiting = sched.submit(named("a", 1, "a")), sched.submit(named("b", 1, "b"))
    sched.close()
    assert running.result(timeout=1) == "a" and waiting.result(timeout=1) == "b"
    with pytest.raises(Unavailable):
        sched.submit(named("c", 1, "c"))


def test_scheduler_runs_its_ticks_on_its_own_thread_count():
    seen = []

    def tick(works):
        seen.append(torch.get_num_threads())
        for w in works:
            w.future.set_result(None)
        return []

    before = torch.get_num_threads()
    sched = Scheduler(tick, max_batch=1, max_tokens=10, wait_s=0.0, threads=1)
    try:
        sched.submit(Work("a", 1)).result(timeout=5)
    finally:
        sched.close()
    assert seen == [1] and torch.get_num_threads() == before  # the caller's count is untouched


def test_the_attention_group_overhead_follows_the_device():
    assert group_overhead_for("cpu") == ATTENTION_GROUP_OVERHEAD  # padding costs compute on a CPU
    assert group_overhead_for(torch.device("cuda")) == GPU_ATTENTION_GROUP_OVERHEAD  # launches cost more on a GPU
    assert group_overhead_for("cuda:0", configured=16) == 16  # VerifierConfig.attention_group_overhead wins
    lengths = [1, 3, 6, 9, 12]  # verify rows of different trees: one group on a GPU, several on a CPU
    assert len(plan_groups(lengths, group_overhead_for("cuda"))) == 1
    assert len(plan_groups(lengths, group_overhead_for("cpu"))) > 1


def test_a_verifier_config_that_cannot_hold_a_prefill_chunk_is_a_clear_invalid_argument():
    from specsplit.config import VerifierConfig
    from specsplit.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="must hold a prefill chunk"):
        VerifierConfig(max_batch_tokens=512, prefill_chunk=1000).validate()


def test_the_lm_head_runs_two_or_three_kept_rows_as_four():
    """(A CPU's float32 matmul of 2 or 3 rows reads the weight once per row; 4 rows once.)"""
    assert head_rows([5, 6], 9) == ([5, 6, 6, 6], 2)
    assert head_rows(None, 3) == ([0, 1, 2, 2], 3)
    assert head_rows([4], 9) == ([4], 1)  # one row: a matrix-vector product, the cheapest
    assert head_rows([], 9) == ([], 1)  # the last token's
    assert head_rows([0, 2, 4, 6, 8], 9) == ([0, 2, 4, 6, 8], 5)
    assert head_rows(None, 4) == ([0, 1, 2, 3], 4)
