"""Preemption's pieces on their own (``core/preemption.py``), the token budget's limits
(``core/planner.py``), and priority aging as the scheduler applies it.

Expected values are worked out by hand from the rules in the modules' docstrings.
"""

from __future__ import annotations

import pytest
from test_scheduler import Req, assert_token_exact, drive, step_bound

from minicb.core.block_manager import BlockManager
from minicb.core.config import SchedulerConfig
from minicb.core.errors import InvalidArgument
from minicb.core.planner import TokenBudget
from minicb.core.preemption import choose_victim, drop_swapped, importance_key, preempt, running_order
from minicb.core.sampling_params import SamplingParams
from minicb.core.sequence import Sequence, SequenceStatus
from minicb.core.slot_table import SlotTable


def seq(rid: str, *, priority: int = 0, arrival: int = 0, admitted: int = -1) -> Sequence:
    s = Sequence(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=4), priority=priority)
    s.arrival_index, s.admitted_index = arrival, admitted
    return s


def running(rid: str, blocks: BlockManager, slots: SlotTable, num_tokens: int = 5) -> Sequence:
    s = seq(rid)
    blocks.allocate(rid, num_tokens)
    s.slot_id = slots.assign(rid)
    s.status = SequenceStatus.RUNNING
    s.num_computed_tokens = num_tokens
    return s


# --- the guard: only a running sequence that holds a slot can be preempted -------------------------
@pytest.mark.parametrize("status, has_slot", [
    (SequenceStatus.RUNNING, False),          # running but slotless: a broken state, refused
    (SequenceStatus.WAITING, True),           # holds a slot but is not running: refused
    (SequenceStatus.WAITING, False),
    (SequenceStatus.SWAPPED, False),
    (SequenceStatus.FINISHED, True),
])
def test_the_preemption_guard_refuses_every_mixed_state(status, has_slot):
    blocks, slots = BlockManager(num_blocks=8, block_size=4), SlotTable(2)
    s = running("a", blocks, slots)
    s.status = status
    if not has_slot:
        slots.release(s.slot_id)
        s.slot_id = None
    free_slots, free_blocks = slots.num_free, blocks.num_free_blocks
    with pytest.raises(InvalidArgument, match="only a running sequence can be preempted"):
        preempt(s, "recompute", blocks, slots)
    # a refusal changes nothing
    assert (slots.num_free, blocks.num_free_blocks, s.num_preemptions) == (free_slots, free_blocks, 0)
    assert s.status is status


def test_recompute_frees_everything_and_rewinds():
    blocks, slots = BlockManager(num_blocks=8, block_size=4), SlotTable(2)
    s = running("a", blocks, slots, num_tokens=6)                 # 2 blocks
    s.num_cached_tokens = 4
    p = preempt(s, "recompute", blocks, slots)
    assert (p.request_id, p.mode, p.swap_out, p.num_lost_tokens) == ("a", "recompute", (), 6)
    assert s.status is SequenceStatus.WAITING and s.slot_id is None
    assert (s.num_computed_tokens, s.num_cached_tokens, s.num_preemptions) == (0, 0, 1)
    assert slots.num_free == 2 and blocks.num_free_blocks == 8 and blocks.block_table("a") == []


def test_swap_moves_the_blocks_to_the_host_and_keeps_progress():
    blocks, slots = BlockManager(num_blocks=8, block_size=4, num_host_blocks=4), SlotTable(2)
    s = running("a", blocks, slots, num_tokens=6)
    table = list(blocks.block_table("a"))
    p = preempt(s, "swap", blocks, slots)
    assert p.mode == "swap" and [d for d, _ in p.swap_out] == table and p.num_lost_tokens == 0
    assert s.status is SequenceStatus.SWAPPED and s.slot_id is None and s.num_computed_tokens == 6
    assert s.num_preemptions == 1 and slots.num_free == 2
    assert blocks.num_free_host_blocks == 2 and blocks.num_free_blocks == 8
    # a swapped sequence whose host copy is given up becomes a recompute one
    d = drop_swapped(s, blocks)
    assert (d.mode, d.num_lost_tokens) == ("recompute", 6)
    assert s.status is SequenceStatus.WAITING and s.num_computed_tokens == 0
    assert blocks.num_free_host_blocks == 4


def test_swap_without_room_on_the_host_falls_back_to_recompute():
    blocks, slots = BlockManager(num_blocks=8, block_size=4, num_host_blocks=1), SlotTable(2)
    s = running("a", blocks, slots, num_tokens=6)                 # 2 blocks, the host has 1
    p = preempt(s, "swap", blocks, slots)
    assert p.mode == "recompute" and s.status is SequenceStatus.WAITING
    assert blocks.num_free_host_blocks == 1 and blocks.num_free_blocks == 8


# --- who is preempted --------------------------------------------------------------------------------------
def test_fcfs_victim_is_the_newest_admission():
    a, b = seq("a", arrival=0, admitted=2), seq("b", arrival=1, admitted=0)
    c = seq("c", arrival=2, admitted=1)
    assert choose_victim([a, b, c], "fcfs").request_id == "a"
    assert [s.request_id for s in running_order([a, b, c], "fcfs")] == ["b", "c", "a"]


def test_priority_victim_is_the_largest_value_then_the_latest_arrival():
    a, b = seq("a", priority=1, arrival=0), seq("b", priority=2, arrival=1)
    c = seq("c", priority=2, arrival=2)
    assert choose_victim([a, b, c], "priority").request_id == "c"
    assert [s.request_id for s in running_order([c, b, a], "priority")] == ["a", "b", "c"]
    with pytest.raises(InvalidArgument, match="scheduling_policy"):
        importance_key(a, "lifo")


@pytest.mark.parametrize("num_arrivals, aging, expected", [
    (1, 4, (5, 0)),        # nobody arrived after it: no bonus
    (4, 4, (5, 0)),        # 3 later arrivals: not yet a whole level
    (5, 4, (4, 0)),        # 4 later arrivals: one level
    (9, 4, (3, 0)),        # 8: two levels
    (12, 4, (3, 0)),
    (13, 4, (2, 0)),
    (100, 0, (5, 0)),      # aging 0: strict priority, never a bonus
])
def test_aging_gives_one_level_per_aging_later_arrivals(num_arrivals, aging, expected):
    s = seq("old", priority=5, arrival=0)
    assert importance_key(s, "priority", num_arrivals, aging) == expected


def test_aging_is_counted_from_the_sequence_s_own_arrival():
    s = seq("mid", priority=3, arrival=6)
    assert importance_key(s, "priority", 7, 2) == (3, 6)          # nobody after it
    assert importance_key(s, "priority", 9, 2) == (2, 6)          # 2 after it
    assert importance_key(s, "fcfs", 100, 2) == (-1, 6)           # fcfs ignores priority and aging


# --- aging through the scheduler -----------------------------------------------------------------------
def first_scheduled(config: SchedulerConfig, reqs: list[Req]) -> dict[str, int]:
    run = drive(config, reqs, max_steps=step_bound(reqs))
    assert_token_exact(run, reqs)
    first: dict[str, int] = {}
    for i, plan in enumerate(run.plans):
        for s in plan.seqs:
            first.setdefault(s.request_id, i)
    return first


def starving_workload() -> list[Req]:
    """One unimportant request at step 0, then a stream of important ones, one per step."""
    low = Req("low", [1, 2, 3], 2, arrival=0, priority=9, ignore_eos=True)
    high = [Req(f"h{i}", [4 + i % 5, 5, 6], 2, arrival=i, priority=0, ignore_eos=True) for i in range(40)]
    return [*high[:1], low, *high[1:]]


def config(aging: int) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, block_size=4, num_blocks=8,
                           scheduling_policy="priority", priority_aging=aging, enable_prefix_caching=False)


def test_strict_priority_starves_the_unimportant_request_until_the_stream_ends():
    first = first_scheduled(config(aging=0), starving_workload())
    assert first["low"] > max(v for k, v in first.items() if k != "low")


def test_with_aging_the_unimportant_request_overtakes_the_stream():
    """Priority 9 against a stream of priority 0: with aging 2 it reaches level 0 after 18 later
    arrivals, then wins the tie by its earlier arrival; it must run long before the stream ends."""
    first = first_scheduled(config(aging=2), starving_workload())
    later = sorted(v for k, v in first.items() if k != "low")
    assert first["low"] < later[-5]
    behind = [k for k, v in first.items() if v > first["low"]]
    assert len(behind) >= 10


# --- the token budget ------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["max_num_batched_tokens", "max_num_seqs", "chunk_cap"])
@pytest.mark.parametrize("value", [0, -1])
def test_a_budget_needs_at_least_one_token_one_sequence_and_a_positive_chunk(field, value):
    kw = dict(max_num_batched_tokens=8, max_num_seqs=2, chunk_cap=4)
    kw[field] = value
    with pytest.raises(InvalidArgument, match=field):
        TokenBudget(**kw)


def test_the_smallest_budget_is_valid():
    b = TokenBudget(max_num_batched_tokens=1, max_num_seqs=1, chunk_cap=1)
    assert b.chunk(5) == 1
    b.take(1)
    assert b.chunk(5) == 0 and b.tokens_left == 0
    b.check_integrity()


def test_chunks_respect_tokens_sequences_and_the_cap():
    b = TokenBudget(max_num_batched_tokens=10, max_num_seqs=3, chunk_cap=4)
    assert [b.chunk(n) for n in (0, 1, 3, 4, 9)] == [0, 1, 3, 4, 4]
    b.take(4)
    b.take(4)
    assert b.tokens_left == 2 and b.chunk(9) == 2 and b.chunk(1) == 1
    b.take(2)
    assert b.chunk(1) == 0                                  # out of tokens and of sequences
    b.give_back(4)                                          # a preempted grant returns both
    assert (b.num_batched_tokens, b.num_seqs, b.tokens_left) == (6, 2, 4) and b.chunk(9) == 4
    b.check_integrity()


def test_the_sequence_limit_stops_grants_even_with_tokens_left():
    b = TokenBudget(max_num_batched_tokens=100, max_num_seqs=2, chunk_cap=8)
    b.take(1)
    b.take(1)
    assert b.tokens_left == 98 and b.chunk(5) == 0
    with pytest.raises(AssertionError):
        b.take(1)


def test_take_and_give_back_refuse_impossible_grants():
    b = TokenBudget(max_num_batched_tokens=4, max_num_seqs=2, chunk_cap=4)
    for bad in (0, 5):
        with pytest.raises(AssertionError):
            b.take(bad)
    b.take(3)
    with pytest.raises(AssertionError):
        b.give_back(4)
    with pytest.raises(AssertionError):
        b.give_back(0)


def test_integrity_catches_an_overdrawn_budget():
    for kw, message in ((dict(num_batched_tokens=9), "token budget"), (dict(num_seqs=3, num_batched_tokens=3),
                                                                        "sequence budget"),
                        (dict(num_seqs=2, num_batched_tokens=1), "at least one token")):
        b = TokenBudget(max_num_batched_tokens=8, max_num_seqs=2, chunk_cap=4, **kw)
        with pytest.raises(AssertionError, match=message):
            b.check_integrity()
