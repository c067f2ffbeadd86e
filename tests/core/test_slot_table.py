"""Unit tests of the slot table: lowest free slot first, exact owners, and loud errors."""

import pytest

from minicb.core.errors import InvalidArgument
from minicb.core.slot_table import SlotTable


def test_assign_takes_lowest_free_slot():
    t = SlotTable(4)
    assert [t.assign(r) for r in "abc"] == [0, 1, 2]
    assert t.num_free == 1 and t.num_held == 3
    assert t.release(1) == "b"
    assert t.release(0) == "a"
    assert t.assign("d") == 0            # lowest free, not the most recently released
    assert t.assign("e") == 1
    assert t.held() == {0: "d", 1: "e", 2: "c"}
    assert t.owner(3) is None and t.owner(2) == "c"
    assert t.slot_of("c") == 2 and t.slot_of("a") is None
    t.check_integrity()


def test_full_table_raises_and_keeps_state():
    t = SlotTable(2)
    t.assign("a")
    t.assign("b")
    with pytest.raises(InvalidArgument, match="no free slot.*2 slots"):
        t.assign("c")
    assert t.held() == {0: "a", 1: "b"} and t.slot_of("c") is None
    t.check_integrity()


def test_bad_arguments_name_the_argument():
    t = SlotTable(2)
    t.assign("a")
    with pytest.raises(InvalidArgument, match="already holds slot 0"):
        t.assign("a")
    with pytest.raises(InvalidArgument, match="slot_id 1 is not held"):
        t.release(1)
    with pytest.raises(InvalidArgument, match=r"slot_id must be in \[0, 1\], got 2"):
        t.release(2)
    with pytest.raises(InvalidArgument, match=r"slot_id must be in \[0, 1\], got -1"):
        t.owner(-1)
    with pytest.raises(InvalidArgument, match="num_slots"):
        SlotTable(0)
    t.check_integrity()


def test_release_then_reassign_cycles_every_slot():
    t = SlotTable(3)
    for r in "abc":
        t.assign(r)
    for slot in (2, 0, 1):
        t.release(slot)
    assert t.num_free == 3 and t.held() == {}
    assert [t.assign(r) for r in "xyz"] == [0, 1, 2]
    t.check_integrity()


def test_check_integrity_catches_a_slot_both_free_and_held():
    t = SlotTable(2)
    t.assign("a")
    t._free.append(0)
    with pytest.raises(AssertionError):
        t.check_integrity()
