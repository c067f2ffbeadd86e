"""Checker of exercise 4 (victim.py): the preemption victim.

    python -m pytest tutorials/exercises/check_victim.py --solution my_victim.py
"""

import itertools

import _reference
import pytest
from _checking import pick


@pytest.fixture
def choose_victim(solution):
    return pick(solution, "choose_victim", _reference.choose_victim)


def R(rid, arrival, admitted, priority=0):
    return {"id": rid, "arrival": arrival, "admitted": admitted,
            "priority": priority}


def test_fcfs_preempts_the_newest_admission(choose_victim):
    running = [R("a", 0, 0), R("b", 1, 1), R("c", 2, 2)]
    got = choose_victim(running)
    assert got == "c", (f"running a, b, c admitted in that order: the victim "
                        f"is the last admitted, 'c', not {got!r}")


def test_fcfs_goes_by_admission_not_arrival(choose_victim):
    # a arrived first but was preempted and re-admitted after b and c
    running = [R("b", 1, 1), R("c", 2, 2), R("a", 0, 3)]
    got = choose_victim(running)
    assert got == "a", (
        f"'a' arrived first but was admitted last (admitted=3, after a "
        f"preemption): fcfs preempts the newest ADMISSION, 'a', not {got!r}")


def test_the_order_of_the_list_does_not_matter(choose_victim):
    base = [R("a", 0, 0), R("b", 1, 4), R("c", 2, 2)]
    for perm in itertools.permutations(base):
        got = choose_victim(list(perm))
        assert got == "b", (f"for running {[r['id'] for r in perm]} the victim "
                            f"was {got!r}; 'b' has the latest admission")


def test_priority_preempts_the_least_important(choose_victim):
    running = [R("a", 0, 0, priority=2), R("b", 1, 1, priority=0),
               R("c", 2, 2, priority=1)]
    got = choose_victim(running, "priority")
    assert got == "a", (
        f"priorities a=2, b=0, c=1: a larger value is LESS important, so "
        f"the victim is 'a', not {got!r}")


def test_priority_ties_go_to_the_latest_arrival(choose_victim):
    running = [R("a", 0, 2, priority=1), R("b", 3, 0, priority=1),
               R("c", 1, 1, priority=0)]
    got = choose_victim(running, "priority")
    assert got == "b", (
        f"a and b share the least important priority (1): the tie goes to "
        f"the later ARRIVAL, 'b' (arrival 3), not {got!r}")


def test_a_lone_request_is_its_own_victim(choose_victim):
    got = choose_victim([R("a", 0, 0)])
    assert got == "a", f"the only running request is the victim, not {got!r}"
