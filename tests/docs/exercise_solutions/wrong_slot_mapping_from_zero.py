"""Wrong: numbers each row's tokens from 0, forgetting its start position."""


def slot_mapping(rows, block_size):
    out = []
    for _start, n, table in rows:
        for i in range(n):
            out.append(table[i // block_size] * block_size + i % block_size)
    return out
