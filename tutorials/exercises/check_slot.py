"""Checker of exercise 1 (slot.py): the lowest free slot.

    python -m pytest tutorials/exercises/check_slot.py --solution my_slot.py
"""

import random

import _reference
import pytest
from _checking import pick


@pytest.fixture
def table(solution):
    return pick(solution, "SlotTable", _reference.SlotTable)


def test_first_requests_fill_the_slots_in_order(table):
    t = table(4)
    got = [t.assign(r) for r in "abc"]
    assert got == [0, 1, 2], (
        f"three requests into an empty table of 4 got slots {got}: each "
        "must get the lowest free slot, so 0, 1, 2")


@pytest.mark.parametrize("order", [(2, 0), (0, 2)])
def test_a_freed_slot_is_reused_lowest_first(table, order):
    t = table(4)
    for r in "abcd":
        t.assign(r)
    for slot in order:
        t.release(slot)
    first, second = t.assign("e"), t.assign("f")
    assert (first, second) == (0, 2), (
        f"slots {order[0]} then {order[1]} were freed; the next two requests "
        f"got {first}, {second}. The lowest free slot comes first (0, then "
        "2), not the most recently freed one (a stack) nor the first freed "
        "(a queue)")


def test_release_returns_the_holder(table):
    t = table(3)
    t.assign("a")
    t.assign("b")
    got = t.release(1)
    assert got == "b", f"release(1) returned {got!r}; slot 1 was held by 'b'"


def test_a_full_table_refuses(table):
    t = table(2)
    t.assign("a")
    t.assign("b")
    with pytest.raises(Exception):  # noqa: B017  (any exception will do)
        got = t.assign("c")
        pytest.fail(f"assign('c') on a full table of 2 returned {got!r}: it "
                    "must raise (handing out a held slot loses a request)")


def test_one_request_holds_one_slot(table):
    t = table(3)
    t.assign("a")
    with pytest.raises(Exception):  # noqa: B017  (any exception will do)
        got = t.assign("a")
        pytest.fail(f"'a' already holds slot 0, and assign('a') returned "
                    f"{got!r}: it must raise")


def test_releasing_a_free_slot_raises(table):
    t = table(3)
    t.assign("a")
    with pytest.raises(Exception):  # noqa: B017  (any exception will do)
        got = t.release(2)
        pytest.fail(f"slot 2 is free and release(2) returned {got!r}: it "
                    "must raise")


def test_random_admissions_and_releases(table):
    rng = random.Random(0)
    t, free, held, history = table(5), set(range(5)), {}, []
    for k in range(300):
        if free and (not held or rng.random() < 0.55):
            rid = f"r{k}"
            got, want = t.assign(rid), min(free)
            history.append(f"assign({rid!r}) -> {got}")
            assert got == want, (
                f"after {'; '.join(history[-6:])}: free slots were "
                f"{sorted(free)}, so the lowest is {want}, not {got}")
            free.remove(want)
            held[want] = rid
        else:
            slot = rng.choice(sorted(held))
            got = t.release(slot)
            history.append(f"release({slot}) -> {got!r}")
            assert got == held.pop(slot), (
                f"release({slot}) returned {got!r}; it held "
                f"{held.get(slot)!r}")
            free.add(slot)
