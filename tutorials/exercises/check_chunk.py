"""Checker of exercise 3 (chunk.py): how many tokens a request gets.

    python -m pytest tutorials/exercises/check_chunk.py --solution my_chunk.py
"""

import _reference
import pytest
from _checking import pick


@pytest.fixture
def chunk(solution):
    return pick(solution, "chunk", _reference.chunk)


def test_a_decode_gets_its_one_token(chunk):
    got = chunk(1, 16, 8)
    assert got == 1, f"a decode (1 uncomputed token) got {got} tokens, not 1"


def test_a_short_prompt_is_fed_whole(chunk):
    got = chunk(5, 16, 8)
    assert got == 5, (f"a 5-token prompt with 16 tokens left and chunks of 8 "
                      f"got {got}: it fits, so all 5")


def test_a_long_prompt_is_cut_at_the_chunk_cap(chunk):
    got = chunk(20, 16, 8)
    assert got == 8, (f"a 20-token prompt got {got} tokens with a chunk cap of "
                      "8: one chunk is at most long_prefill_chunk tokens")


def test_nobody_gets_more_than_the_budget_has_left(chunk):
    got = chunk(20, 3, 8)
    assert got == 3, (f"a 20-token prompt got {got} tokens with 3 left in the "
                      "step's budget: at most what is left")


def test_a_spent_budget_grants_nothing(chunk):
    got = chunk(5, 0, 8)
    assert got == 0, (f"with 0 tokens left a request got {got}: 0 means "
                      "'not this step' (never negative)")


def test_no_row_left_grants_nothing(chunk):
    got = chunk(5, 16, 8, seqs_left=0)
    assert got == 0, (f"with no row left in the batch (max_num_seqs reached) "
                      f"a request got {got} tokens: it must get 0")


def test_one_step_of_the_planner(chunk):
    """Three decodes and two prompts under a 16-token budget, chunks of 8."""
    uncomputed, left, rows, grants = [1, 1, 1, 20, 5], 16, 4, []
    for n in uncomputed:
        g = chunk(n, left, 8, rows)
        grants.append(g)
        if g:
            left, rows = left - g, rows - 1
    assert grants == [1, 1, 1, 8, 0], (
        f"a step of 16 tokens and 4 rows over requests with {uncomputed} "
        f"uncomputed tokens granted {grants}: the decodes take 3, the long "
        "prompt a chunk of 8, and the last prompt finds no row left (4 "
        "rows are taken) so it gets 0")


def test_every_small_case(chunk):
    for n in range(1, 12):
        for left in range(0, 12):
            for cap in (1, 3, 8):
                for seats in (0, 1, 2):
                    want = _reference.chunk(n, left, cap, seats)
                    got = chunk(n, left, cap, seats)
                    assert got == want, (
                        f"chunk({n}, tokens_left={left}, chunk_cap={cap}, "
                        f"seqs_left={seats}) returned {got}, not {want}")
