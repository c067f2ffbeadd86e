"""Wrong: assumes the table's blocks are consecutive (first block + p)."""


def slot_mapping(rows, block_size):
    out = []
    for start, n, table in rows:
        for p in range(start, start + n):
            out.append(table[0] * block_size + p)
    return out
