"""The chunked-prefill planner: exact token allocations for hand-built steps, and its invariants."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunk_rule import ChunkPlan, plan_chunks
from hypothesis_profiles import examples
from minicb.core.errors import InvalidArgument
from minicb.core.planner import TokenBudget


def test_decodes_first_then_a_chunk_of_the_new_prompt():
    # The example of the module docstring: budget 8, three decodes and a 20-token prompt -> 3 + 5.
    p = plan_chunks(3, [], [20], max_num_batched_tokens=8, max_num_seqs=8)
    assert p == ChunkPlan(decodes=(1, 1, 1), prefills=(), new=(5,))
    assert p.total == 8


def test_ongoing_prefills_before_new_prompts():
    p = plan_chunks(1, [10, 6], [4], max_num_batched_tokens=12, max_num_seqs=8)
    assert p == ChunkPlan((1,), (10, 1), (0,))


def test_long_prefill_chunk_caps_each_sequence():
    p = plan_chunks(0, [10, 3], [20, 20], max_num_batched_tokens=16, max_num_seqs=8, chunk_cap=4)
    assert p == ChunkPlan((), (4, 3), (4, 4))


def test_budget_smaller_than_the_decodes():
    p = plan_chunks(3, [5], [5], max_num_batched_tokens=2, max_num_seqs=8)
    assert p == ChunkPlan((1, 1, 0), (0,), (0,))


def test_max_num_seqs_limits_the_rows():
    p = plan_chunks(2, [], [5, 5], max_num_batched_tokens=100, max_num_seqs=3)
    assert p == ChunkPlan((1, 1), (), (5, 0))


def test_new_prompts_stop_at_the_first_that_gets_nothing():
    p = plan_chunks(0, [], [4, 20, 1], max_num_batched_tokens=10, max_num_seqs=8)
    assert p == ChunkPlan((), (), (4, 6, 0))


def test_stall_free_caps_the_prompt_tokens_beside_decodes():
    # The planner docstring's example: one decode and a 2,000-token prompt, cap 64 -> 1 + 64 (not 1 + 2,000).
    p = plan_chunks(1, [], [2000], max_num_batched_tokens=2048, max_num_seqs=256,
                    max_prefill_tokens_while_decoding=64)
    assert p == ChunkPlan((1,), (), (64,))
    # without the cap the same step carries the whole prompt
    assert plan_chunks(1, [], [2000], max_num_batched_tokens=2048, max_num_seqs=256).new == (2000,)


def test_stall_free_gives_prompts_the_whole_budget_without_decodes():
    p = plan_chunks(0, [1990], [100], max_num_batched_tokens=2048, max_num_seqs=256,
                    max_prefill_tokens_while_decoding=64)
    assert p == ChunkPlan((), (1990,), (58,))          # 1990 + 58 = 2048: the cap does not apply


def test_stall_free_cap_is_shared_by_ongoing_and_new_prompts():
    # 2 decodes; cap 32 over prefills of 10 and 30 (10 + 22), then nothing is left for new prompts,
    # and the first new prompt that gets nothing stops admission.
    p = plan_chunks(2, [10, 30], [50, 5], max_num_batched_tokens=100, max_num_seqs=8,
                    max_prefill_tokens_while_decoding=32)
    assert p == ChunkPlan((1, 1), (10, 22), (0, 0))
    # with the chunk cap too: each prompt at most 4, and the four grants together at most 10
    p = plan_chunks(1, [9, 9], [9, 9], max_num_batched_tokens=100, max_num_seqs=8, chunk_cap=4,
                    max_prefill_tokens_while_decoding=10)
    assert p == ChunkPlan((1,), (4, 4), (2, 0))


def test_stall_free_cap_grows_with_the_sequences_held():
    # 32 + 4 a sequence held (the planner docstring's rule): one decode and a long prompt are two
    # sequences, 40 prompt tokens; ten decodes, a prefill and a long prompt twelve, 80
    kw = dict(max_num_batched_tokens=2048, max_num_seqs=256, max_prefill_tokens_while_decoding=32,
              prefill_tokens_per_seq=4)
    assert plan_chunks(1, [], [2000], **kw) == ChunkPlan((1,), (), (40,))
    assert plan_chunks(10, [50], [2000], **kw) == ChunkPlan((1,) * 10, (50,), (30,))
    assert plan_chunks(0, [], [2000], **kw) == ChunkPlan((), (), (2000,))      # no decode: no cap
    # a burst: one decode and 63 prompts of 100 tokens waiting: 32 + 4 x 64 = 288 tokens, not 36
    burst = plan_chunks(1, [], [100] * 63, **kw)
    assert burst.new[:4] == (100, 100, 88, 0) and sum(burst.new) == 288
    # without a base cap the share per sequence alone does nothing (the cap is off)
    assert plan_chunks(1, [], [2000], max_num_batched_tokens=2048, max_num_seqs=8,
                       prefill_tokens_per_seq=4).new == (2000,)


def test_stall_free_cap_larger_than_what_is_left_changes_nothing():
    # budget 8, three decodes: 5 tokens left for the prompt, below the cap of 64
    p = plan_chunks(3, [], [20], max_num_batched_tokens=8, max_num_seqs=8,
                    max_prefill_tokens_while_decoding=64)
    assert p == ChunkPlan((1, 1, 1), (), (5,))


def test_bad_inputs_name_the_argument():
    with pytest.raises(InvalidArgument, match="prefills"):
        plan_chunks(0, [1], [], max_num_batched_tokens=4, max_num_seqs=2)   # one token is a decode
    with pytest.raises(InvalidArgument, match="new"):
        plan_chunks(0, [], [0], max_num_batched_tokens=4, max_num_seqs=2)
    with pytest.raises(InvalidArgument, match="decodes"):
        plan_chunks(-1, [], [], max_num_batched_tokens=4, max_num_seqs=2)
    with pytest.raises(InvalidArgument, match="max_num_batched_tokens"):
        plan_chunks(0, [], [], max_num_batched_tokens=0, max_num_seqs=2)
    with pytest.raises(InvalidArgument, match="chunk_cap"):
        TokenBudget(4, 2, 0)


def test_token_budget_take_and_give_back():
    b = TokenBudget(max_num_batched_tokens=10, max_num_seqs=2, chunk_cap=6)
    assert b.chunk(20) == 6
    b.take(6)
    assert b.chunk(20) == 4 and b.tokens_left == 4
    b.take(4)
    assert b.chunk(1) == 0                       # tokens and rows both exhausted
    b.give_back(6)                               # that sequence got preempted later in the step
    assert (b.num_batched_tokens, b.num_seqs, b.chunk(20)) == (4, 1, 6)
    with pytest.raises(AssertionError):
        b.take(7)
    b.check_integrity()
    b.num_batched_tokens = 11
    with pytest.raises(AssertionError, match="overdrawn"):
        b.check_integrity()


def test_token_budget_stall_free_allowance_is_spent_and_not_refunded():
    b = TokenBudget(max_num_batched_tokens=100, max_num_seqs=8, chunk_cap=50)
    b.take(1)                                    # a decode, before the allowance is set
    b.prefill_left = 12
    assert b.chunk(40) == 12                     # the allowance binds before the chunk cap and the budget
    b.take(7)
    assert (b.prefill_left, b.chunk(40)) == (5, 5)
    b.give_back(7)                               # a chunk taken back in a preemption: tokens return ...
    assert (b.num_batched_tokens, b.tokens_left) == (1, 99)
    assert (b.prefill_left, b.chunk(40)) == (5, 5)   # ... but the allowance is not offered again
    with pytest.raises(AssertionError, match="stall-free"):
        b.take(6)
    b.take(5)
    assert b.chunk(1) == 0
    b.check_integrity()
    b.prefill_left = -1
    with pytest.raises(AssertionError, match="stall-free"):
        b.check_integrity()


@settings(max_examples=examples(200), deadline=None)
@given(
    decodes=st.integers(0, 6),
    prefills=st.lists(st.integers(2, 40), max_size=5),
    new=st.lists(st.integers(1, 40), max_size=5),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 12),
    cap=st.one_of(st.none(), st.integers(1, 64)),
    stall=st.one_of(st.none(), st.integers(1, 80)),
    per_seq=st.integers(0, 5),
)
def test_plan_respects_every_limit_and_is_greedy(decodes, prefills, new, budget, max_num_seqs, cap, stall,
                                                 per_seq):
    cap = None if cap is None else min(cap, budget)
    p = plan_chunks(decodes, prefills, new, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                    chunk_cap=cap, max_prefill_tokens_while_decoding=stall,
                    prefill_tokens_per_seq=per_seq)
    held = min(decodes + len(prefills) + len(new), max_num_seqs)
    stall = None if stall is None else stall + per_seq * held
    wants = [1] * decodes + prefills + new
    got = list(p.decodes + p.prefills + p.new)
    limit = cap or budget
    prompt_tokens = sum(p.prefills) + sum(p.new)
    capped = decodes > 0 and stall is not None
    assert p.total <= budget
    assert not capped or prompt_tokens <= stall          # stall-free: prompts share the cap beside decodes
    assert sum(1 for g in got if g) <= max_num_seqs
    assert all(0 <= g <= min(w, limit) for g, w in zip(got, wants, strict=True))
    for i, (g, w) in enumerate(zip(got, wants, strict=True)):
        if g < min(w, limit):   # short-changed: only because the step ran out of tokens, rows or the cap
            assert (p.total == budget or sum(1 for x in got if x) == max_num_seqs
                    or (capped and i >= decodes and prompt_tokens == stall))
            assert not any(got[i + 1:])


@settings(max_examples=examples(60), deadline=None)
@given(decodes=st.integers(0, 4), prefills=st.lists(st.integers(2, 30), max_size=3),
       new=st.lists(st.integers(1, 30), max_size=4), budget=st.integers(1, 40),
       cap=st.one_of(st.none(), st.integers(1, 40)), stall=st.one_of(st.none(), st.integers(1, 40)),
       per_seq=st.integers(0, 3))
def test_the_scheduler_grants_exactly_what_the_rule_says(decodes, prefills, new, budget, cap, stall,
                                                         per_seq):
    """Build a scheduler state with ``decodes`` decoding sequences and ``prefills`` half-fed prompts,
    queue ``new`` prompts, and compare one ``schedule()`` with ``plan_chunks`` (slots and blocks
    plentiful, so neither admission limits nor preemption interfere)."""
    import dataclasses

    from minicb.core.config import SchedulerConfig
    from minicb.core.sampling_params import SamplingParams
    from minicb.core.scheduler import Scheduler
    from minicb.core.sequence import Sequence

    cap = None if cap is None else min(cap, budget)
    slots = decodes + len(prefills) + len(new)
    base = SchedulerConfig(max_num_seqs=max(slots, 1), max_num_batched_tokens=10_000, block_size=4,
                           num_blocks=512, max_model_len=512, enable_prefix_caching=False)
    sched = Scheduler(base)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    for i in range(decodes):                           # 3-token prompts: decoding after step 0
        sched.add(Sequence(f"d{i}", [5, 6, 7], params))
    for i, left in enumerate(prefills):                # step 0 feeds 1 token: `left` remain
        sched.add(Sequence(f"p{i}", [9] * (left + 1), params))
    plan = sched.schedule(0.0)
    rows = tuple(s if s.request_id.startswith("d") else
                 dataclasses.replace(s, token_ids=s.token_ids[:1], sample=False) for s in plan.seqs)
    sched.update(dataclasses.replace(plan, seqs=rows), {f"d{i}": 5 for i in range(decodes)}, 0.0)
    for i, n in enumerate(new):
        sched.add(Sequence(f"n{i}", [11] * n, params))
    sched.config = dataclasses.replace(base, max_num_batched_tokens=budget, long_prefill_chunk=cap,
                                       max_prefill_tokens_while_decoding=stall,
                                       prefill_tokens_per_seq=per_seq)
    got = {s.request_id: s.num_tokens for s in sched.schedule(1.0).seqs}
    rule = plan_chunks(decodes, prefills, new, max_num_batched_tokens=budget,
                       max_num_seqs=base.max_num_seqs, chunk_cap=cap, max_prefill_tokens_while_decoding=stall,
                       prefill_tokens_per_seq=per_seq)
    want = ({f"d{i}": g for i, g in enumerate(rule.decodes)}
            | {f"p{i}": g for i, g in enumerate(rule.prefills)}
            | {f"n{i}": g for i, g in enumerate(rule.new)})
    assert got == {r: g for r, g in want.items() if g}
