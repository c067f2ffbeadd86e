"""Checker of exercise 2 (can_allocate.py): blocks needed vs blocks free.

    python -m pytest tutorials/exercises/check_can_allocate.py \\
        --solution my_can_allocate.py
"""

import _reference
import pytest
from _checking import pick


@pytest.fixture
def can_allocate(solution):
    return pick(solution, "can_allocate", _reference.can_allocate)


def _needs(n: int, bs: int, held: int) -> int:
    return max(0, -(-n // bs) - held)


@pytest.mark.parametrize("n, bs, held, free, want", [
    (8, 4, 0, 2, True),       # exactly two full blocks
    (9, 4, 0, 2, False),      # one position more needs a third block
    (1, 4, 0, 1, True),       # a one-token prompt still needs a block
    (1, 4, 0, 0, False),
])
def test_a_new_table_needs_ceil_of_tokens_over_block_size(
        can_allocate, n, bs, held, free, want):
    got = can_allocate(n, bs, held, free)
    assert got == want, (
        f"can_allocate({n}, block_size={bs}, num_held={held}, num_free={free})"
        f" returned {got}: {n} positions need ceil({n}/{bs}) = "
        f"{-(-n // bs)} blocks, and {free} are free")


@pytest.mark.parametrize("n, held", [(7, 2), (8, 2), (5, 3)])
def test_a_table_that_already_covers_needs_nothing(can_allocate, n, held):
    got = can_allocate(n, 4, held, 0)
    assert got, (
        f"a table of {held} blocks of 4 covers {4 * held} positions, so "
        f"{n} positions need no new block even with 0 free; got {got}. "
        "Count only the blocks the table must GAIN")


@pytest.mark.parametrize("n, held, free, want", [
    (9, 2, 1, True),          # position 8 opens block 3
    (12, 2, 1, True),
    (13, 2, 1, False),        # position 12 opens a fourth block
    (5, 1, 0, False),         # a decode at position 4 crosses into block 2
])
def test_growing_past_a_block_boundary(can_allocate, n, held, free, want):
    got = can_allocate(n, 4, held, free)
    assert got == want, (
        f"held {held} blocks of 4 (positions 0..{4 * held - 1}), asked for "
        f"{n} positions with {free} free: it needs "
        f"{_needs(n, 4, held)} new block(s), so the answer is {want}, "
        f"not {got}")


def test_every_small_case(can_allocate):
    for bs in (1, 2, 4, 16):
        for held in range(4):
            for free in range(4):
                for n in range(1, 4 * bs + 2):
                    want = _reference.can_allocate(n, bs, held, free)
                    got = can_allocate(n, bs, held, free)
                    assert got == want, (
                        f"can_allocate({n}, {bs}, {held}, {free}) returned "
                        f"{got}: it needs {_needs(n, bs, held)} new blocks "
                        f"and {free} are free")
