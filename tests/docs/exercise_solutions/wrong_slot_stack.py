"""Wrong: reuses the most recently freed slot (a stack), not the lowest."""


class SlotTable:
    def __init__(self, num_slots):
        self.free = list(range(num_slots - 1, -1, -1))
        self.owner = {}

    def assign(self, rid):
        if rid in self.owner.values() or not self.free:
            raise ValueError(rid)
        slot = self.free.pop()
        self.owner[slot] = rid
        return slot

    def release(self, slot):
        rid = self.owner.pop(slot)
        self.free.append(slot)
        return rid
