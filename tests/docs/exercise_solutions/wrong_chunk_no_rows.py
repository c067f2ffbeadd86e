"""Wrong: forgets the row limit (max_num_seqs)."""


def chunk(num_uncomputed, tokens_left, chunk_cap, seqs_left=1):
    return max(0, min(num_uncomputed, chunk_cap, tokens_left))
