"""The scheduler: exact plans for hand-built situations, and token-exactness against a fake model.

The fake model (``FakeModel``) is a pure function of the token prefix, ``next = h(all tokens) % V``,
that reads the prefix back out of a fake *paged* KV cache through the plan's block tables, after
applying the plan's swap copies. So a request's tokens only come out right if every block table,
swap copy, recompute and chunk boundary the scheduler produced was right: comparing with the request
run alone (``alone``) checks the whole bookkeeping at the scheduler level, with no torch. The kit
(fake model, ``drive``, ``step``) is ``tests/scheduler_fixtures.py``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hypothesis_profiles import examples
from minicb.core.config import SchedulerConfig
from minicb.core.errors import InvalidArgument, RequestRejected
from minicb.core.preemption import choose_victim, preempt, running_order
from minicb.core.sampling_params import SamplingParams
from minicb.core.scheduler import Scheduler
from minicb.core.sequence import FinishReason, Sequence, SequenceStatus
from scheduler_fixtures import (
    VOCAB,
    FakeModel,
    Req,
    alone,
    assert_drained,
    assert_token_exact,
    drain_scheduler,
    drive,
    make_seq,
    rows,
    seq,
    step,
    step_bound,
)


def cfg(**kw) -> SchedulerConfig:
    """The exact-plan tests below are about scheduling without prefix caching (its own exact tests
    are in test_prefix_caching.py): their prompts share prefixes, which would change the tables."""
    base = dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=64,
                enable_prefix_caching=False)
    base.update(kw)
    return SchedulerConfig(**base)


# --- the import boundary ---------------------------------------------------------------------------
def test_scheduler_side_does_not_import_torch():
    code = ("import sys; sys.path.insert(0, 'src'); import minicb.core.scheduler, minicb.core.planner, "
            "minicb.core.preemption, minicb.core.block_manager, minicb.core.slot_table; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_drain_fails_instead_of_spinning_when_nothing_can_progress(monkeypatch):
    from minicb.core.continuous import ContinuousPolicy

    monkeypatch.setattr(ContinuousPolicy, "_schedule_waiting", lambda self, work, budget: None)  # no one in
    sched = Scheduler(cfg())
    sched.add(seq("a", 3))
    with pytest.raises(AssertionError, match=r"not drained after 50 steps: waiting=\['a'\] running=\[\]"):
        drain_scheduler(sched, max_steps=50)
    assert sched.stats.num_steps == 50


# --- continuous: exact plans ---------------------------------------------------------------------------
def test_admission_fills_slots_and_a_freed_slot_is_refilled_next_step():
    sched = Scheduler(cfg(max_num_seqs=2, max_num_batched_tokens=8, block_size=4, num_blocks=8))
    for s in (seq("a", 5, 2), seq("b", 3, 3), seq("c", 2, 1)):
        sched.add(s)
    assert [sched.get(r).arrival_index for r in "abc"] == [0, 1, 2]
    plan, done = step(sched, now=1.0)
    assert plan.step == 0
    assert rows(plan) == [("a", 0, 0, 5, (0, 1), True), ("b", 1, 0, 3, (2,), True)]
    assert plan.seqs[0].token_ids == tuple(sched.get("a").prompt_token_ids)
    assert (len(sched.running), len(sched.waiting), done) == (2, 1, [])
    # load-independent: a fake clock (times passed in)
    assert sched.get("a").first_scheduled_time == 1.0 and sched.get("c").first_scheduled_time is None
    plan, done = step(sched)
    assert rows(plan) == [("a", 0, 5, 1, (0, 1), True), ("b", 1, 3, 1, (2,), True)]
    assert plan.seqs[0].token_ids == (7,)
    assert [s.request_id for s in done] == ["a"] and done[0].finish_reason is FinishReason.LENGTH
    assert sched.block_manager.device.free_blocks() == [0, 1, 3, 4, 5, 6, 7]
    assert sched.slot_table.held() == {1: "b"}
    plan, done = step(sched)
    assert rows(plan) == [("b", 1, 4, 1, (2, 0), True), ("c", 0, 0, 2, (1,), True)]
    assert [s.request_id for s in done] == ["b", "c"]
    assert_drained(sched)
    assert sched.stats.num_batched_tokens == 8 + 2 + 3 and sched.stats.num_finished == 3


def test_decodes_first_then_a_chunk_of_the_new_prompt():
    sched = Scheduler(cfg(max_num_seqs=4, max_num_batched_tokens=8, block_size=4, num_blocks=16))
    for r in ("d1", "d2", "d3"):
        sched.add(seq(r, 2, 10))
    step(sched)
    sched.add(seq("p", 20, 2))
    plan, _ = step(sched)
    assert rows(plan) == [("d1", 0, 2, 1, (0,), True), ("d2", 1, 2, 1, (1,), True),
                          ("d3", 2, 2, 1, (2,), True), ("p", 3, 0, 5, (3, 4), False)]
    assert [s.num_tokens for s in plan.seqs] == [1, 1, 1, 5] and plan.num_batched_tokens == 8
    plan, _ = step(sched)
    assert rows(plan) == [("d1", 0, 3, 1, (0,), True), ("d2", 1, 3, 1, (1,), True),
                          ("d3", 2, 3, 1, (2,), True), ("p", 3, 5, 5, (3, 4, 5), False)]
    assert plan.seqs[3].token_ids == tuple(sched.get("p").prompt_token_ids[5:10])
    plan, _ = step(sched)
    assert [s.block_table for s in plan.seqs] == [(0, 6), (1, 7), (2, 8), (3, 4, 5, 9)]
    plan, _ = step(sched)
    assert rows(plan)[3] == ("p", 3, 15, 5, (3, 4, 5, 9, 10), True)      # the last chunk samples


def test_long_prefill_chunk_caps_each_prompt():
    sched = Scheduler(cfg(max_num_batched_tokens=16, long_prefill_chunk=4, block_size=4))
    sched.add(seq("a", 10, 1))
    sched.add(seq("b", 6, 1))
    shapes = []
    drain_scheduler(sched, on_plan=lambda plan: shapes.append(
        [(s.request_id, s.start_pos, s.num_tokens, s.sample) for s in plan.seqs]))
    assert shapes == [
        [("a", 0, 4, False), ("b", 0, 4, False)],
        [("a", 4, 4, False), ("b", 4, 2, True)],
        [("a", 8, 2, True)],
    ]


def test_stall_free_caps_prompt_tokens_only_while_a_decode_runs():
    # d decodes (4 tokens: sampled at steps 0..3); the 100-token prompt L arrives after step 0. Beside
    # d's decode L gets 8 tokens a step (cap 8); once d has finished, the whole budget of 64, then the rest.
    sched = Scheduler(cfg(max_num_batched_tokens=64, max_prefill_tokens_while_decoding=8, num_blocks=64))
    sched.add(seq("d", 3, 4))
    shapes = [[(s.request_id, s.num_tokens) for s in step(sched)[0].seqs]]
    sched.add(seq("L", 100, 2, first=5))
    drain_scheduler(sched, on_plan=lambda p: shapes.append([(s.request_id, s.num_tokens) for s in p.seqs]))
    assert shapes == [[("d", 3)],
                      [("d", 1), ("L", 8)], [("d", 1), ("L", 8)], [("d", 1), ("L", 8)],
                      [("L", 64)], [("L", 12)], [("L", 1)]]


def test_stall_free_cap_grows_by_its_share_per_sequence_held():
    # cap 2 + 3 a sequence: three decodes and a 30-token prompt are four sequences held, so the prompt
    # gets 2 + 3 x 4 = 14 tokens a step beside the decodes
    sched = Scheduler(cfg(max_num_batched_tokens=64, max_prefill_tokens_while_decoding=2,
                          prefill_tokens_per_seq=3, num_blocks=64))
    for r in ("d1", "d2", "d3"):
        sched.add(seq(r, 2, 10))
    step(sched)
    sched.add(seq("p", 30, 2, first=4))
    grants = [[s.num_tokens for s in step(sched)[0].seqs] for _ in range(3)]
    assert grants == [[1, 1, 1, 14], [1, 1, 1, 14], [1, 1, 1, 2]]


def _one_decode_then_queued(slots: int, waiting: int) -> Scheduler:
    """Cap 2 + 3 a sequence held; one sequence decoding, then ``waiting`` 10-token prompts queued."""
    sched = Scheduler(cfg(max_num_seqs=slots, max_num_batched_tokens=64, max_prefill_tokens_while_decoding=2,
                          prefill_tokens_per_seq=3, num_blocks=64))
    sched.add(seq("d", 2, 10))
    step(sched)
    for i in range(waiting):
        sched.add(seq(f"w{i}", 10, 2, first=11 + 10 * i))
    return sched


def test_stall_free_cap_counts_the_waiting_queue():
    # One decode and six prompts waiting (slots for all): 2 + 3 x 7 = 23 prompt tokens, not the
    # 2 + 3 x 1 = 5 of a share per decode alone; the next step w0 and w1 decode too, and the seven
    # sequences held give the prompts 23 again
    sched = _one_decode_then_queued(slots=8, waiting=6)
    grants = [[(s.request_id, s.num_tokens) for s in step(sched)[0].seqs] for _ in range(2)]
    assert grants == [[("d", 1), ("w0", 10), ("w1", 10), ("w2", 3)],
                      [("d", 1), ("w0", 1), ("w1", 1), ("w2", 7), ("w3", 10), ("w4", 6)]]


def test_stall_free_cap_counts_a_swapped_sequence():
    # d1 and b decode, p (40 tokens) is prefilling; b is swapped out (as a swap preemption would):
    # three sequences held, so p gets 2 + 3 x 3 = 11 tokens beside d1 (8 without b, 5 per decode alone),
    # and b, which would come back as a decode, finds the cap spent and stays swapped
    sched = Scheduler(cfg(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_tokens_while_decoding=2,
                          prefill_tokens_per_seq=3, num_blocks=64, num_host_blocks=16,
                          preemption_mode="swap", long_prefill_chunk=4))
    sched.add(seq("d1", 2, 10))
    sched.add(seq("b", 2, 10, first=3))
    sched.add(seq("p", 40, 2, first=5))
    step(sched)                            # d1, b: their prompts; p: its first 4 tokens (the chunk cap)
    sched.config = dataclasses.replace(sched.config, long_prefill_chunk=None)
    sched.preempt(sched.get("b"))
    assert [q.request_id for q in sched.swapped] == ["b"]
    plan, _ = step(sched)
    assert [(s.request_id, s.num_tokens) for s in plan.seqs] == [("d1", 1), ("p", 11)]
    assert not plan.swap_in and [q.request_id for q in sched.swapped] == ["b"]


def test_stall_free_cap_counts_no_more_sequences_than_run_together():
    # Four slots, one decode and ten prompts waiting: eleven sequences held, but at most four decode
    # together, so the cap is 2 + 3 x 4 = 14 (not 2 + 3 x 11 = 35): w0 10, w1 the 4 left
    sched = _one_decode_then_queued(slots=4, waiting=10)
    assert [(s.request_id, s.num_tokens) for s in step(sched)[0].seqs] == [("d", 1), ("w0", 10), ("w1", 4)]


def test_stall_free_cap_counts_admissions_and_ongoing_prefills_together():
    # Two decodes run, prompt a (20 tokens) is being fed 4 tokens at a time (long_prefill_chunk), and
    # b, c wait. Cap 6 beside the decodes: a takes 4, b is admitted with the 2 left, c waits behind it.
    sched = Scheduler(cfg(max_num_seqs=6, max_num_batched_tokens=64, long_prefill_chunk=4, num_blocks=64,
                          max_prefill_tokens_while_decoding=6))
    for r in ("d1", "d2"):
        sched.add(seq(r, 2, 10))
    sched.add(seq("a", 20, 2, first=3))
    plan, _ = step(sched)                  # nothing decodes yet: no cap (2 + 2 + 4)
    assert [(s.request_id, s.num_tokens) for s in plan.seqs] == [("d1", 2), ("d2", 2), ("a", 4)]
    sched.add(seq("b", 9, 2, first=7))
    sched.add(seq("c", 3, 2, first=9))
    for _ in range(2):
        plan, _ = step(sched)
        assert [(s.request_id, s.num_tokens) for s in plan.seqs] == [("d1", 1), ("d2", 1), ("a", 4), ("b", 2)]
        assert [q.request_id for q in sched.waiting] == ["c"]


def test_admission_stops_at_the_first_request_that_does_not_fit():
    sched = Scheduler(cfg(max_num_seqs=4, block_size=4, num_blocks=4))
    sched.add(seq("a", 8, 4))
    sched.add(seq("big", 12, 4))        # 3 blocks for its prompt, only 2 left
    sched.add(seq("small", 2, 1))       # would fit, but must not overtake
    plan, _ = step(sched)
    assert [s.request_id for s in plan.seqs] == ["a"]
    assert sched.get("big").status is SequenceStatus.WAITING
    assert sched.get("small").status is SequenceStatus.WAITING


def _two_growing(**kw) -> Scheduler:
    """a and b (prompt 3, max_tokens 5) on a pool of 4 blocks of 2: full after the prefill."""
    sched = Scheduler(cfg(max_num_seqs=2, max_num_batched_tokens=16, block_size=2, num_blocks=4, **kw))
    sched.add(seq("a", 3, 5, priority=kw.get("_pa", 0)))
    sched.add(seq("b", 3, 5))
    assert rows(step(sched)[0]) == [("a", 0, 0, 3, (0, 1), True), ("b", 1, 0, 3, (2, 3), True)]
    assert rows(step(sched)[0]) == [("a", 0, 3, 1, (0, 1), True), ("b", 1, 3, 1, (2, 3), True)]
    return sched


def test_recompute_preempts_the_newest_and_it_reprefills_everything():
    sched = _two_growing()
    plan, _ = step(sched)                      # a needs a third block: b (newest) is the victim
    assert plan.preempted == ("b",) and rows(plan) == [("a", 0, 4, 1, (0, 1, 2), True)]
    b = sched.get("b")
    assert (b.status, b.num_computed_tokens, b.slot_id, b.num_preemptions) == (SequenceStatus.WAITING, 0,
                                                                               None, 1)
    assert sched.block_manager.block_table("b") == [] and len(sched.waiting) == 1
    assert (sched.stats.num_preemptions, sched.stats.num_recomputes, sched.stats.num_recomputed_tokens) \
        == (1, 1, 4)
    assert rows(step(sched)[0]) == [("a", 0, 5, 1, (0, 1, 2), True)]      # b needs 3 blocks, 1 free
    plan, done = step(sched)
    assert rows(plan) == [("a", 0, 6, 1, (0, 1, 2, 3), True)] and [s.request_id for s in done] == ["a"]
    plan, _ = step(sched)
    assert rows(plan) == [("b", 0, 0, 5, (0, 1, 2), True)]                # prompt + its 2 tokens again
    assert plan.seqs[0].token_ids == tuple(b.prompt_token_ids) + (7, 7)
    drain_scheduler(sched)
    assert b.output_token_ids == [7] * 5
    assert_drained(sched)


def test_recompute_victims_go_to_the_front_of_the_waiting_queue():
    sched = _two_growing()
    sched.add(seq("c", 1, 1))              # waits for a slot
    plan, _ = step(sched)
    assert plan.preempted == ("b",)
    plan, _ = step(sched)                  # b (front) needs 3 blocks, 1 free: c must not overtake it
    assert [s.request_id for s in plan.seqs] == ["a"]
    assert sched.get("c").status is SequenceStatus.WAITING
    step(sched)                            # a finishes
    plan, _ = step(sched)
    assert [(s.request_id, s.slot_id) for s in plan.seqs] == [("b", 0), ("c", 1)]


def test_several_victims_in_one_step_keep_their_age_order():
    sched = Scheduler(cfg(max_num_seqs=3, max_num_batched_tokens=32, long_prefill_chunk=8, block_size=2,
                          num_blocks=8))
    sched.add(seq("a", 14, 2))             # 16 tokens: the whole pool
    sched.add(seq("b", 2, 4))
    sched.add(seq("c", 2, 4))
    plan, _ = step(sched)
    assert rows(plan) == [("a", 0, 0, 8, (0, 1, 2, 3), False), ("b", 1, 0, 2, (4,), True),
                          ("c", 2, 0, 2, (5,), True)]
    plan, _ = step(sched)                  # a's last chunk needs 3 more blocks: c, then b give theirs
    assert plan.preempted == ("c", "b")
    assert rows(plan) == [("a", 0, 8, 6, (0, 1, 2, 3, 4, 5, 6), True)]
    step(sched)                            # a finishes
    plan, _ = step(sched)                  # the older victim comes back first
    assert [(s.request_id, s.slot_id, s.num_tokens) for s in plan.seqs] == [("b", 0, 3), ("c", 1, 3)]


def test_swap_preemption_moves_blocks_to_host_and_back():
    sched = _two_growing(num_host_blocks=4, preemption_mode="swap")
    plan, _ = step(sched)
    assert plan.preempted == ("b",) and plan.swap_out == ((2, 0), (3, 1))
    assert rows(plan) == [("a", 0, 4, 1, (0, 1, 2), True)]
    b = sched.get("b")
    assert (b.status, b.num_computed_tokens, b.slot_id) == (SequenceStatus.SWAPPED, 4, None)
    assert sched.block_manager.host_tables.get("b") == [0, 1] and len(sched.swapped) == 1
    sched.add(seq("c", 1, 1))              # fits in the free block, but swapped b comes first
    assert rows(step(sched)[0]) == [("a", 0, 5, 1, (0, 1, 2), True)]       # b would need 3 blocks
    assert sched.get("c").status is SequenceStatus.WAITING
    step(sched)                                                            # a finishes
    plan, _ = step(sched)
    assert plan.swap_in == ((0, 0), (1, 1)) and not plan.swap_out
    assert rows(plan) == [("b", 0, 4, 1, (0, 1, 2), True), ("c", 1, 0, 1, (3,), True)]  # b continues
    assert (sched.stats.num_swaps, sched.stats.num_swap_ins, sched.stats.num_recomputes) == (1, 1, 0)
    drain_scheduler(sched)
    assert_drained(sched)


def test_swap_falls_back_to_recompute_when_the_host_pool_is_too_small():
    sched = _two_growing(num_host_blocks=1, preemption_mode="swap")
    plan, _ = step(sched)
    assert plan.preempted == ("b",) and plan.swap_out == ()
    assert sched.get("b").status is SequenceStatus.WAITING and sched.get("b").num_computed_tokens == 0
    assert (sched.stats.num_swaps, sched.stats.num_recomputes) == (0, 1)


def test_a_sequence_that_is_the_newest_preempts_itself():
    sched = Scheduler(cfg(max_num_seqs=2, block_size=2, num_blocks=4))
    sched.add(seq("a", 3, 5))              # blocks (0, 1), room for position 3
    sched.add(seq("b", 4, 4))              # blocks (2, 3), full
    step(sched)
    plan, _ = step(sched)
    assert plan.preempted == ("b",) and rows(plan) == [("a", 0, 3, 1, (0, 1), True)]
    assert sched.get("b").status is SequenceStatus.WAITING


def test_priority_policy_preempts_the_least_important_even_if_older():
    """b arrived second but is more important: it is admitted first (slot 0, blocks 0-1), and when the
    pool runs out the older, less important a is the victim; b's table grows into a's freed block."""
    sched = Scheduler(cfg(max_num_seqs=2, block_size=2, num_blocks=4, scheduling_policy="priority"))
    sched.add(seq("a", 3, 5, priority=2))
    sched.add(seq("b", 3, 5, priority=0))
    plan, _ = step(sched)
    assert [(s.request_id, s.slot_id) for s in plan.seqs] == [("b", 0), ("a", 1)]
    step(sched)
    plan, _ = step(sched)
    assert plan.preempted == ("a",) and rows(plan) == [("b", 0, 4, 1, (0, 1, 2), True)]
    assert sched.get("a").num_preemptions == 1


def test_victim_choice_and_running_order():
    def mk(rid, admitted, arrival, priority):
        s = seq(rid, 2, 2, priority=priority)
        s.admitted_index, s.arrival_index = admitted, arrival
        return s
    a, b, c, d = mk("a", 0, 0, 1), mk("b", 3, 1, 0), mk("c", 1, 2, 2), mk("d", 2, 3, 0)
    assert [s.request_id for s in running_order([a, b, c, d], "fcfs")] == ["a", "c", "d", "b"]
    assert choose_victim([a, b, c, d], "fcfs") is b                 # the newest admission
    assert [s.request_id for s in running_order([a, b, c, d], "priority")] == ["b", "d", "a", "c"]
    assert choose_victim([a, b, c, d], "priority") is c             # largest priority value
    assert choose_victim([a, b, d], "priority") is a
    assert choose_victim([b, d], "priority") is d                   # tie: the later arrival
    with pytest.raises(InvalidArgument, match="scheduling_policy"):
        choose_victim([a], "lifo")


def test_only_a_running_sequence_can_be_preempted():
    from minicb.core.block_manager import BlockManager
    from minicb.core.slot_table import SlotTable

    with pytest.raises(InvalidArgument, match="only a running sequence.*'w' is waiting"):
        preempt(seq("w", 2), "recompute", BlockManager(4, 4), SlotTable(2))


# --- add: validation and rejection ---------------------------------------------------------------------
def test_requests_that_can_never_fit_are_rejected_without_changing_state():
    sched = Scheduler(cfg(max_num_seqs=2, block_size=4, num_blocks=4, max_model_len=20))
    with pytest.raises(RequestRejected, match="'e' has an empty prompt"):
        sched.add(Sequence("e", [], SamplingParams(max_tokens=1)))
    with pytest.raises(RequestRejected, match=r"'long'.*\(15\) \+ max_tokens \(6\) = 21.*max_model_len=20"):
        sched.add(seq("long", 15, 6))
    with pytest.raises(RequestRejected, match="'huge' needs 5 KV blocks of 4 tokens for 17.*num_blocks=4"):
        sched.add(seq("huge", 10, 7))
    assert (len(sched.waiting), sched.has_unfinished(), sched.get("huge")) == (0, False, None)
    sched.check_integrity()
    ok = seq("ok", 10, 6)                   # 16 tokens = exactly the whole pool
    sched.add(ok)
    assert ok.arrival_index == 0            # the rejected ones took no arrival number
    with pytest.raises(InvalidArgument, match="'ok' is already in use"):
        sched.add(seq("ok", 1, 1))
    used = seq("used", 2, 1)
    used.num_computed_tokens = 1
    with pytest.raises(InvalidArgument, match="fresh"):
        sched.add(used)
    with pytest.raises(InvalidArgument, match="must be a Sequence"):
        sched.add("ok")
    assert len(sched.waiting) == 1
    drain_scheduler(sched)
    assert ok.output_token_ids == [7] * 6


def test_rejected_error_is_a_value_error():
    sched = Scheduler(cfg(num_blocks=4, block_size=1))
    with pytest.raises(ValueError):
        sched.add(seq("x", 4, 1))


# --- abort, errors, bad updates ----------------------------------------------------------------------
def test_abort_from_every_state_frees_everything():
    sched = _two_growing(num_host_blocks=4, preemption_mode="swap")
    sched.add(seq("w", 2, 2))
    step(sched)                                   # b is swapped out, w waits
    assert sched.get("b").status is SequenceStatus.SWAPPED
    for rid in ("w", "b", "a"):
        s = sched.abort(rid, now=9.0)
        # load-independent: a fake clock (times passed in)
        assert (s.status, s.finish_reason, s.finish_time) == (SequenceStatus.FINISHED, FinishReason.ABORT,
                                                              9.0)
        sched.check_integrity()
    assert sched.abort("a") is None and sched.abort("nobody") is None
    assert_drained(sched)
    assert sched.stats.num_finished == 3


def test_update_skips_requests_aborted_after_schedule():
    sched = Scheduler(cfg())
    sched.add(seq("a", 3, 2))
    sched.add(seq("b", 3, 2))
    plan = sched.schedule()
    sched.abort("a")
    done = sched.update(plan, {"a": 5, "b": 6}, now=0.0)
    assert done == [] and sched.get("b").output_token_ids == [6]
    sched.check_integrity()
    sched.add(seq("a", 4, 1))                      # the id may be reused once the first one ended
    plan2, done = step(sched)
    assert [(s.request_id, s.num_tokens) for s in plan2.seqs] == [("b", 1), ("a", 4)]
    assert [s.request_id for s in done] == ["b", "a"]
    before = sched.stats.num_batched_tokens
    # load-independent: a fake clock (times passed in)
    assert sched.update(plan, {"a": 5, "b": 6}, now=0.0) == []      # a stale plan changes nothing
    assert sched.stats.num_batched_tokens == before
    sched.check_integrity()


def test_fail_step_finishes_the_plans_requests_and_keeps_serving_others():
    c = cfg(max_num_seqs=2, block_size=2, num_blocks=8)
    sched, model = Scheduler(c), FakeModel(c)
    reqs = [Req("a", [3, 4, 5], 4), Req("b", [6, 7], 4), Req("c", [8, 9, 10, 11], 5)]
    for r in reqs:
        sched.add(make_seq(r))
    c_seq = sched.get("c")
    plan = sched.schedule()
    failed = sched.fail_step(plan, "CUDA error: boom", now=2.0)
    assert [s.request_id for s in failed] == ["a", "b"]
    assert all(s.finish_reason is FinishReason.ERROR and s.error == "CUDA error: boom" for s in failed)
    assert sched.slot_table.num_free == 2 and sched.block_manager.num_free_blocks == 8
    sched.check_integrity()
    drain_scheduler(sched, model=model)
    assert c_seq.output_token_ids == alone(reqs[2].prompt, reqs[2].max_tokens)
    assert [s.finish_reason for s in failed] == [FinishReason.ERROR] * 2   # they stay failed
    assert sched.stats.num_finished == 3


def test_fail_step_turns_its_swapped_victims_into_recompute():
    sched = _two_growing(num_host_blocks=4, preemption_mode="swap")
    plan = sched.schedule()
    assert plan.swap_out and plan.preempted == ("b",)
    sched.fail_step(plan, "boom")
    b = sched.get("b")
    assert (b.status, b.num_computed_tokens) == (SequenceStatus.WAITING, 0)
    assert sched.block_manager.num_free_host_blocks == 4
    sched.check_integrity()
    drain_scheduler(sched)
    assert b.output_token_ids == [7] * 5
    assert_drained(sched)


def test_a_plan_applied_twice_or_failed_late_changes_nothing():
    sched = Scheduler(cfg())
    sched.add(seq("a", 3, 4))
    plan = sched.schedule()
    assert sched.update(plan, {"a": 5}, 0.0) == []
    assert sched.update(plan, {"a": 6}, 0.0) == []
    assert sched.fail_step(plan, "late") == []
    a = sched.get("a")
    assert (a.num_computed_tokens, a.output_token_ids, a.status) == (3, [5], SequenceStatus.RUNNING)
    assert sched.stats.num_batched_tokens == 3
    sched.check_integrity()


def test_update_rejects_missing_or_bad_tokens_without_changing_state():
    sched = Scheduler(cfg())
    sched.add(seq("a", 3, 2))
    plan = sched.schedule()
    with pytest.raises(InvalidArgument, match="no token for request 'a'"):
        sched.update(plan, {}, 0.0)
    with pytest.raises(InvalidArgument, match=r"sampled\['a'\] must be >= 0"):
        sched.update(plan, {"a": -1}, 0.0)
    with pytest.raises(InvalidArgument, match=r"sampled\['a'\] must be an int"):
        sched.update(plan, {"a": 1.5}, 0.0)
    assert sched.get("a").num_computed_tokens == 0 and sched.get("a").output_token_ids == []
    sched.update(plan, {"a": 4}, 0.0)
    assert sched.get("a").output_token_ids == [4]


# --- padded policies -----------------------------------------------------------------------------
def test_dynamic_pads_the_prefill_and_keeps_finished_rows_until_the_batch_ends():
    # The token budget (4) does not apply to the padded policies: whole prompts go in one step.
    sched = Scheduler(cfg(policy="dynamic", max_num_seqs=3, max_num_batched_tokens=4, block_size=4,
                          num_blocks=16))
    for s in (seq("a", 5, 3), seq("b", 2, 1), seq("c", 3, 2), seq("d", 1, 1)):
        sched.add(s)
    plan, done = step(sched)
    assert rows(plan) == [("a", 0, 0, 5, (0, 1), True), ("b", 1, 0, 2, (2,), True),
                          ("c", 2, 0, 3, (3, 4), True)]
    assert plan.padding == (3, 2) and plan.num_padding_tokens == 5
    assert [s.request_id for s in done] == ["b"]
    assert sched.slot_table.held() == {0: "a", 1: "b", 2: "c"}            # b keeps its row
    plan, done = step(sched)
    assert rows(plan) == [("a", 0, 5, 1, (0, 1), True), ("c", 2, 3, 1, (3, 4), True)]
    assert plan.padding == (1,) and [s.request_id for s in done] == ["c"]
    assert sched.get("d").status is SequenceStatus.WAITING                # free slot or not, d waits
    plan, done = step(sched)
    assert rows(plan) == [("a", 0, 6, 1, (0, 1), True)] and plan.padding == (1, 1)
    assert [s.request_id for s in done] == ["a"]
    assert sched.slot_table.num_free == 3 and sched.block_manager.num_free_blocks == 16
    plan, done = step(sched)
    assert rows(plan) == [("d", 0, 0, 1, (0,), True)] and plan.padding == ()
    assert_drained(sched)
    assert (sched.stats.num_padding_tokens, sched.stats.num_batched_tokens) == (5 + 1 + 2, 10 + 2 + 1 + 1)


def test_dynamic_batch_takes_only_what_fits_in_blocks_fifo():
    sched = Scheduler(cfg(policy="dynamic", max_num_seqs=3, block_size=4, num_blocks=4))
    sched.add(seq("a", 4, 4))          # 2 blocks reserved
    sched.add(seq("b", 8, 4))          # 3 blocks: does not fit next to a
    sched.add(seq("c", 1, 1))          # fits, but does not overtake b
    plan, _ = step(sched)
    assert [s.request_id for s in plan.seqs] == ["a"]
    assert sched.block_manager.block_table("a") == [0, 1]


def test_static_waits_for_a_full_batch_or_closed_arrivals():
    sched = Scheduler(cfg(policy="static", max_num_seqs=2))
    sched.add(seq("a", 2, 2))
    plan, _ = step(sched)
    assert plan.seqs == () and plan.is_empty and plan.step == 0
    sched.add(seq("b", 3, 2))
    plan, _ = step(sched)
    assert [s.request_id for s in plan.seqs] == ["a", "b"] and plan.padding == (1,) and plan.step == 1
    sched.add(seq("c", 2, 1))
    while len(sched.running):
        step(sched)
    plan, _ = step(sched)
    assert plan.seqs == () and sched.get("c").status is SequenceStatus.WAITING
    sched.close_arrivals()
    plan, _ = step(sched)
    assert [s.request_id for s in plan.seqs] == ["c"]
    sched.close_arrivals(False)
    assert sched.arrivals_open
    assert_drained(sched)


def test_abort_in_a_padded_batch_frees_the_member_at_once():
    sched = Scheduler(cfg(policy="dynamic", max_num_seqs=2, block_size=4, num_blocks=8))
    sched.add(seq("a", 3, 4))
    sched.add(seq("b", 3, 4))
    step(sched)
    sched.abort("b")
    assert sched.slot_table.held() == {0: "a"} and sched.block_manager.block_table("b") == []
    plan, _ = step(sched)
    assert [s.request_id for s in plan.seqs] == ["a"] and plan.padding == ()
    sched.abort("a")
    assert_drained(sched)


# --- token-exactness against the fake model, every policy and block size -----------------------------------
prompts = st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=20)
requests = st.lists(st.tuples(prompts, st.integers(1, 12), st.integers(0, 6), st.integers(0, 2),
                              st.booleans()), min_size=1, max_size=7)


@st.composite
def configs(draw, policy: str, block_size: int, reqs: list[Req]):
    """Pools just big enough for the largest request, so memory is tight and preemption frequent.

    The continuous policy (the only one that preempts) is steered towards both preemption paths:
    at least two sequences may run at once, the pool has at most two blocks to spare (none when
    one block holds most of a request), prefix caching (with which swap falls back to recompute)
    is on in a third of the examples, and a swap-mode host pool is usually big enough to take a
    victim (a small or absent one falls back to recompute, drawn too, but less often). Run with
    ``--hypothesis-show-statistics`` to see the share of examples that reach each."""
    preempting = policy == "continuous"
    max_num_seqs = draw(st.integers(2, 4) if preempting else st.integers(1, 4))
    need = max(-(-(len(r.prompt) + r.max_tokens) // block_size) for r in reqs)
    budget = draw(st.integers(1, 32))
    spare = st.integers(0, 2 if block_size < 16 else 0) if preempting else st.integers(0, max(2, need // 2))
    hosts = [need, 4 * need, 4 * need, 1, 0] if preempting else [0, 1, need, 4 * need]
    return SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, block_size=block_size,
        long_prefill_chunk=draw(st.one_of(st.none(), st.integers(1, budget))),
        num_blocks=max(max_num_seqs, need) + draw(spare),
        num_host_blocks=draw(st.sampled_from(hosts)),
        policy=policy, preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        # a block shared through the prefix cache is never swapped out (its victim recomputes)
        enable_prefix_caching=draw(st.sampled_from([False, False, True]) if preempting else st.booleans()))


def to_reqs(raw) -> list[Req]:
    return [Req(f"r{i}", p, m, arrival=a, priority=pr, ignore_eos=ig)
            for i, (p, m, a, pr, ig) in enumerate(raw)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("policy", ["continuous", "dynamic", "static"])
@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), raw=requests)
def test_tokens_do_not_depend_on_the_schedule(policy, block_size, data, raw):
    reqs = to_reqs(raw)
    config = data.draw(configs(policy, block_size, reqs))
    run = drive(config, reqs, max_steps=step_bound(reqs))
    assert_token_exact(run, reqs)
    stats = run.scheduler.stats
    assert stats.num_preemptions == stats.num_recomputes + stats.num_swaps
    if policy != "continuous":
        assert stats.num_preemptions == 0
    # how often the examples reach each preemption path (pytest --hypothesis-show-statistics)
    event("reaches swap" if stats.num_swaps else "no swap")
    event("reaches recompute" if stats.num_recomputes else "no recompute")


def _pressure(block_size: int) -> tuple[list[Req], int]:
    """Four long requests on a pool of about one and a half of them: preemption is certain."""
    reqs = [Req(f"r{i}", [(5 * i + j) % (VOCAB - 1) + 1 for j in range(20)], 12, arrival=i, ignore_eos=True)
            for i in range(4)]
    per_req = -(-32 // block_size)
    return reqs, per_req + per_req // 2


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("mode, host, expect", [
    ("recompute", 0, dict(num_swaps=0)),
    ("swap", 64, dict(num_recomputes=0)),
    ("swap", 0, dict(num_swaps=0)),                 # no host pool: every swap falls back to recompute
    ("swap", 1, dict()),                            # a host pool too small for most victims
])
def test_both_preemption_modes_happen_and_stay_token_exact(block_size, mode, host, expect):
    reqs, num_blocks = _pressure(block_size)
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, block_size=block_size,
                             num_blocks=num_blocks, num_host_blocks=host, preemption_mode=mode)
    run = drive(config, reqs, max_steps=step_bound(reqs))
    assert_token_exact(run, reqs)
    stats = run.scheduler.stats
    assert stats.num_preemptions > 0
    assert stats.num_preemptions == stats.num_recomputes + stats.num_swaps
    for name, value in expect.items():
        assert getattr(stats, name) == value
    if host == 64:
        assert stats.num_swaps > 0 and stats.num_swap_ins == stats.num_swaps
    elif host == 0:
        assert stats.num_recomputes > 0 and stats.num_recomputed_tokens > 0
    assert sum(len(p.preempted) for p in run.plans) == stats.num_preemptions
    assert sum(len(p.swap_out) for p in run.plans) == sum(len(p.swap_in) for p in run.plans)


# --- liveness ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_two_requests_cannot_preempt_each_other_forever(mode):
    # Each request alone fills the whole pool (4 blocks of 4 = 16 tokens): they must take turns.
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, block_size=4, num_blocks=4,
                             num_host_blocks=8, preemption_mode=mode)
    reqs = [Req("old", list(range(1, 9)), 8, ignore_eos=True),
            Req("new", list(range(2, 10)), 8, ignore_eos=True)]
    run = drive(config, reqs, max_steps=40)
    assert_token_exact(run, reqs)
    assert len(run.plans) <= 2 * (8 + 8) + 2
    preempted = [rid for p in run.plans for rid in p.preempted]
    assert preempted and set(preempted) == {"new"}        # the oldest is never the victim


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("scheduling_policy", ["fcfs", "priority"])
def test_staggered_arrivals_under_tight_memory_all_finish(mode, scheduling_policy):
    reqs = [Req(f"r{i}", [(7 * i + j) % (VOCAB - 1) + 1 for j in range(3 + (5 * i) % 11)], 4 + (3 * i) % 9,
                arrival=2 * i, priority=i % 3, ignore_eos=True) for i in range(12)]
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, long_prefill_chunk=4, block_size=2,
                             num_blocks=12, num_host_blocks=6, preemption_mode=mode,
                             scheduling_policy=scheduling_policy)
    run = drive(config, reqs, max_steps=step_bound(reqs))
    assert_token_exact(run, reqs)
    assert run.scheduler.stats.num_preemptions > 0
    seqs = {r.rid for r in reqs}
    assert set(run.reasons) == seqs and set(run.reasons.values()) == {FinishReason.LENGTH}
