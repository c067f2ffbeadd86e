"""``Scheduler.snapshot()``: the plain values step listeners see, and the figures derived from them."""

from __future__ import annotations

from test_scheduler import Req, make_seq, step

from minicb.core.config import SchedulerConfig
from minicb.core.scheduler import Scheduler


def test_a_snapshot_counts_slots_and_blocks_and_lists_the_free_blocks():
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, block_size=4, num_blocks=6,
                                      enable_prefix_caching=False))
    s0 = sched.snapshot()
    assert s0.num_held_slots == 0 and s0.num_used_blocks == 0 and s0.free_blocks == tuple(range(6))
    sched.add(make_seq(Req("a", list(range(1, 10)), 4)))     # 9 tokens: 3 blocks
    sched.add(make_seq(Req("b", [1, 2], 4)))                 # 2 tokens: 1 block
    step(sched)
    s = sched.snapshot()
    assert s.num_held_slots == 2 and s.slots.count(None) == 1
    assert s.num_used_blocks == 4 and s.num_free_blocks == 2
    held = {b for _, table in s.block_tables for b in table}
    assert len(held) == 4 and s.free_blocks == tuple(sorted(set(range(6)) - held))
    assert set(s.running) == {"a", "b"} and s.waiting == () and s.swapped == ()


def test_a_scheduler_needs_a_scheduler_config():
    import pytest

    from minicb.core.errors import InvalidArgument

    for bad in (None, {"max_num_seqs": 2}, "continuous"):
        with pytest.raises(InvalidArgument, match="config must be a SchedulerConfig"):
            Scheduler(bad)


def test_add_refuses_a_non_string_request_id():
    import pytest

    from minicb.core.errors import InvalidArgument
    from minicb.core.sampling_params import SamplingParams
    from minicb.core.sequence import Sequence

    sched = Scheduler(SchedulerConfig(max_num_seqs=2, num_blocks=8, block_size=4))
    for rid in (5, None, b"x"):
        with pytest.raises(InvalidArgument, match="request_id must be a str"):
            sched.add(Sequence(rid, [1, 2], SamplingParams(max_tokens=1)))


def test_prompt_tokens_are_counted_once_per_request_whatever_the_policy_and_preemption():
    from test_scheduler import assert_token_exact, drive, step_bound

    reqs = [Req("first", [(3 * j) % 50 + 1 for j in range(12)], 10, arrival=0, priority=5, ignore_eos=True),
            Req("vip", [(7 * j) % 50 + 1 for j in range(12)], 10, arrival=1, priority=0, ignore_eos=True)]
    total = sum(len(r.prompt) for r in reqs)
    for policy in ("static", "dynamic"):
        run = drive(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, block_size=4, num_blocks=16,
                                    policy=policy), reqs, max_steps=step_bound(reqs))
        assert_token_exact(run, reqs)
        assert run.scheduler.stats.num_prompt_tokens == total, policy
    # the first admission (index 0) is preempted by a more important request and admitted again
    run = drive(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, block_size=4, num_blocks=7,
                                scheduling_policy="priority", enable_prefix_caching=False),
                reqs, max_steps=step_bound(reqs))
    assert_token_exact(run, reqs)
    assert run.scheduler.stats.num_recomputes > 0 and run.seqs["first"].num_preemptions > 0
    assert run.scheduler.stats.num_prompt_tokens == total


def test_every_finished_request_is_counted():
    from test_scheduler import drive

    reqs = [Req(f"r{i}", [i + 1, i + 2], 3, arrival=i) for i in range(5)]
    for policy in ("continuous", "static"):
        run = drive(SchedulerConfig(max_num_seqs=2, num_blocks=8, block_size=4, policy=policy), reqs)
        assert run.scheduler.stats.num_finished == 5


def test_the_slot_table_refuses_a_size_whose_containers_cannot_fit(monkeypatch):
    """About 128 bytes a slot: 100 slots need 12,800 bytes."""
    import pytest

    import minicb.core.slot_table as slot_table
    from minicb.core.errors import InvalidArgument

    monkeypatch.setattr(slot_table, "available_cpu_bytes", lambda: 12800)
    assert slot_table.SlotTable(100).num_free == 100
    with pytest.raises(InvalidArgument, match="max_num_seqs=101"):
        slot_table.SlotTable(101)


def test_a_sequence_records_each_token_s_time_and_the_first_one():
    from minicb.core.sampling_params import SamplingParams
    from minicb.core.sequence import Sequence

    s = Sequence("a", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    assert s.append_token(5, now=1.5) is False  # load-independent: a fake clock (times passed in)
    # load-independent: a fake clock (times passed in)
    assert s.append_token(6, now=2.5) is False
    # load-independent: a fake clock (times passed in)
    assert s.first_token_time == 1.5 and s.token_times == [1.5, 2.5] and s.output_token_ids == [5, 6]
    # load-independent: a fake clock (times passed in)
    assert s.append_token(7, now=4.0) is True and s.first_token_time == 1.5


def test_a_snapshot_lists_the_blocks_in_the_prefix_cache_held_or_free():
    from test_scheduler import drive

    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, block_size=4, num_blocks=12)
    sched = Scheduler(cfg)
    assert sched.snapshot().cached_blocks == ()
    run = drive(cfg, [Req("a", list(range(1, 10)), 4)])      # 9 prompt tokens: 2 full blocks, then more
    s = run.scheduler.snapshot()
    bm = run.scheduler.block_manager
    assert s.block_tables == ()                                 # finished: every block is free again
    assert sorted(s.cached_blocks) == [b for b in range(12) if bm.is_cached(b)]
    assert len(s.cached_blocks) == s.num_cached_blocks >= 2     # its prompt's full blocks at least
