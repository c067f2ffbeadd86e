"""Wrong: lowest free slot, but a full table hands out slot 0 again."""


class SlotTable:
    def __init__(self, num_slots):
        self.owner = [None] * num_slots

    def assign(self, rid):
        if rid in self.owner:
            raise ValueError(rid)
        free = [i for i, r in enumerate(self.owner) if r is None]
        slot = free[0] if free else 0
        self.owner[slot] = rid
        return slot

    def release(self, slot):
        rid, self.owner[slot] = self.owner[slot], None
        if rid is None:
            raise ValueError(slot)
        return rid
