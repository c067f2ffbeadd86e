"""A pool of numbered KV blocks: who may have which block, counted, and which block to hand out next.

The KV cache is cut into ``num_blocks`` blocks of ``block_size`` token positions each (PagedAttention);
this module knows only their numbers. Every block has a *ref count*: the number of block tables that
name it (0: free). Blocks leave and return to a pool only through ``take`` / ``share`` / ``drop``::

    ref_counts  [1, 0, 0, 2, 0, 1, 0, 0]      block 3 is shared by two tables (a prefix-cache hit)
    free heap   [1, 2, 6, 7]                  free, nothing reusable in them: the lowest is taken first
    LRU list    [4]                           free, still in the prefix cache: taken (evicted) last

``take`` hands out the lowest-numbered block of the free heap (so tests can state exact tables) and,
only when that is empty, evicts the least recently freed cached block (``prefix_cache``). ``drop``
puts a block whose ref count reaches 0 on the LRU list if the prefix cache still knows it, else on
the heap. The device pool has a prefix cache (when caching is on); the host pool, which holds swapped
out tables, has none.

Invariants (``check_integrity``): free + held == total, and no block is both free and held (a block
with ref count > 0 is never on a free list); a block's ref count == the number of tables that name it;
the LRU list holds exactly the free cached blocks, children before their parents. This module imports
no torch.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from minicb.core.errors import check_int
from minicb.core.memory import available_cpu_bytes, check_fits
from minicb.core.prefix_cache import PrefixCache


@dataclass(slots=True)
class BlockPool:
    """One pool of numbered blocks: ref counts and two free lists.

    ``_free`` (a min-heap) holds free blocks with nothing reusable in them; ``_lru`` holds free blocks
    that are still in the prefix cache, least recently freed first. ``take`` empties ``_free`` first.
    """

    num_blocks: int
    cache: PrefixCache | None = None
    ref_counts: list[int] = field(init=False, repr=False)
    _free: list[int] = field(init=False, repr=False)
    _lru: OrderedDict[int, None] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_int("num_blocks", self.num_blocks, lo=0)
        # two Python lists of num_blocks entries: refuse a size the machine cannot hold (minicb.core.memory)
        check_fits(f"num_blocks={self.num_blocks:,} (the block tables, ~64 bytes a block)",
                   64 * self.num_blocks, available_cpu_bytes(), "in host memory", "lower num_blocks")
        self.ref_counts = [0] * self.num_blocks
        self._free = list(range(self.num_blocks))
        self._lru = OrderedDict()

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._lru)

    def free_blocks(self) -> list[int]:
        """Every free block id, lowest first (a copy), cached or not."""
        return sorted(self._free + list(self._lru))

    def cached_free_blocks(self) -> list[int]:
        """The free blocks still in the prefix cache, in eviction order (least recently used first)."""
        return list(self._lru)

    def take(self) -> int:
        """Hand out a free block with ref count 1: the lowest one holding nothing reusable, else the
        least recently used cached one, which is evicted from the cache."""
        if self._free:
            block = heapq.heappop(self._free)
        else:
            block, _ = self._lru.popitem(last=False)
            self.cache.evict(block)
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more table names the cached ``block`` (a prefix-cache hit)."""
        if self.ref_counts[block] == 0:
            del self._lru[block]
        self.ref_counts[block] += 1

    def drop(self, block: int) -> None:
        """One table stops naming ``block``; the block is free again when nobody names it."""
        assert self.ref_counts[block] > 0, f"block {block} is already free"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.cache is not None and self.cache.is_cached(block):
                self._lru[block] = None            # most recently used: evicted last
            else:
                heapq.heappush(self._free, block)

    def drop_table(self, table: list[int]) -> int:
        """Drop every block of ``table``, last first (so its tail is evicted before its head)."""
        for block in reversed(table):
            self.drop(block)
        return len(table)

    def forget_cached(self) -> int:
        """Move every cached free block to the plain free heap (the caller clears the cache itself);
        return how many moved."""
        moved = list(self._lru)
        self._lru.clear()
        for block in moved:
            heapq.heappush(self._free, block)
        return len(moved)

    def check_integrity(self, tables: dict[str, list[int]], name: str) -> None:
        free = set(self._free) | set(self._lru)
        named = Counter(b for table in tables.values() for b in table)
        assert len(free) == len(self._free) + len(self._lru), f"{name}: a block is free twice"
        assert not free & set(named), f"{name}: blocks both free and held: {sorted(free & set(named))}"
        assert len(free) + len(named) == self.num_blocks, f"{name}: free + held != total"
        for block, count in enumerate(self.ref_counts):
            assert count == named.get(block, 0), \
                f"{name}: block {block} has ref count {count} but {named.get(block, 0)} tables name it"
        if self.cache is None:
            assert not self._lru, f"{name}: cached free blocks without a prefix cache"
            return
        cached = self.cache.is_cached
        assert all(cached(b) for b in self._lru), f"{name}: an uncached block on the LRU list"
        assert not any(cached(b) for b in self._free), f"{name}: a cached block on the free heap"
        order = {b: i for i, b in enumerate(self._lru)}
        for b in self._lru:
            parent = self.cache.blocks[b].parent
            assert parent not in order or order[parent] > order[b], \
                f"{name}: block {b} would be evicted after its parent {parent}"
