"""Checker of exercise 5 (slot_mapping.py): where each token's K/V goes.

    python -m pytest tutorials/exercises/check_slot_mapping.py \\
        --solution my_slot_mapping.py
"""

import random

import _reference
import pytest
from _checking import pick


@pytest.fixture
def slot_mapping(solution):
    return pick(solution, "slot_mapping", _reference.slot_mapping)


def test_a_prompt_in_its_first_block(slot_mapping):
    got = slot_mapping([(0, 3, [5])], 4)
    assert got == [20, 21, 22], (
        f"a 3-token prompt in block 5 (blocks of 4) got {got}: positions "
        "0, 1, 2 live at 5*4 + 0, 5*4 + 1, 5*4 + 2")


def test_a_decode_far_into_its_table(slot_mapping):
    got = slot_mapping([(6, 1, [3, 7])], 4)
    assert got == [30], (
        f"a decode at position 6 with table [3, 7] got {got}: position 6 is "
        "in the table's block 6 // 4 = 1, physical block 7, offset "
        "6 % 4 = 2: 7*4 + 2 = 30. Start from the row's start position")


def test_a_chunk_that_crosses_a_block_boundary(slot_mapping):
    got = slot_mapping([(2, 4, [9, 1])], 4)
    assert got == [38, 39, 4, 5], (
        f"positions 2..5 with table [9, 1] got {got}: 2 and 3 are in block 9 "
        "(38, 39), 4 and 5 in block 1 (4, 5). The physical blocks need not "
        "be consecutive")


def test_rows_are_packed_end_to_end(slot_mapping):
    rows = [(6, 1, [3, 7]), (0, 3, [2]), (4, 2, [0, 8])]
    got = slot_mapping(rows, 4)
    assert got == [30, 8, 9, 10, 32, 33], (
        f"three rows (a decode, a prompt, a chunk) got {got}: one slot per "
        "new token, row after row in the given order")


def test_random_steps(slot_mapping):
    rng = random.Random(0)
    for _ in range(100):
        bs = rng.choice([1, 2, 4, 16])
        rows = []
        for _ in range(rng.randint(1, 4)):
            start, n = rng.randint(0, 40), rng.randint(1, 9)
            blocks = -(-(start + n) // bs)
            rows.append((start, n, rng.sample(range(200), blocks)))
        want = _reference.slot_mapping(rows, bs)
        got = slot_mapping(rows, bs)
        assert got == want, f"rows {rows}, block_size {bs}: got {got}, " \
                            f"expected {want}"
