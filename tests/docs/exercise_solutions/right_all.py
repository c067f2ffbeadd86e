"""Right answers to all six exercises, written apart from minicb's code: the
checkers must pass a learner's file that is right, not only minicb itself."""


class SlotTable:
    def __init__(self, num_slots):
        self.owner = [None] * num_slots

    def assign(self, rid):
        if rid in self.owner or None not in self.owner:
            raise ValueError(f"cannot assign {rid!r}")
        slot = self.owner.index(None)
        self.owner[slot] = rid
        return slot

    def release(self, slot):
        if self.owner[slot] is None:
            raise ValueError(f"slot {slot} is free")
        rid, self.owner[slot] = self.owner[slot], None
        return rid


def can_allocate(num_tokens, block_size, num_held, num_free):
    needed = (num_tokens + block_size - 1) // block_size
    return max(0, needed - num_held) <= num_free


def chunk(num_uncomputed, tokens_left, chunk_cap, seqs_left=1):
    if seqs_left <= 0 or tokens_left <= 0:
        return 0
    return min(num_uncomputed, chunk_cap, tokens_left)


def choose_victim(running, policy="fcfs"):
    if policy == "priority":
        key = lambda r: (r["priority"], r["arrival"])  # noqa: E731
    else:
        key = lambda r: (r["admitted"], r["arrival"])  # noqa: E731
    return max(running, key=key)["id"]


def slot_mapping(rows, block_size):
    return [table[p // block_size] * block_size + p % block_size
            for start, n, table in rows for p in range(start, start + n)]


def causal_mask(num_queries, num_keys):
    start = num_keys - num_queries
    return [[j <= start + i for j in range(num_keys)]
            for i in range(num_queries)]
