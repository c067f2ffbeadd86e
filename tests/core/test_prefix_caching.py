"""Prefix caching: hash-chained full blocks shared between requests, LRU eviction, collisions.

Three levels, like the rest of the suite:

* the block manager with exact state (hashes, tables, ref counts, LRU order, forced collisions);
* the scheduler with exact plans, and token-exactness against the prefix-aware fake model of
  ``scheduler_fixtures`` (whose fake K/V depends on every earlier token, so a wrongly shared block
  shows);
* the engine on a tiny float64 LLaMA: ``tests/engine/test_prefix_caching_engine.py``.

The real model (SmolLM2 against transformers) is in ``test_smollm2.py``; the state machines with
sharing in ``test_scheduler_statemachine.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minicb.core.prefix_cache as prefix_cache
from hypothesis_profiles import examples
from minicb.core.block_manager import BlockManager
from minicb.core.config import SchedulerConfig
from minicb.core.errors import InvalidArgument
from minicb.core.prefix_cache import ROOT_HASH, CachedBlock, hash_block
from minicb.core.scheduler import Scheduler
from minicb.core.sequence import SequenceStatus
from scheduler_fixtures import (
    VOCAB,
    Req,
    assert_token_exact,
    drain_scheduler,
    drive,
    rows,
    seq,
    step,
    step_bound,
)

A = list(range(10, 20))                        # 10 tokens: two full blocks of 4 and two more


def bm4(num_blocks: int = 8, **kw) -> BlockManager:
    return BlockManager(num_blocks, 4, enable_caching=True, **kw)


def compute(bm: BlockManager, rid: str, tokens: list[int]) -> list[int]:
    """Admit ``tokens`` as request ``rid`` (with its prefix-cache hits), compute them all and record
    the step; return the hits."""
    hits = bm.computed_blocks(tokens)
    bm.allocate(rid, len(tokens), hits)
    bm.cache_full_blocks(rid, tokens, len(tokens))
    bm.check_integrity()
    return hits


# --- block manager: exact state ----------------------------------------------------------------------
def test_full_computed_blocks_get_chained_hashes():
    bm = bm4()
    assert bm.allocate("a", 10) == [0, 1, 2]
    assert bm.cache_full_blocks("a", A, 3) == 0             # nothing full is computed yet
    assert bm.cache_full_blocks("a", A, 9) == 2
    h0 = hash_block(ROOT_HASH, (10, 11, 12, 13))
    h1 = hash_block(h0, (14, 15, 16, 17))
    assert bm.cache.by_hash == {h0: 0, h1: 1}
    assert bm.cache.blocks == {0: CachedBlock(h0, None, (10, 11, 12, 13)),
                               1: CachedBlock(h1, 0, (14, 15, 16, 17))}
    assert bm.num_hashed.get("a", 0) == 2
    assert bm.cache_full_blocks("a", A + [20, 21], 11) == 0  # block 2 full, not all computed yet
    assert bm.cache_full_blocks("a", A + [20, 21], 12) == 1  # now (filled by generated tokens)
    assert bm.cache.blocks[2] == CachedBlock(hash_block(h1, (18, 19, 20, 21)), 1, (18, 19, 20, 21))
    assert bm.cache_full_blocks("a", A + [20, 21], 12) == 0  # each block is offered once
    assert bm.num_hashed.get("a", 0) == 3
    bm.check_integrity()


def test_lookup_takes_the_longest_chain_and_leaves_the_last_token_to_compute():
    bm = bm4()
    compute(bm, "a", A)
    assert bm.computed_blocks(A) == [0, 1]
    assert bm.computed_blocks(A[:9]) == [0, 1]
    assert bm.computed_blocks(A[:8]) == [0]                # 8 tokens, both blocks cached: the last
    assert bm.computed_blocks(A[:5]) == [0]                #   block is computed again (never a full hit)
    assert bm.computed_blocks(A[:4]) == [] and bm.computed_blocks([]) == []
    assert bm.computed_blocks(A[:4] + [99] * 6) == [0]
    assert bm.computed_blocks([99] + A[1:]) == []          # block 1's tokens match, but its chain doesn't
    assert BlockManager(8, 4).computed_blocks(A) == []     # caching off


def test_hits_are_shared_and_freed_blocks_go_to_the_lru_list_tail_first():
    bm = bm4(num_blocks=6)
    compute(bm, "a", A)                                    # [0, 1, 2], 0 and 1 cached
    b = A[:8] + [50, 51, 52]
    assert bm.computed_blocks(b) == [0, 1]
    assert bm.can_allocate("b", 11, [0, 1])
    assert bm.allocate("b", 11, [0, 1]) == [3]             # only the new block is returned
    assert bm.block_table("b") == [0, 1, 3]
    assert bm.device.ref_counts == [2, 2, 1, 1, 0, 0]
    bm.free("a")
    assert bm.device.ref_counts == [1, 1, 0, 1, 0, 0]
    assert bm.device.cached_free_blocks() == []            # 0 and 1 are still held by b
    assert bm.device.free_blocks() == [2, 4, 5]
    bm.free("b")
    assert bm.device.cached_free_blocks() == [1, 0]        # the tail is evicted before the head
    assert bm.device.free_blocks() == [0, 1, 2, 3, 4, 5] and bm.num_cached_blocks == 2
    bm.check_integrity()


def test_eviction_takes_clean_blocks_first_then_the_least_recently_used():
    bm = bm4(num_blocks=6)
    compute(bm, "a", A[:8] + [1])                          # [0, 1, 2]: 0, 1 cached
    compute(bm, "b", [5, 6, 7, 8, 9])                      # [3, 4]: 3 cached
    bm.free("a")
    bm.free("b")
    assert bm.device.cached_free_blocks() == [1, 0, 3]
    assert compute(bm, "c", A[:4] + [2]) == [0]            # a hit: 0 leaves the LRU list ...
    bm.free("c")
    assert bm.device.cached_free_blocks() == [1, 3, 0]     # ... and comes back most recently used
    assert bm.allocate("d", 12) == [2, 4, 5]               # blocks holding nothing reusable first
    assert bm.allocate("d", 16) == [1]                     # then the least recently used: 1 ...
    assert not bm.is_cached(1) and bm.cache.by_hash.keys() == {bm.cache.blocks[0].block_hash,
                                                               bm.cache.blocks[3].block_hash}
    assert bm.computed_blocks(A) == [0]                    # ... whose hash is gone
    assert bm.allocate("e", 8) == [3, 0]                   # then 3, then 0
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 0
    bm.check_integrity()


def test_can_allocate_counts_hits_that_sit_on_the_free_list():
    bm = bm4(num_blocks=3)
    compute(bm, "a", A[:8])                                # [0, 1], both cached
    bm.free("a")
    b = A[:8] + [1]
    assert bm.computed_blocks(b) == [0, 1]
    assert bm.can_allocate("b", 9, [0, 1])                 # 1 new + 2 taken back from the LRU list = 3
    assert not bm.can_allocate("b", 13, [0, 1])
    assert bm.allocate("b", 9, [0, 1]) == [2]
    c = A[:4] + [7] * 6
    assert bm.computed_blocks(c) == [0]
    assert bm.can_allocate("c", 4 + 1, [0]) is False       # needs 1 new block, none free
    with pytest.raises(InvalidArgument, match="only start a new table"):
        bm.can_allocate("b", 9, [0])
    with pytest.raises(InvalidArgument, match="must be cached"):
        bm4().allocate("x", 4, [0])
    bm.check_integrity()


def test_a_prompt_fully_covered_by_cached_blocks_recomputes_its_last_block_privately():
    bm = bm4()
    compute(bm, "a", A[:8])                                # [0, 1], both cached
    hits = bm.computed_blocks(A[:8])
    assert hits == [0]
    assert bm.allocate("b", 8, hits) == [2]                # positions 4..7 go to a new, private block
    assert bm.cache_full_blocks("b", A[:8], 8) == 0        # same prefix as block 1: stays private
    assert not bm.is_cached(2) and bm.block_table("b") == [0, 2]
    bm.allocate("b", 12)
    assert bm.cache_full_blocks("b", A[:8] + [1, 2, 3, 4], 12) == 0   # its parent is private: no chain
    bm.check_integrity()


def test_the_same_prefix_computed_twice_at_once_is_cached_once():
    bm = bm4()
    bm.allocate("a", 9)
    bm.allocate("b", 9)
    assert bm.cache_full_blocks("a", A, 9) == 2
    assert bm.cache_full_blocks("b", A, 9) == 0
    assert sorted(bm.cache.blocks) == [0, 1]
    bm.check_integrity()


def test_collision_guard_compares_token_ids(monkeypatch):
    monkeypatch.setattr(prefix_cache, "hash_block", lambda parent_hash, token_ids: 42)
    bm = bm4()
    compute(bm, "a", A)
    assert bm.cache.by_hash == {42: 0}                     # block 1 collided with block 0: not cached
    assert bm.computed_blocks([9, 9, 9, 9, 1]) == []       # hash 42 found, tokens differ: a miss
    assert bm.computed_blocks(A[:4] + [1]) == [0]


def test_collision_guard_compares_the_parent_block(monkeypatch):
    # A hash that forgets the parent: a block with the same tokens at another position (or after
    # another prefix) gets the same hash. Its K/V would be wrong for us: the parent check refuses it.
    monkeypatch.setattr(prefix_cache, "hash_block", lambda parent_hash, token_ids: hash(token_ids))
    bm = bm4()
    compute(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert bm.computed_blocks([5, 6, 7, 8, 9]) == []       # finds block 1 by hash; its parent is 0
    assert bm.computed_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9]) == [0, 1]


def test_a_shared_table_is_never_swapped_out():
    bm = bm4(num_blocks=6, num_host_blocks=6)
    compute(bm, "a", A[:8] + [1])                          # [0, 1, 2]
    compute(bm, "b", A[:8] + [2])                          # [0, 1, 3]
    assert not bm.can_swap_out("b")
    with pytest.raises(InvalidArgument, match="2 of its blocks are shared"):
        bm.swap_out("b")
    bm.free("a")
    assert bm.can_swap_out("b")
    assert bm.swap_out("b") == [(0, 0), (1, 1), (3, 2)]
    assert bm.device.cached_free_blocks() == [1, 0]        # still cached on the device, merely free
    assert bm.computed_blocks(A) == [0, 1]
    assert bm.swap_in("b") == [(0, 2), (1, 3), (2, 4)]     # fresh private blocks (0, 1 stay cached)
    assert bm.cache_full_blocks("b", A[:8] + [2], 9) == 0  # their prefix is cached already
    assert bm.device.cached_free_blocks() == [1, 0]
    bm.check_integrity()


def test_without_caching_nothing_is_hashed():
    bm = BlockManager(8, 4)
    bm.allocate("a", 10)
    assert bm.cache_full_blocks("a", A, 10) == 0 and bm.num_cached_blocks == 0 and bm.cache is None
    bm.free("a")
    assert bm.device.cached_free_blocks() == [] and bm.device.free_blocks() == list(range(8))


def test_check_integrity_catches_cache_corruption():
    bm = bm4()
    compute(bm, "a", A)
    bm.free("a")
    bm.device._lru.move_to_end(1)                          # the parent 0 would be evicted first
    with pytest.raises(AssertionError, match="evicted after its parent"):
        bm.check_integrity()
    bm.device._lru.move_to_end(0)
    bm.check_integrity()
    bm.allocate("b", 4, [0])
    bm.device._lru[0] = None                               # held, yet on the LRU list
    with pytest.raises(AssertionError, match="both free and held"):
        bm.check_integrity()


def test_reset_empties_the_cache_only_when_no_request_holds_blocks():
    bm = bm4()
    compute(bm, "a", A)
    compute(bm, "b", A[:8] + [99, 98])                    # shares a's two full blocks
    def state():
        return bm.num_cached_blocks, bm.num_free_blocks, {r: list(t) for r, t in bm.block_tables.items()}

    before = state()
    assert bm.reset_prefix_cache() is False                # a and b still hold (cached) blocks
    assert state() == before
    bm.free("a")
    assert bm.reset_prefix_cache() is False                # b still holds the shared ones
    bm.free("b")
    assert bm.num_cached_blocks == 2 and len(bm.device.cached_free_blocks()) == 2
    assert bm.reset_prefix_cache() is True
    bm.check_integrity()
    assert bm.num_cached_blocks == 0 and bm.cache.by_hash == {} and bm.cache.num_children == {}
    assert bm.device.cached_free_blocks() == [] and bm.device.free_blocks() == list(range(8))
    assert bm.computed_blocks(A) == []                     # the same prompt now computes in full
    assert compute(bm, "c", A) == [] and bm.num_cached_blocks == 2   # and is cached afresh


def test_reset_without_caching_is_a_no_op_that_succeeds():
    bm = BlockManager(8, 4)
    bm.allocate("a", 10)
    assert bm.reset_prefix_cache() is True and bm.block_table("a") == [0, 1, 2]


# --- scheduler: exact plans ----------------------------------------------------------------------
def ccfg(**kw) -> SchedulerConfig:
    base = dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=16)
    base.update(kw)
    return SchedulerConfig(**base)


def test_caching_is_on_by_default_for_continuous_only():
    assert SchedulerConfig().prefix_caching and SchedulerConfig().enable_prefix_caching
    assert not SchedulerConfig(policy="dynamic").prefix_caching
    assert not SchedulerConfig(policy="static").prefix_caching
    assert not SchedulerConfig(enable_prefix_caching=False).prefix_caching
    assert Scheduler(SchedulerConfig(policy="static")).block_manager.cache is None
    with pytest.raises(InvalidArgument, match="enable_prefix_caching"):
        SchedulerConfig(enable_prefix_caching="yes")


def test_a_later_request_starts_at_its_cached_length():
    sched = Scheduler(ccfg())
    sched.add(seq("a", 10, 3))                             # prompt 2..11
    plan, _ = step(sched)
    assert rows(plan) == [("a", 0, 0, 10, (0, 1, 2), True)]
    assert sched.block_manager.num_cached_blocks == 2      # cached once the step is recorded
    sched.add(seq("b", 9, 2))                              # the same first 9 tokens
    plan, _ = step(sched)
    assert rows(plan) == [("a", 0, 10, 1, (0, 1, 2), True), ("b", 1, 8, 1, (0, 1, 3), True)]
    assert plan.seqs[1].token_ids == (sched.get("b").prompt_token_ids[8],)
    assert plan.seqs[1].start_pos == 8                     # 8 tokens came from the cache, not computed
    b = sched.get("b")
    assert (b.num_cached_tokens, b.num_computed_tokens) == (8, 9)
    assert sched.block_manager.device.ref_counts[:4] == [2, 2, 1, 1]
    st = sched.stats
    assert (st.num_prompt_tokens, st.num_cached_prompt_tokens) == (19, 8)
    assert st.prefix_cache_hit_rate == pytest.approx(8 / 19)
    drain_scheduler(sched)
    assert sched.stats.num_batched_tokens == 10 + 2 + 1 + 1   # b's 8 cached tokens were never computed


def test_requests_admitted_in_the_same_step_share_their_prefix():
    # b is admitted in the step that computes a's prompt: it shares the 2 full blocks a fills in this
    # very step (their K/V is written by the forward before b's rows read it) and computes only the rest.
    sched = Scheduler(ccfg())
    sched.add(seq("a", 10, 2))
    sched.add(seq("b", 10, 2))
    plan, _ = step(sched)
    assert rows(plan) == [("a", 0, 0, 10, (0, 1, 2), True), ("b", 1, 8, 2, (0, 1, 3), True)]
    assert sched.block_manager.device.ref_counts[:4] == [2, 2, 1, 1]     # held once, by both
    assert sorted(sched.block_manager.cache.blocks) == [0, 1]             # a cached them after the step
    assert sched.stats.num_cached_prompt_tokens == 8
    assert sched.get("b").num_cached_tokens == 8


def test_same_step_sharing_only_takes_blocks_the_step_completes():
    # a's first chunk is 6 tokens (long_prefill_chunk): only its block 0 is full after the step, so b
    # shares block 0 only, although a's block 1 will hold b's tokens 4..7 too once a's next chunk runs.
    sched = Scheduler(ccfg(long_prefill_chunk=6))
    sched.add(seq("a", 10, 2))
    sched.add(seq("b", 10, 2))
    plan, _ = step(sched)
    assert rows(plan) == [("a", 0, 0, 6, (0, 1), False), ("b", 1, 4, 6, (0, 2, 3), True)]
    assert sched.block_manager.device.ref_counts[:4] == [2, 1, 1, 1]


def test_same_step_sharing_leaves_the_last_token_to_compute():
    # b is a's first 8 tokens and one more (9 = 2 blocks + 1): it shares both full blocks, the limit
    # being its last token, and computes 1 token from position 8.
    sched = Scheduler(ccfg())
    sched.add(seq("a", 10, 2))
    sched.add(seq("b", 9, 2))
    plan, _ = step(sched)
    assert rows(plan) == [("a", 0, 0, 10, (0, 1, 2), True), ("b", 1, 8, 1, (0, 1, 3), True)]


def test_same_step_sharing_takes_the_first_of_equally_long_runs():
    # a and b computed the same block 1 in parallel (each from its own partial block of step 0): both
    # complete it in step 1, where c is admitted; c shares a's (the first row offering it), not b's.
    sched = Scheduler(ccfg(long_prefill_chunk=6, max_num_batched_tokens=8))
    sched.add(seq("a", 8, 2))
    sched.add(seq("b", 8, 2))
    plan, _ = step(sched)
    assert rows(plan) == [("a", 0, 0, 6, (0, 1), False), ("b", 1, 4, 2, (0, 2), False)]
    sched.add(seq("c", 9, 2))
    plan, _ = step(sched)
    assert rows(plan) == [("a", 0, 6, 2, (0, 1), True), ("b", 1, 6, 2, (0, 2), True),
                          ("c", 2, 8, 1, (0, 1, 3), True)]


def test_same_step_sharing_is_token_exact_against_the_fake_model():
    # block size 4: b and d share a's blocks 0 and 1 ([5 5 5 5][5 5 5 5]), c shares block 0 only
    reqs = [Req("a", [5] * 9 + [1, 2], 6, ignore_eos=True), Req("b", [5] * 9 + [3], 6, ignore_eos=True),
            Req("c", [5] * 4 + [7] * 8, 5, ignore_eos=True), Req("d", [5] * 9 + [1, 2], 4, ignore_eos=True)]
    run = drive(ccfg(max_num_seqs=4, max_num_batched_tokens=64), reqs)
    assert_token_exact(run, reqs)
    first = run.plans[0]
    assert [s.start_pos for s in first.seqs] == [0, 8, 4, 8]     # every later row starts after a's blocks
    assert run.scheduler.stats.num_batched_tokens == sum(len(r.prompt) + r.max_tokens - 1 for r in reqs) - 20


def test_a_prompt_fully_covered_by_cached_blocks_computes_its_last_block():
    sched = Scheduler(ccfg())
    sched.add(seq("a", 8, 3))
    step(sched)
    sched.add(seq("b", 8, 1))                              # both of its blocks are cached
    plan, done = step(sched)
    assert rows(plan) == [("a", 0, 8, 1, (0, 1, 2), True), ("b", 1, 4, 4, (0, 3), True)]
    assert [s.request_id for s in done] == ["b"] and done[0].num_cached_tokens == 4
    sched.check_integrity()


def test_recompute_victim_is_found_again_in_the_cache():
    sched = Scheduler(ccfg(max_num_seqs=2, block_size=2, num_blocks=5))
    sched.add(seq("a", 3, 6))
    sched.add(seq("b", 3, 3, first=10))
    bm = sched.block_manager
    step(sched)
    step(sched)
    plan, _ = step(sched)                                  # a needs a block; b (newest) is preempted
    assert plan.preempted == ("b",) and rows(plan) == [("a", 0, 4, 1, (0, 1, 4), True)]
    b = sched.get("b")
    assert (b.status, b.num_computed_tokens, b.num_cached_tokens) == (SequenceStatus.WAITING, 0, 0)
    assert bm.device.cached_free_blocks() == [3, 2]        # b's blocks: free, still cached, tail first
    plan, _ = step(sched)                                  # b: 2 blocks cached, but needs 3 of 2 free
    assert [s.request_id for s in plan.seqs] == ["a"]
    plan, _ = step(sched)                                  # a's next block evicts b's tail (LRU first)
    assert rows(plan) == [("a", 0, 6, 1, (0, 1, 4, 3), True)]
    assert bm.device.cached_free_blocks() == [2]
    step(sched)                                            # a finishes
    plan, _ = step(sched)
    assert rows(plan) == [("b", 0, 2, 3, (2, 3, 4), True)]  # b re-prefills from its surviving block
    assert b.num_cached_tokens == 2 and sched.stats.num_cached_reprefill_tokens == 2
    assert sched.stats.num_cached_prompt_tokens == 0       # re-admissions are not prompt hits
    assert not sched.has_unfinished()


def test_swap_falls_back_to_recompute_for_a_victim_with_shared_blocks():
    sched = Scheduler(ccfg(max_num_seqs=2, block_size=2, num_blocks=6, num_host_blocks=8,
                           preemption_mode="swap"))
    sched.add(seq("a", 5, 5))
    step(sched)
    sched.add(seq("b", 5, 4))                              # shares a's blocks 0 and 1
    plan, _ = step(sched)
    assert rows(plan) == [("a", 0, 5, 1, (0, 1, 2), True), ("b", 1, 4, 1, (0, 1, 3), True)]
    step(sched)
    step(sched)
    plan, _ = step(sched)                                  # no block left for a: b is the victim
    assert plan.preempted == ("b",) and plan.swap_out == ()
    assert (sched.stats.num_swaps, sched.stats.num_recomputes) == (0, 1)
    assert sched.block_manager.host_tables == {}
    # step() samples 7 for everyone, so b generated what a did: b's re-prefill finds a's blocks,
    # including the one a filled with generated tokens.
    plan, _ = step(sched)
    assert rows(plan) == [("b", 0, 6, 2, (0, 1, 2, 3), True)]
    assert sched.stats.num_cached_reprefill_tokens == 6
    drain_scheduler(sched)


def test_generated_token_blocks_are_cached_for_the_next_turn():
    sched = Scheduler(ccfg(block_size=2))
    sched.add(seq("a", 3, 6))
    drain_scheduler(sched, {"a": 5})
    a_tokens = seq("a", 3).prompt_token_ids + [5] * 6      # 9 tokens: 4 full blocks cached
    assert sched.block_manager.num_cached_blocks == 4
    turn = seq("t", 0, 2)
    turn.prompt_token_ids = a_tokens[:8] + [9]
    sched.add(turn)
    plan, _ = step(sched)
    assert rows(plan)[0][2:4] == (8, 1) and turn.num_cached_tokens == 8


# --- scheduler: token-exactness with sharing (fake model) --------------------------------------------
BASES = [[(7 * i + 3) % (VOCAB - 1) + 1 for i in range(24)],
         [(5 * i + 1) % (VOCAB - 1) + 1 for i in range(16)]]


@st.composite
def sharing_requests(draw):
    """Requests cut from two base sequences plus a private tail: identical prompts, common prefixes,
    prompts that are prefixes of each other, whole blocks, with staggered arrivals."""
    n = draw(st.integers(2, 10))
    reqs = []
    for i in range(n):
        base = BASES[draw(st.integers(0, 1))]
        cut = draw(st.sampled_from([len(base), 16, 8, 4, draw(st.integers(0, len(base)))]))
        tail = draw(st.lists(st.integers(1, VOCAB - 1), max_size=4))
        prompt = (base[:cut] + tail) or [1]
        reqs.append(Req(f"r{i}", prompt, draw(st.integers(1, 10)), arrival=draw(st.integers(0, 12)),
                        priority=draw(st.integers(0, 2)), ignore_eos=draw(st.booleans())))
    return reqs


def assert_tables_only_grow(run) -> None:
    """A running request's block table keeps its shape from step to step: it only gains blocks at the
    end (the cached head is fixed at admission); it is rebuilt only after a preemption."""
    last: dict[str, tuple[int, ...]] = {}
    for plan in run.plans:
        for rid in plan.preempted:
            last.pop(rid, None)
        for s in plan.seqs:
            prev = last.get(s.request_id, ())
            assert s.block_table[:len(prev)] == prev, f"{s.request_id}: table {prev} became {s.block_table}"
            last[s.request_id] = s.block_table


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), reqs=sharing_requests())
def test_shared_prefixes_stay_token_exact_under_pressure(data, reqs):
    block_size = data.draw(st.sampled_from([1, 2, 4, 8]))
    need = max(-(-(len(r.prompt) + r.max_tokens) // block_size) for r in reqs)
    max_num_seqs = data.draw(st.integers(1, 4))
    budget = data.draw(st.integers(1, 32))
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, block_size=block_size,
        long_prefill_chunk=data.draw(st.one_of(st.none(), st.integers(1, budget))),
        num_blocks=max(max_num_seqs, need) + data.draw(st.integers(0, need)),
        num_host_blocks=data.draw(st.sampled_from([0, need, 4 * need])),
        preemption_mode=data.draw(st.sampled_from(["recompute", "swap"])),
        scheduling_policy=data.draw(st.sampled_from(["fcfs", "priority"])))
    run = drive(config, reqs, max_steps=step_bound(reqs))     # check_plan: no step writes a cached block
    assert_token_exact(run, reqs)
    assert_tables_only_grow(run)
    st_ = run.scheduler.stats
    assert st_.num_prompt_tokens == sum(len(r.prompt) for r in reqs)
    assert 0 <= st_.num_cached_prompt_tokens <= st_.num_prompt_tokens


def test_staggered_sharing_hits_and_saves_compute():
    reqs = [Req(f"r{i}", BASES[0][:20] + [i + 1], 6, arrival=2 * i, ignore_eos=True) for i in range(6)]
    off = drive(SchedulerConfig(block_size=4, enable_prefix_caching=False), reqs)
    on = drive(SchedulerConfig(block_size=4), reqs)
    assert_token_exact(on, reqs)
    assert on.outputs == off.outputs
    assert on.scheduler.stats.num_cached_prompt_tokens == 5 * 20
    assert off.scheduler.stats.num_batched_tokens - on.scheduler.stats.num_batched_tokens == 5 * 20


# --- cache salts (vLLM's cache_salt): tenants never share a block ------------------------------------
def test_two_salts_never_share_a_cached_block():
    bm = bm4(num_blocks=12)
    compute(bm, "a", A)                                    # no salt: blocks 0, 1 cached
    assert bm.computed_blocks(A, "tenant-1") == []         # the same tokens under a salt: no hit
    hits = bm.computed_blocks(A, "tenant-1")
    bm.allocate("b", len(A), hits)
    assert bm.cache_full_blocks("b", A, len(A), "tenant-1") == 2        # its own copies, cached
    b_blocks = bm.block_table("b")[:2]
    assert not set(b_blocks) & {0, 1}
    assert bm.computed_blocks(A, "tenant-1") == b_blocks   # the same salt finds them again
    assert bm.computed_blocks(A, "tenant-2") == []         # another salt does not
    assert bm.computed_blocks(A) == [0, 1]                 # nor does no salt find the salted ones
    first = bm.cache.blocks[b_blocks[0]]
    assert first.salt == "tenant-1" and first.block_hash == hash_block(prefix_cache.root_hash("tenant-1"),
                                                                        tuple(A[:4]))
    assert bm.cache.blocks[b_blocks[1]].salt is None       # deeper blocks: their parent carries it
    bm.check_integrity()


def test_a_salt_collision_is_guarded_like_a_token_collision(monkeypatch):
    monkeypatch.setattr(prefix_cache, "root_hash", lambda salt: ROOT_HASH)   # every salt hashes alike
    bm = bm4()
    compute(bm, "a", A)
    assert bm.computed_blocks(A, "other") == []            # the stored salt is compared


def test_requests_with_different_salts_do_not_share_in_the_same_step_either():
    from minicb.core.sampling_params import SamplingParams
    from minicb.core.sequence import Sequence

    sched = Scheduler(ccfg())
    a, b = seq("a", 10, 2), seq("b", 10, 2)
    salted = Sequence("c", list(b.prompt_token_ids),
                      SamplingParams(max_tokens=2, ignore_eos=True, cache_salt="tenant-1"))
    sched.add(a)
    sched.add(salted)
    plan, _ = step(sched)
    assert rows(plan)[1][2] == 0                           # c computes its whole prompt: nothing shared
    assert sched.get("c").num_cached_tokens == 0
    sched.add(b)                                           # no salt, same tokens as a: shares a's blocks
    step(sched)
    assert sched.get("b").num_cached_tokens == 8
    drain_scheduler(sched)


def test_cache_salt_must_be_a_non_empty_string():
    from minicb.core.sampling_params import SamplingParams

    for bad in ("", 5, b"x"):
        with pytest.raises(InvalidArgument, match="cache_salt"):
            SamplingParams(cache_salt=bad)
