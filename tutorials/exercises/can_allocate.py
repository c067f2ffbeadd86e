"""Exercise 2: can the block table grow? (``BlockManager.can_allocate``)

The KV cache is a pool of blocks of ``block_size`` token positions. A request
holds a block table: ``num_held`` blocks, covering positions
[0, num_held * block_size). Before a step computes its next tokens, the
scheduler asks: can the table grow to cover ``num_tokens`` positions with the
``num_free`` blocks left in the pool? If not, it must wait or preempt.

Write the function, then check it:

    cp tutorials/exercises/can_allocate.py my_can_allocate.py
    python -m pytest tutorials/exercises/check_can_allocate.py \\
        --solution my_can_allocate.py

minicb's answer: ``minicb.core.block_manager.BlockManager.can_allocate``
(with prefix caching it also counts cached blocks taken off the free list;
this exercise leaves that out).
"""


def can_allocate(num_tokens: int, block_size: int, num_held: int,
                 num_free: int) -> bool:
    """True when ``num_free`` free blocks are enough for a table of
    ``num_held`` blocks to cover ``num_tokens`` positions."""
    raise NotImplementedError("exercise 2: can_allocate")
