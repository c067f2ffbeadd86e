"""Wrong: ignores the chunk cap (long_prefill_chunk)."""


def chunk(num_uncomputed, tokens_left, chunk_cap, seqs_left=1):
    if seqs_left <= 0:
        return 0
    return max(0, min(num_uncomputed, tokens_left))
