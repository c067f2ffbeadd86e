"""The chunked-prefill planner: exact token allocations for hand-built steps, and its invariants."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minicb.errors import InvalidArgument
from minicb.planner import ChunkPlan, TokenBudget, plan_chunks


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


@settings(max_examples=200, deadline=None)
@given(
    decodes=st.integers(0, 6),
    prefills=st.lists(st.integers(2, 40), max_size=5),
    new=st.lists(st.integers(1, 40), max_size=5),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 12),
    cap=st.one_of(st.none(), st.integers(1, 64)),
)
def test_plan_respects_every_limit_and_is_greedy(decodes, prefills, new, budget, max_num_seqs, cap):
    cap = None if cap is None else min(cap, budget)
    p = plan_chunks(decodes, prefills, new, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                    chunk_cap=cap)
    wants = [1] * decodes + prefills + new
    got = list(p.decodes + p.prefills + p.new)
    limit = cap or budget
    assert p.total <= budget
    assert sum(1 for g in got if g) <= max_num_seqs
    assert all(0 <= g <= min(w, limit) for g, w in zip(got, wants, strict=True))
    for i, (g, w) in enumerate(zip(got, wants, strict=True)):
        if g < min(w, limit):   # short-changed: only because the step ran out of tokens or rows
            assert p.total == budget or sum(1 for x in got if x) == max_num_seqs
            assert not any(got[i + 1:])
