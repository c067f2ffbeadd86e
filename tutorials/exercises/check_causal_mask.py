"""Checker of exercise 6 (causal_mask.py): the bottom-right causal mask.

    python -m pytest tutorials/exercises/check_causal_mask.py \\
        --solution my_causal_mask.py
"""

import _reference
import pytest
from _checking import pick


@pytest.fixture
def causal_mask(solution):
    return pick(solution, "causal_mask", _reference.causal_mask)


def _show(mask) -> str:
    return "\n".join("".join("1" if m else "." for m in row) for row in mask)


def _check(causal_mask, q, k, why):
    got = [[bool(m) for m in row] for row in causal_mask(q, k)]
    want = _reference.causal_mask(q, k)
    assert [len(r) for r in got] == [k] * q, (
        f"causal_mask({q}, {k}) must have {q} rows of {k} entries")
    assert got == want, (f"causal_mask({q}, {k}), {why}:\nyours:\n{_show(got)}"
                         f"\nexpected:\n{_show(want)}")


def test_a_prompt_from_position_0_is_lower_triangular(causal_mask):
    _check(causal_mask, 4, 4, "a 4-token prompt: query i sees keys 0..i")


def test_a_decode_sees_every_key(causal_mask):
    _check(causal_mask, 1, 6, "a decode at position 5 sees keys 0..5")


def test_a_later_chunk_is_aligned_bottom_right(causal_mask):
    _check(causal_mask, 3, 7,
           "a chunk at positions 4..6 after 4 cached keys: query 0 (position "
           "4) sees keys 0..4, the last query sees all 7. A top-left mask "
           "(query i sees keys 0..i) would hide the cached prefix")


def test_every_small_shape(causal_mask):
    for k in range(1, 10):
        for q in range(1, k + 1):
            _check(causal_mask, q, k, f"{k - q} cached keys, {q} new tokens")
