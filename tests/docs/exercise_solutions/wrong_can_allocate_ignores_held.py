"""Wrong: asks for the whole table again, forgetting the blocks it holds."""


def can_allocate(num_tokens, block_size, num_held, num_free):
    return -(-num_tokens // block_size) <= num_free
