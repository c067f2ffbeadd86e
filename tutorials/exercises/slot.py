"""Exercise 1: the slot table, lowest free slot first.

A running batch has ``num_slots`` fixed rows (batch slots). A request that is
admitted gets a slot; when it finishes or is preempted its slot is released.
minicb (and vLLM's InputBatch) always hands out the LOWEST free slot, so the
batch stays packed at the low rows and a slot id stays small.

Write the class below, then check it:

    cp tutorials/exercises/slot.py my_slot.py     # and fill it in
    python -m pytest tutorials/exercises/check_slot.py --solution my_slot.py

Rules the checker tests:
* ``assign(request_id)`` returns the lowest free slot id and marks it held;
* ``release(slot_id)`` frees the slot and returns the request that held it;
* raise an exception (any) when every slot is held, when a request that
  already holds a slot asks again, and when a free slot is released.

minicb's answer: ``minicb.core.slot_table.SlotTable`` (a min-heap).
"""


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # your state here: who holds which slot, which slots are free

    def assign(self, request_id: str) -> int:
        """Give ``request_id`` the lowest free slot; return its id."""
        raise NotImplementedError("exercise 1: assign")

    def release(self, slot_id: int) -> str:
        """Free ``slot_id``; return the request that held it."""
        raise NotImplementedError("exercise 1: release")
