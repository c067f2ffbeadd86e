"""Parallel sampling (``SamplingParams.n > 1``): a request forks after its prompt, its children share
the prompt's blocks by reference count, the partly filled last block is copied on write.

Expected tables are worked out by hand from the block manager's rules (lowest free block first, one
copy per writer while others still hold the block); expected tokens come from the fake model run alone
(``alone``, child ``i`` with salt ``i``, the stand-in for seed ``s + i``).
"""

from __future__ import annotations

import pytest

from minicb.core.block_pool import BlockPool
from minicb.core.config import SchedulerConfig
from minicb.core.errors import InvalidArgument, RequestRejected
from minicb.core.sampling_params import SamplingParams
from minicb.core.scheduler import Scheduler
from minicb.core.sequence import FinishReason, Sequence, SequenceStatus
from scheduler_fixtures import (
    EOS,
    FakeModel,
    Req,
    alone,
    assert_token_exact,
    check_plan,
    child_id,
    drain_scheduler,
    drive,
    make_group,
    rows,
)

PROMPT = [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]          # 10 tokens: blocks of 4 -> 2 full + 2 in a third


def cfg(**kw) -> SchedulerConfig:
    base = dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=16)
    base.update(kw)
    return SchedulerConfig(**base)


def add(sched: Scheduler, rid: str, n: int, prompt=PROMPT, max_tokens: int = 5, **kw) -> list[Sequence]:
    group = make_group(Req(rid, list(prompt), max_tokens, ignore_eos=True, n=n, **kw))
    sched.add(group[0], group[1:])
    return group


def step(sched: Scheduler, model: FakeModel):
    plan = sched.schedule()
    check_plan(sched, plan)
    done = sched.update(plan, model.run(plan), 0.0)
    sched.check_integrity()
    return plan, done


def test_child_params_follow_vllms_seed_rule():
    p = SamplingParams(n=4, seed=100, temperature=0.7)
    assert [c.seed for c in map(p.child_params, range(4))] == [100, 101, 102, 103]
    assert all(c.n == 1 and c.temperature == 0.7 for c in map(p.child_params, range(4)))
    assert SamplingParams(n=3).child_params(2).seed is None          # unseeded stays unseeded
    one = SamplingParams(seed=5)
    assert one.child_params(0) is one
    assert SamplingParams(n=2, seed=2**63 - 1).child_params(1).seed == 0   # wraps, stays a valid seed
    with pytest.raises(InvalidArgument):
        p.child_params(4)
    with pytest.raises(InvalidArgument):
        SamplingParams(n=0)


def test_n4_allocates_the_prompts_blocks_once_and_copies_the_last_block_on_write(monkeypatch):
    taken = []
    real_take = BlockPool.take
    monkeypatch.setattr(BlockPool, "take", lambda self: taken.append(real_take(self)) or taken[-1])
    sched, model = Scheduler(cfg()), FakeModel(cfg())
    add(sched, "r", 4)
    bm = sched.block_manager
    plan, _ = step(sched, model)                        # the prompt, once, sampled for all 4 children
    assert rows(plan) == [("0_r", 0, 0, 10, (0, 1, 2), True)]
    assert plan.seqs[0].forks == ("1_r", "2_r", "3_r") and plan.copy_blocks == ()
    assert taken == [0, 1, 2]                           # the prompt's 3 blocks: allocated once
    assert bm.device.ref_counts[:3] == [4, 4, 4]        # ... and named by all 4 tables
    assert {bm.block_table(f"{i}_r") == [0, 1, 2] for i in range(4)} == {True}
    assert len(sched.running) == 4 and sched.stats.num_batched_tokens == 10
    plan, _ = step(sched, model)                        # each child writes position 10 into block 2
    assert plan.copy_blocks == ((2, 3), (2, 4), (2, 5))  # 3 copies; the last holder writes in place
    assert [s.block_table for s in plan.seqs] == [(0, 1, 3), (0, 1, 4), (0, 1, 5), (0, 1, 2)]
    assert taken == [0, 1, 2, 3, 4, 5]
    assert bm.device.ref_counts[:6] == [4, 4, 1, 1, 1, 1]
    finished = drain_scheduler(sched, model=model)
    assert {s.request_id: s.output_token_ids for s in finished} == \
        {f"{i}_r": alone(PROMPT, 5, None, salt=i) for i in range(4)}


def test_a_prompt_of_whole_blocks_forks_without_a_copy():
    sched, model = Scheduler(cfg()), FakeModel(cfg())
    add(sched, "r", 3, prompt=PROMPT[:8])
    step(sched, model)
    plan, _ = step(sched, model)                        # position 8 starts a new block for each child
    assert plan.copy_blocks == ()
    assert [s.block_table for s in plan.seqs] == [(0, 1, 2), (0, 1, 3), (0, 1, 4)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("caching", [True, False])
def test_children_are_token_exact_under_preemption(mode, caching):
    # 2 full requests' worth of blocks for 4 + 3 children and a plain request: preemption is constant
    config = cfg(num_blocks=8, max_num_batched_tokens=8, preemption_mode=mode, enable_prefix_caching=caching,
                 num_host_blocks=8 if mode == "swap" else 0)
    reqs = [Req("a", PROMPT, 12, ignore_eos=True, n=4), Req("b", PROMPT[:6], 9, arrival=2, n=3),
            Req("c", [3, 1, 4, 1, 5], 8, arrival=3, ignore_eos=True)]
    run = drive(config, reqs)
    assert_token_exact(run, reqs)
    assert run.scheduler.stats.num_preemptions > 0
    assert any(p.copy_blocks for p in run.plans)


def test_fewer_free_slots_than_children_the_rest_wait_at_the_front():
    # 2 slots, n = 4: children 0 and 1 run after the fork; 2 and 3 wait (no blocks) ahead of a later
    # request, and each recomputes its prompt and its own first token when a slot frees.
    config = cfg(max_num_seqs=2)
    sched, model = Scheduler(config), FakeModel(config)
    group = add(sched, "r", 4, max_tokens=3)
    plan, _ = step(sched, model)
    add(sched, "late", 1, prompt=[9, 9, 9], max_tokens=2)
    assert plan.seqs[0].forks == ("1_r", "2_r", "3_r")
    assert [s.status for s in group] == [SequenceStatus.RUNNING, SequenceStatus.RUNNING,
                                         SequenceStatus.WAITING, SequenceStatus.WAITING]
    assert [s.request_id for s in sched.waiting] == ["2_r", "3_r", "late"]
    assert [len(s.output_token_ids) for s in group] == [1, 1, 1, 1]     # every child sampled its token
    assert sched.block_manager.device.ref_counts[:3] == [2, 2, 2]       # the waiting ones hold nothing
    order, starts = [], {}
    def admitted(p):
        for s in p.seqs:
            if s.request_id not in starts and s.request_id in ("2_r", "3_r", "late"):
                order.append(s.request_id)
                starts[s.request_id] = s.start_pos
    finished = drain_scheduler(sched, model=model, on_plan=admitted)
    assert order == ["2_r", "3_r", "late"]                              # admitted in that order
    assert starts == {"2_r": 8, "3_r": 8, "late": 0}    # the prompt's 2 full blocks are found cached
    got = {s.request_id: s.output_token_ids for s in finished}
    assert got == {**{f"{i}_r": alone(PROMPT, 3, None, salt=i) for i in range(4)},
                   "late": alone([9, 9, 9], 2, None)}


def test_one_slot_serves_four_children_one_after_another():
    reqs = [Req("r", PROMPT, 4, ignore_eos=True, n=4)]
    run = drive(cfg(max_num_seqs=1, num_blocks=4), reqs)
    assert_token_exact(run, reqs)


def test_children_that_finish_with_their_first_token_end_at_the_fork():
    sched, model = Scheduler(cfg()), FakeModel(cfg())
    add(sched, "r", 3, max_tokens=1)
    plan, done = step(sched, model)
    assert sorted(s.request_id for s in done) == ["0_r", "1_r", "2_r"]
    assert all(s.finish_reason is FinishReason.LENGTH for s in done)
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == 16
    assert sched.stats.num_finished == 3


def test_aborting_child_0_before_the_fork_ends_its_attached_children():
    sched, model = Scheduler(cfg(long_prefill_chunk=4)), FakeModel(cfg())
    group = add(sched, "r", 3)
    step(sched, model)                                   # a first chunk: no fork yet
    assert sched.abort("0_r") is group[0]
    assert all(s.finish_reason is FinishReason.ABORT for s in group)
    assert not sched.has_unfinished() and sched.stats.num_finished == 3
    sched.check_integrity()


def test_aborting_an_attached_child_leaves_the_others():
    sched, model = Scheduler(cfg()), FakeModel(cfg())
    add(sched, "r", 3)
    assert sched.abort("1_r").finish_reason is FinishReason.ABORT
    plan, _ = step(sched, model)
    assert plan.seqs[0].forks == ("2_r",)
    finished = drain_scheduler(sched, model=model)
    assert sorted(s.request_id for s in finished) == ["0_r", "2_r"]


def test_aborting_a_forked_child_drops_only_its_reference():
    sched, model = Scheduler(cfg()), FakeModel(cfg())
    add(sched, "r", 3)
    step(sched, model)
    sched.abort("0_r")                                   # child 0 itself: the others keep the blocks
    assert sched.block_manager.device.ref_counts[:3] == [2, 2, 2]
    sched.check_integrity()
    finished = drain_scheduler(sched, model=model)
    assert {s.request_id: s.output_token_ids for s in finished} == \
        {f"{i}_r": alone(PROMPT, 5, None, salt=i) for i in (1, 2)}


def test_a_failed_prompt_step_fails_the_attached_children():
    sched = Scheduler(cfg())
    group = add(sched, "r", 3)
    plan = sched.schedule()
    failed = sched.fail_step(plan, "boom")
    assert [s.request_id for s in failed] == ["0_r", "1_r", "2_r"]
    assert all(s.finish_reason is FinishReason.ERROR and s.error == "boom" for s in group)
    assert not sched.has_unfinished()
    sched.check_integrity()


@pytest.mark.parametrize("policy", ["dynamic", "static"])
def test_padded_policies_run_every_child_on_its_own(policy):
    reqs = [Req("r", PROMPT, 4, ignore_eos=True, n=3), Req("s", [7, 7], 3, n=2)]
    run = drive(cfg(policy=policy), reqs)
    assert_token_exact(run, reqs)
    assert run.plans[0].seqs[0].forks == ()
    assert [s.request_id for s in run.plans[0].seqs] == ["0_r", "1_r", "2_r", "0_s"]


def test_n_is_bounded_and_children_are_checked():
    sched = Scheduler(cfg(max_n=2))
    with pytest.raises(RequestRejected, match="max_n=2"):
        add(sched, "r", 3)
    assert not sched.has_unfinished()
    a, b = make_group(Req("r", PROMPT, 4, n=2))
    with pytest.raises(InvalidArgument, match="prompt"):
        sched.add(a, [Sequence("1_r", [1], a.params, index=1)])
    with pytest.raises(InvalidArgument, match="twice"):
        sched.add(a, [Sequence("0_r", list(PROMPT), a.params, index=1)])
    sched.add(a, [b])
    with pytest.raises(InvalidArgument, match="already in use"):
        sched.add(Sequence("1_r", [1], a.params))
    assert child_id("r", 0, 1) == "r" and child_id("r", 2, 3) == "2_r"
    assert alone(PROMPT, 3, EOS, salt=1) != alone(PROMPT, 3, EOS, salt=0)


def test_aborting_every_attached_child_leaves_child_0_a_plain_request():
    sched, model = Scheduler(cfg()), FakeModel(cfg())
    add(sched, "r", 2, max_tokens=3)
    sched.abort("1_r")                                   # the last attached child: nothing to fork
    sched.check_integrity()
    plan, _ = step(sched, model)
    assert plan.seqs[0].forks == () and not sched._attached
    finished = drain_scheduler(sched, model=model)
    assert [(s.request_id, s.output_token_ids) for s in finished] == [("0_r", alone(PROMPT, 3, None))]


def test_a_copy_whose_source_a_later_preemption_frees_still_copies_the_prompt():
    # 10 blocks of 2: child 0's copy-on-write takes the last free block, then q6's growth preempts
    # child 1 (the source's other holder): the copy still runs before the forward (the found case).
    config = cfg(block_size=2, num_blocks=10, max_num_batched_tokens=16)
    reqs = [Req("q5", [5, 12, 22, 11, 21, 22, 22, 4, 2], 8, ignore_eos=True, n=2),
            Req("q6", [8, 18, 20], 4, ignore_eos=True), Req("q7", [17, 19, 21, 14, 17, 9, 15, 20, 9], 4,
                                                           ignore_eos=True),
            Req("q8", [2, 16, 21], 1, ignore_eos=True, n=4)]
    run = drive(config, reqs)
    assert_token_exact(run, reqs)
    assert any(p.copy_blocks and p.preempted for p in run.plans)


def test_a_preempted_childs_copy_on_write_is_taken_back_with_its_grant():
    # x's prefill chunks preempt the newest children after they made their copies in the same step;
    # check_plan (in drive) refuses a plan that keeps a copy no row needs.
    config = cfg(max_num_batched_tokens=24, long_prefill_chunk=3, block_size=2, num_blocks=6)
    reqs = [Req("x", [17, 14, 12, 20, 19, 12, 11, 12, 4, 10], 2, ignore_eos=True),
            Req("r", [22], 4, arrival=1, ignore_eos=True, n=3)]
    run = drive(config, reqs)
    assert_token_exact(run, reqs)
    assert run.scheduler.stats.num_preemptions > 0 and any(p.copy_blocks for p in run.plans)


def test_every_child_is_checked_like_a_request():
    sched = Scheduler(cfg())
    a, b, c = make_group(Req("r", PROMPT, 4, n=3))
    b.output_token_ids.append(5)                         # not a fresh sequence
    with pytest.raises(InvalidArgument, match="fresh sequence"):
        sched.add(a, [b, c])
    b.output_token_ids.clear()
    c.request_id = "1_r"                                 # two children under one id
    with pytest.raises(InvalidArgument, match="given twice"):
        sched.add(a, [b, c])
    assert not sched.has_unfinished()


def test_a_forked_child_inherits_its_prompts_times_and_cache_hits():
    sched, model = Scheduler(cfg()), FakeModel(cfg())
    add(sched, "first", 1, max_tokens=1)                 # caches the prompt's 2 full blocks
    sched.update(p := sched.schedule(now=1.0), model.run(p), 1.0)
    group = add(sched, "r", 2, max_tokens=3)
    plan = sched.schedule(now=2.0)
    assert rows(plan) == [("0_r", 0, 8, 2, (0, 1, 2), True)]          # 8 tokens from the cache
    sched.update(plan, model.run(plan), 2.0)
    sched.check_integrity()
    # load-independent: a fake clock (times passed in)
    assert [(s.first_scheduled_time, s.num_cached_tokens, s.num_computed_tokens) for s in group] == \
        [(2.0, 8, 10), (2.0, 8, 10)]
