"""Exercise 6: the bottom-right causal mask (chunked prefill, decodes).

A row of a step has ``num_queries`` new tokens and attends to ``num_keys``
keys: the cached ones first, then its own new ones (so
``num_keys = start + num_queries``). Query i is the token at position
``start + i``; it may see every key at a position <= its own. The mask is
aligned to the BOTTOM-RIGHT corner: the last query sees every key. A prompt
from position 0 (``num_queries == num_keys``) gives the familiar lower
triangle; a decode (one query) sees everything; a later chunk sees the whole
cached prefix plus a triangle of its own.

Return ``mask[i][j]``: True when query i may attend to key j.

Write the function, then check it:

    cp tutorials/exercises/causal_mask.py my_causal_mask.py
    python -m pytest tutorials/exercises/check_causal_mask.py \\
        --solution my_causal_mask.py

minicb's answer: ``minicb.model.attention.ReferenceAttention`` (the checker
measures its mask by running it on one-hot values).
"""


def causal_mask(num_queries: int, num_keys: int) -> list[list[bool]]:
    """``[num_queries][num_keys]`` booleans: may query i see key j?"""
    raise NotImplementedError("exercise 6: causal_mask")
