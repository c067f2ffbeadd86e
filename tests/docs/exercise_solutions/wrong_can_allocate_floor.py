"""Wrong: floor division, so a partly filled last block is not counted."""


def can_allocate(num_tokens, block_size, num_held, num_free):
    return num_tokens // block_size - num_held <= num_free
