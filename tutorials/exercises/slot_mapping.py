"""Exercise 5: the packer's ``slot_mapping``.

A step packs every scheduled row's new tokens end to end. For each new token
the model must know WHERE in the paged KV cache to write its K and V: its KV
slot, a flat index into the pool of blocks (``block_size`` slots a block, the
pool's blocks one after the other). A row that starts at position ``start``
with ``n`` new tokens writes positions ``start .. start + n - 1``; its block
table ``table`` names, in order, the blocks that hold its positions 0, 1, ...

``rows`` is a list of ``(start, n, table)`` per row, in packing order; return
one KV slot per new token, the rows one after the other.

Write the function, then check it:

    cp tutorials/exercises/slot_mapping.py my_slot_mapping.py
    python -m pytest tutorials/exercises/check_slot_mapping.py \\
        --solution my_slot_mapping.py

minicb's answer: ``minicb.runtime.packer.pack`` (``attn.slot_mapping``).
"""


def slot_mapping(rows: list[tuple[int, int, list[int]]],
                 block_size: int) -> list[int]:
    """The KV slot of every new token of ``rows``, packed end to end."""
    raise NotImplementedError("exercise 5: slot_mapping")
