"""Exercise 8 (the build-it track): block tables with shared, cached blocks.

A request's K/V lives in fixed-size blocks; its *block table* lists them in
order (position ``p`` is in block ``table[p // block_size]``). You write the
bookkeeping of the tables on top of two real pieces of minicb:

* ``self.pool`` (``minicb.core.block_pool.BlockPool``): the numbered blocks
  and their ref counts, changed ONLY by ``take()`` (a free block, ref count
  1), ``share(block)`` (one more table names a block) and ``drop(block)``
  (one table fewer; free again at 0); ``num_free``, ``ref_counts``;
* ``self.cache`` (``minicb.core.prefix_cache.PrefixCache``): full, computed
  blocks by content: ``lookup(parent, tokens)`` finds the cached block that
  holds ``tokens`` right after block ``parent`` (None: at the start), and
  ``insert(block, parent, tokens)`` caches one (False if it cannot).

The rules (vLLM's paged attention with automatic prefix caching, chapters
04 and 10):

* A table grows only by the blocks it lacks, and only as a whole: if the
  pool cannot give them all, raise ``ValueError`` and change nothing.
* A new table may start with *hits*: cached blocks that hold the request's
  first tokens. Every table that names a block holds one reference to it.
  A hit may sit free (nobody names it, its content still cached): taking it
  costs a free block like a new one would.
* A hit is never the whole request: its last token is always computed (the
  model needs its logits).
* ``free`` drops every block of the table, its last block first.
* A block enters the cache only once it is full and its K/V is computed, and
  only after its parent (the block before it in the table) did.

The checker runs your class against minicb's ``BlockManager`` on the same
calls and checks the pool's and the cache's invariants after each.

    cp tutorials/exercises/block_tables.py my_tables.py
    python -m pytest tutorials/exercises/check_block_tables.py \\
        --solution my_tables.py

minicb's answer: ``minicb.core.block_manager`` (``allocate``, ``free``,
``can_allocate``, ``computed_blocks``, ``cache_full_blocks``).
"""

from minicb.core.block_pool import BlockPool
from minicb.core.prefix_cache import PrefixCache


class BlockTables:
    """Request id -> block table, over one pool with a prefix cache."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.cache = PrefixCache()
        self.pool = BlockPool(num_blocks, self.cache)
        self.tables: dict[str, list[int]] = {}

    def hits(self, token_ids: list[int]) -> list[int]:
        """The cached blocks a new request with ``token_ids`` can start with
        (the longest chain from its first block). Changes nothing."""
        raise NotImplementedError("exercise 8: BlockTables.hits")

    def can_allocate(self, request_id: str, num_tokens: int,
                     hits: list[int] = ()) -> bool:
        """Could ``allocate(request_id, num_tokens, hits)`` succeed now?"""
        raise NotImplementedError("exercise 8: BlockTables.can_allocate")

    def allocate(self, request_id: str, num_tokens: int,
                 hits: list[int] = ()) -> list[int]:
        """Grow the request's table to cover ``num_tokens`` positions (a new
        table starts with ``hits``); return the blocks taken from the pool
        (the hits are not among them)."""
        raise NotImplementedError("exercise 8: BlockTables.allocate")

    def free(self, request_id: str) -> int:
        """Drop the request's table; return how many blocks it named (0 when
        it holds none)."""
        raise NotImplementedError("exercise 8: BlockTables.free")

    def cache_full(self, request_id: str, token_ids: list[int],
                   num_computed: int) -> int:
        """Offer the request's full blocks among its first ``num_computed``
        positions (holding ``token_ids``) to the cache; return how many
        entered it."""
        raise NotImplementedError("exercise 8: BlockTables.cache_full")
