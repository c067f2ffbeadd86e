"""The slot table: the fixed set of batch rows ("slots") that running sequences occupy.

A batch has ``num_slots`` rows (``max_num_seqs`` in vLLM's words). A sequence takes a slot when it is
admitted and gives it back when it finishes or is preempted; continuous batching refills a freed slot at
the very next step. The table always hands out the *lowest* free slot id, so slot assignment is
deterministic and every tensor-parallel rank computes the same one::

    slot id :   0        1        2        3
    owner   : "req-a"    -     "req-c"     -          free heap: [1, 3]
                                                       assign("req-d") -> 1

Invariants (``check_integrity``):

* a slot holds at most one request, and a request holds at most one slot;
* free + held == ``num_slots``; no slot is both free and held.

This module imports no torch.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from minicb.core.errors import InvalidArgument, check_int
from minicb.core.memory import available_cpu_bytes, check_fits


@dataclass(slots=True)
class SlotTable:
    """The fixed rows of the running batch (batch slots): which request holds which, lowest free first."""

    num_slots: int
    _owners: list[str | None] = field(init=False, repr=False)
    _slot_of: dict[str, int] = field(init=False, repr=False)
    _free: list[int] = field(init=False, repr=False)        # a min-heap of free slot ids

    def __post_init__(self) -> None:
        check_int("num_slots", self.num_slots, lo=1)
        # three containers of num_slots entries: refuse a size the machine cannot hold (minicb.core.memory)
        check_fits(f"max_num_seqs={self.num_slots:,} (the slot table, ~128 bytes a slot)",
                   128 * self.num_slots, available_cpu_bytes(), "in host memory", "lower max_num_seqs")
        self._owners = [None] * self.num_slots
        self._slot_of = {}
        self._free = list(range(self.num_slots))            # sorted, hence already a heap

    # --- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return len(self._slot_of)

    def owner(self, slot_id: int) -> str | None:
        """The request holding ``slot_id``, or None when the slot is free."""
        return self._owners[self._check_slot(slot_id)]

    def slot_of(self, request_id: str) -> int | None:
        """The slot ``request_id`` holds, or None."""
        return self._slot_of.get(request_id)

    def held(self) -> dict[int, str]:
        """``{slot_id: request_id}`` for every held slot, in slot order."""
        return {s: r for s, r in enumerate(self._owners) if r is not None}

    # --- transitions ---------------------------------------------------------------------------
    def assign(self, request_id: str) -> int:
        """Give ``request_id`` the lowest free slot and return its id."""
        if request_id in self._slot_of:
            raise InvalidArgument(
                f"request_id {request_id!r} already holds slot {self._slot_of[request_id]}")
        if not self._free:
            raise InvalidArgument(f"no free slot: all {self.num_slots} slots are held")
        slot_id = heapq.heappop(self._free)
        self._owners[slot_id] = request_id
        self._slot_of[request_id] = slot_id
        return slot_id

    def release(self, slot_id: int) -> str:
        """Free ``slot_id``; return the request that held it."""
        request_id = self._owners[self._check_slot(slot_id)]
        if request_id is None:
            raise InvalidArgument(f"slot_id {slot_id} is not held")
        self._owners[slot_id] = None
        del self._slot_of[request_id]
        heapq.heappush(self._free, slot_id)
        return request_id

    # --- checks ----------------------------------------------------------------------------
    def _check_slot(self, slot_id: int) -> int:
        return check_int("slot_id", slot_id, lo=0, hi=self.num_slots - 1)

    def check_integrity(self) -> None:
        free = set(self._free)
        held = {s for s, r in enumerate(self._owners) if r is not None}
        assert len(free) == len(self._free), f"a slot is free twice: {sorted(self._free)}"
        assert not free & held, f"slots both free and held: {sorted(free & held)}"
        assert len(free) + len(held) == self.num_slots, "free + held != num_slots"
        assert self._slot_of == {r: s for s, r in enumerate(self._owners) if r is not None}, \
            "slot_of disagrees with owners (a request holds two slots?)"
