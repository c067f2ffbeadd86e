"""The paged KV-cache bookkeeping: which fixed-size blocks of the pool hold which request's tokens.

The KV cache is cut into ``num_blocks`` blocks of ``block_size`` token positions each (PagedAttention).
A request's *block table* lists, in order, the blocks that hold its positions: position ``p`` lives in
block ``table[p // block_size]`` at offset ``p % block_size``. Tables grow one block at a time, exactly
when the last block fills (vLLM's ``append_slots``), so a request never holds more than one partly
filled block::

    block_size = 4                        positions 0..9 of "req-a"
    block table of "req-a": [0, 3, 5]     ┌─ block 0 ─┐┌─ block 3 ─┐┌─ block 5 ─┐
                                          │ 0  1  2  3 ││ 4  5  6  7 ││ 8  9  .  . │
                                          └────────────┘└────────────┘└────────────┘
    device free list (a min-heap): [1, 2, 4, 6, 7]   -> the next block handed out is 1

Allocation takes the lowest-numbered free block, so tests can state exact tables. Every block has a
*ref count*: the number of tables that name it. Today each block belongs to one table (ref count 1);
counts exist so that prefix caching can later share a block between requests (hash chains of full
blocks, and an LRU list of ref-count-0 blocks that still hold reusable K/V). Blocks leave and return
to a pool only through ``BlockPool.take`` / ``BlockPool.drop``, the one place that feature will extend.

Swap preemption moves a whole table to a second, *host* pool (``num_host_blocks``; CPU memory in
vLLM): ``swap_out`` returns the (device block, host block) copies the engine must make, frees the
device blocks and keeps the table in the host pool; ``swap_in`` reverses it. A request's table lives in
exactly one pool at a time.

Invariants (``check_integrity``), for the device pool and the host pool alike:

* free + held == total, and no block is both free and held;
* a block's ref count == the number of tables that name it (0 for a free block).

This module imports no torch.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

from minicb.errors import InvalidArgument, check_int


@dataclass(slots=True)
class BlockPool:
    """One pool of numbered blocks: a lowest-first free list and a ref count per block."""

    num_blocks: int
    ref_counts: list[int] = field(init=False, repr=False)
    _free: list[int] = field(init=False, repr=False)     # min-heap of free block ids

    def __post_init__(self) -> None:
        check_int("num_blocks", self.num_blocks, lo=0)
        self.ref_counts = [0] * self.num_blocks
        self._free = list(range(self.num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_blocks(self) -> list[int]:
        """The free block ids, lowest first (a copy)."""
        return sorted(self._free)

    def take(self) -> int:
        """Hand out the lowest free block with ref count 1."""
        block = heapq.heappop(self._free)
        self.ref_counts[block] = 1
        return block

    def drop(self, block: int) -> None:
        """One table stops naming ``block``; the block is free again when nobody names it."""
        assert self.ref_counts[block] > 0, f"block {block} is already free"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            heapq.heappush(self._free, block)

    def check_integrity(self, tables: dict[str, list[int]], name: str) -> None:
        free = set(self._free)
        named = Counter(b for table in tables.values() for b in table)
        assert len(free) == len(self._free), f"{name}: a block is free twice"
        assert not free & set(named), f"{name}: blocks both free and held: {sorted(free & set(named))}"
        assert len(free) + len(named) == self.num_blocks, f"{name}: free + held != total"
        for block, count in enumerate(self.ref_counts):
            assert count == named.get(block, 0), \
                f"{name}: block {block} has ref count {count} but {named.get(block, 0)} tables name it"


@dataclass(slots=True)
class BlockManager:
    num_blocks: int
    block_size: int
    num_host_blocks: int = 0
    device: BlockPool = field(init=False, repr=False)
    host: BlockPool = field(init=False, repr=False)
    block_tables: dict[str, list[int]] = field(init=False, repr=False)   # device tables
    host_tables: dict[str, list[int]] = field(init=False, repr=False)    # tables of swapped requests

    def __post_init__(self) -> None:
        check_int("num_blocks", self.num_blocks, lo=1)
        check_int("block_size", self.block_size, lo=1)
        check_int("num_host_blocks", self.num_host_blocks, lo=0)
        self.device = BlockPool(self.num_blocks)
        self.host = BlockPool(self.num_host_blocks)
        self.block_tables = {}
        self.host_tables = {}

    # --- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.device.num_free

    @property
    def num_free_host_blocks(self) -> int:
        return self.host.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that cover ``num_tokens`` token positions: ceil(num_tokens / block_size)."""
        check_int("num_tokens", num_tokens, lo=0)
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """The request's device block table (a copy; empty when it holds no device blocks)."""
        return list(self.block_tables.get(request_id, ()))

    def host_block_table(self, request_id: str) -> list[int]:
        """The request's host block table (a copy; empty unless it is swapped out)."""
        return list(self.host_tables.get(request_id, ()))

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.host_tables

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks the request's device table must gain to cover ``num_tokens`` positions."""
        held = len(self.block_tables.get(request_id, ()))
        return max(0, self.blocks_needed(num_tokens) - held)

    # --- device allocation -----------------------------------------------------------------------
    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        """Can the request's device table grow to cover ``num_tokens`` positions right now?"""
        self._check_not_swapped(request_id)
        return self.num_new_blocks(request_id, num_tokens) <= self.device.num_free

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to cover ``num_tokens`` positions; return the blocks added.

        A table never shrinks: asking for fewer positions than it covers adds nothing.
        """
        if not self.can_allocate(request_id, num_tokens):
            raise InvalidArgument(
                f"cannot allocate {self.num_new_blocks(request_id, num_tokens)} blocks for request "
                f"{request_id!r} (num_tokens={num_tokens}): only {self.device.num_free} free")
        new = [self.device.take() for _ in range(self.num_new_blocks(request_id, num_tokens))]
        self.block_tables.setdefault(request_id, []).extend(new)
        return new

    def free(self, request_id: str) -> int:
        """Drop every block the request holds, device or host; return how many.

        Freeing a request that holds nothing is a no-op, so abort can call it from any state.
        """
        if request_id in self.host_tables:
            return self._drop_table(self.host, self.host_tables.pop(request_id))
        return self._drop_table(self.device, self.block_tables.pop(request_id, []))

    # --- swapping ----------------------------------------------------------------------------
    def can_swap_out(self, request_id: str) -> bool:
        """Does the host pool have room for the request's whole device table?"""
        table = self.block_tables.get(request_id)
        return table is not None and len(table) <= self.host.num_free

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request's table to the host pool; return the (device, host) block copies."""
        if not self.can_swap_out(request_id):
            raise InvalidArgument(f"cannot swap out request {request_id!r}: it holds "
                                  f"{len(self.block_table(request_id))} device blocks, host has "
                                  f"{self.host.num_free} free")
        return self._move(request_id, self.block_tables, self.device, self.host_tables, self.host)

    def can_swap_in(self, request_id: str, num_tokens: int = 0) -> bool:
        """Can the request's host table come back to the device, grown to cover ``num_tokens``?"""
        table = self.host_tables.get(request_id)
        if table is None:
            return False
        return max(len(table), self.blocks_needed(num_tokens)) <= self.device.num_free

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request's table back to the device pool; return the (host, device) block copies."""
        if not self.can_swap_in(request_id):
            raise InvalidArgument(f"cannot swap in request {request_id!r}: it holds "
                                  f"{len(self.host_block_table(request_id))} host blocks, device has "
                                  f"{self.device.num_free} free")
        return self._move(request_id, self.host_tables, self.host, self.block_tables, self.device)

    # --- helpers -----------------------------------------------------------------------------
    def _check_not_swapped(self, request_id: str) -> None:
        if request_id in self.host_tables:
            raise InvalidArgument(f"request {request_id!r} is swapped out: swap it in before allocating")

    @staticmethod
    def _drop_table(pool: BlockPool, table: list[int]) -> int:
        for block in table:
            pool.drop(block)
        return len(table)

    @staticmethod
    def _move(request_id: str, src_tables: dict[str, list[int]], src: BlockPool,
              dst_tables: dict[str, list[int]], dst: BlockPool) -> list[tuple[int, int]]:
        # Take every destination block before dropping the sources, so that a copy never lands on a
        # block another copy of the same move still reads from.
        table = src_tables.pop(request_id)
        copies = [(block, dst.take()) for block in table]
        for block in table:
            src.drop(block)
        dst_tables[request_id] = [d for _, d in copies]
        return copies

    def check_integrity(self) -> None:
        both = set(self.block_tables) & set(self.host_tables)
        assert not both, f"requests with both a device and a host table: {sorted(both)}"
        self.device.check_integrity(self.block_tables, "device pool")
        self.host.check_integrity(self.host_tables, "host pool")
