"""The paged-KV bookkeeping: which fixed-size blocks of the pool hold which request's tokens.

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

The manager keeps the tables; the blocks themselves are counted and handed out by two
``BlockPool`` objects (``block_pool``: ref counts, free lists), one on the device, one on the host, and
the full blocks that a later request may reuse are remembered by the ``PrefixCache``
(``prefix_cache``: hash chain, lookup, eviction; ``enable_caching``). The manager joins them: a new
table may start with cached blocks (``computed_blocks`` then ``allocate(..., computed=hits)``), and
the blocks a step filled are offered to the cache (``cache_full_blocks``).

Swap preemption moves a whole table to a second, *host* pool (``num_host_blocks``; CPU memory in
vLLM): ``swap_out`` returns the (device block, host block) copies the engine must make, frees the
device blocks and keeps the table in the host pool; ``swap_in`` reverses it into fresh, private device
blocks. A request's table lives in exactly one pool at a time. A request that shares a block with
another (ref count > 1) cannot be swapped out (``can_swap_out`` is False): the preemption policy
recomputes it instead. Its shared prefix stays resident because the others hold it, so when it is
re-admitted the lookup finds that prefix again and only its private tail is recomputed. Blocks
swapped out with ref count 1 stay cached on the device (they are merely free) until evicted.

**Forks and copy-on-write** (parallel sampling, ``SamplingParams.n > 1``; vLLM V0's ``fork`` and
``blocks_to_copy``). When the prompt of a request with ``n`` children is computed, ``fork(parent,
child)`` gives each child a table naming the *same* blocks (ref count + 1 each): the prompt's K/V is
held once, however many children read it. Full blocks are never written again, so sharing them is
free. The last block is only partly filled when the prompt is not a multiple of ``block_size``, and
every child writes its own next token into it: before a sequence writes into a block that another
table also names, ``copy_on_write`` gives it a private copy (a fresh block; the (src, dst) pair goes
into the plan's ``copy_blocks``, which the runner copies before the forward) and drops its reference
to the shared one. The last holder left writes in place: no copy when nobody else names it::

    block_size 4, prompt of 6 tokens, n = 3      ref counts after the fork: block 0: 3, block 1: 3
    child 0  [0, 1]  ->  writes position 6 into block 1: shared, so copy 1 -> 2:  [0, 2]
    child 1  [0, 1]  ->  block 1 still shared (ref 2): copy 1 -> 3:               [0, 3]
    child 2  [0, 1]  ->  block 1 now has ref 1: child 2 writes into it in place   [0, 1]

``can_allocate(..., start=pos)`` counts that copy as one more block, so a sequence that cannot get it
preempts like any sequence that cannot grow.

**Shared within a step.** A new table may also start with full blocks that another request's row
fills in the *same* step (``ContinuousPolicy`` finds them): they are held (ref count > 0), not yet
cached, and the K/V the newcomer reads from them is written by the same forward before it is read
(see ``continuous``).

Invariants (``check_integrity``): no request has both a device and a host table; each pool's own (free
+ held == total, ref counts == tables naming a block, see ``block_pool``) against the tables in it;
the prefix cache's (``prefix_cache``) against the device tables; a host block is never shared. The
scheduler adds the ones that need token counts: a shared block is never written (it is either full
for every holder, or copied before the write). This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from minicb.core.block_pool import BlockPool
from minicb.core.errors import InvalidArgument, check_int
from minicb.core.prefix_cache import ROOT_HASH, CachedBlock, PrefixCache, hash_block

__all__ = ["ROOT_HASH", "BlockManager", "BlockPool", "CachedBlock", "PrefixCache", "hash_block"]


@dataclass(slots=True)
class BlockManager:
    """The paged-KV bookkeeping: per request a block table (logical block i -> physical block), the
    device and host pools, and the prefix cache; it never touches tensors."""

    num_blocks: int
    block_size: int
    num_host_blocks: int = 0
    enable_caching: bool = False
    device: BlockPool = field(init=False, repr=False)
    host: BlockPool = field(init=False, repr=False)
    cache: PrefixCache | None = field(init=False, repr=False)
    block_tables: dict[str, list[int]] = field(init=False, repr=False)   # device tables
    host_tables: dict[str, list[int]] = field(init=False, repr=False)    # tables of swapped requests
    num_hashed: dict[str, int] = field(init=False, repr=False)   # leading table blocks offered to the cache

    def __post_init__(self) -> None:
        check_int("num_blocks", self.num_blocks, lo=1)
        check_int("block_size", self.block_size, lo=1)
        check_int("num_host_blocks", self.num_host_blocks, lo=0)
        if not isinstance(self.enable_caching, bool):
            raise InvalidArgument(f"enable_caching must be a bool, got {self.enable_caching!r}")
        self.cache = PrefixCache() if self.enable_caching else None
        self.device = BlockPool(self.num_blocks, self.cache)
        self.host = BlockPool(self.num_host_blocks)
        self.block_tables = {}
        self.host_tables = {}
        self.num_hashed = {}

    # --- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.device.num_free

    @property
    def num_free_host_blocks(self) -> int:
        return self.host.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache (held or free)."""
        return len(self.cache.blocks) if self.cache is not None else 0

    @property
    def cached_blocks(self) -> tuple[int, ...]:
        """The blocks in the prefix cache (held or free), in the order they were cached."""
        return tuple(self.cache.blocks) if self.cache is not None else ()

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that cover ``num_tokens`` token positions: ceil(num_tokens / block_size)."""
        check_int("num_tokens", num_tokens, lo=0)
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """The request's device block table (a copy; empty when it holds no device blocks)."""
        return list(self.block_tables.get(request_id, ()))

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.host_tables

    def is_cached(self, block: int) -> bool:
        """Is the device ``block`` in the prefix cache?"""
        return self.cache is not None and self.cache.is_cached(block)

    def num_new_blocks(self, request_id: str, num_tokens: int, computed: Sequence[int] = ()) -> int:
        """Blocks the request's device table must gain to cover ``num_tokens`` positions (a new table
        starting with the ``computed`` cached blocks)."""
        held = len(self.block_tables.get(request_id, ())) + len(computed)
        return max(0, self.blocks_needed(num_tokens) - held)

    def needs_copy(self, request_id: str, start: int) -> bool:
        """Would a write at position ``start`` land in a block that another table names too (a fork's
        partly filled last block)? Then ``copy_on_write`` must give the request its own copy first."""
        table = self.block_tables.get(request_id, ())
        i = start // self.block_size
        return i < len(table) and self.device.ref_counts[table[i]] > 1

    # --- prefix caching ----------------------------------------------------------------------------
    def computed_blocks(self, token_ids: Sequence[int], salt: str | None = None) -> list[int]:
        """The longest chain of cached blocks holding a prefix of ``token_ids`` under the cache ``salt``,
        leaving the last token to compute (module docstring). Changes nothing; [] without caching."""
        return self.cache.computed_blocks(token_ids, self.block_size, salt) if self.cache is not None else []

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                          salt: str | None = None) -> int:
        """Offer the request's full blocks whose K/V is computed (its first ``num_computed_tokens`` of
        ``token_ids``; its cache ``salt``) to the prefix cache, each once; return how many entered it."""
        table = self.block_tables.get(request_id)
        if self.cache is None or table is None:
            return 0
        full = min(num_computed_tokens // self.block_size, len(table))
        start = self.num_hashed.get(request_id, 0)
        added = self.cache.cache_blocks(table, token_ids, start, full, self.block_size, salt)
        self.num_hashed[request_id] = max(start, full)
        return added

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (vLLM's ``reset_prefix_cache``: a benchmark rerunning the same prompts);
        only when no request holds a block (False otherwise, nothing done). True without caching."""
        if self.cache is None:
            return True
        if self.block_tables or self.host_tables:
            return False
        self.device.forget_cached()
        self.cache.clear()
        return True

    # --- device allocation -----------------------------------------------------------------------
    def can_allocate(self, request_id: str, num_tokens: int, computed: Sequence[int] = (),
                     start: int | None = None) -> bool:
        """Can the request's device table grow to cover ``num_tokens`` positions right now? A new
        table may start with ``computed`` blocks (cached ones from ``computed_blocks``, or full ones
        another row of this step fills); cached ones on the free list are taken from it too. With
        ``start`` (where this step's writes begin) a shared block there costs one copy-on-write block."""
        self._check_not_swapped(request_id)
        _check_computed(self, request_id, computed)
        reused = sum(1 for b in computed if self.device.ref_counts[b] == 0)
        copy = start is not None and self.needs_copy(request_id, start)
        return self.num_new_blocks(request_id, num_tokens, computed) + reused + copy <= self.device.num_free

    def append_slots(self, request_id: str, start: int,
                     num_tokens: int) -> tuple[tuple[int, int], ...] | None:
        """Make a running request's table cover the ``num_tokens`` positions it writes from ``start``
        (vLLM's ``append_slots``): a shared block at ``start`` is copied first (``copy_on_write``), then
        the table grows. Returns the copies the runner must make (``()`` or one ``(src, dst)``), or None,
        changing nothing, when the pool lacks the blocks: the caller preempts and asks again.

        ``can_allocate(.., start=start)``, ``copy_on_write`` and ``allocate`` in one call, the one a
        decode step makes for every running request."""
        table = self.block_tables[request_id]
        i = start // self.block_size
        copy = i < len(table) and self.device.ref_counts[table[i]] > 1
        grow = -(-(start + num_tokens) // self.block_size) - len(table)
        if copy + max(grow, 0) == 0:
            return ()                                  # the usual decode: its block has room
        if copy + max(grow, 0) > self.device.num_free:
            return None
        copies = (self.copy_on_write(request_id, start),) if copy else ()
        for _ in range(grow):
            table.append(self.device.take())
        return copies

    def allocate(self, request_id: str, num_tokens: int, computed: Sequence[int] = ()) -> list[int]:
        """Grow the request's table to cover ``num_tokens`` positions; return the new blocks added.

        A new table may start with ``computed``: cached blocks shared with their other holders (ref
        count + 1), not counted in the return value. A table never shrinks: asking for fewer positions
        than it covers adds nothing.
        """
        if not self.can_allocate(request_id, num_tokens, computed):
            raise InvalidArgument(
                f"cannot allocate {self.num_new_blocks(request_id, num_tokens, computed)} blocks for "
                f"request {request_id!r} (num_tokens={num_tokens}): only {self.device.num_free} free")
        table = self.block_tables.setdefault(request_id, [])
        for block in computed:                     # shared first, so that no new block evicts them
            self.device.share(block)
            table.append(block)
        if computed:         # the cached head; blocks another row fills this step are offered again later
            self.num_hashed[request_id] = sum(1 for b in computed if self.is_cached(b))
        new = [self.device.take() for _ in range(self.num_new_blocks(request_id, num_tokens))]
        table.extend(new)
        return new

    def free(self, request_id: str) -> int:
        """Drop every block the request holds, device or host; return how many.

        Freeing a request that holds nothing is a no-op, so abort can call it from any state. Cached
        device blocks stay in the prefix cache (on the LRU list) until a new block is needed.
        """
        self.num_hashed.pop(request_id, None)
        if request_id in self.host_tables:
            return self.host.drop_table(self.host_tables.pop(request_id))
        return self.device.drop_table(self.block_tables.pop(request_id, []))

    # --- forks and copy-on-write -------------------------------------------------------------------
    def fork(self, parent_id: str, child_id: str) -> None:
        """``child_id`` (a new table) names every block of ``parent_id``'s device table: ref count + 1
        each, nothing copied. The child has offered as many blocks to the prefix cache as the parent."""
        if child_id in self.block_tables or child_id in self.host_tables:
            raise InvalidArgument(f"cannot fork into request {child_id!r}: it already holds blocks")
        table = self.block_tables.get(parent_id)
        if table is None:
            raise InvalidArgument(f"cannot fork from request {parent_id!r}: it holds no device blocks")
        for block in table:
            self.device.share(block)
        self.block_tables[child_id] = list(table)
        if parent_id in self.num_hashed:
            self.num_hashed[child_id] = self.num_hashed[parent_id]

    def copy_on_write(self, request_id: str, start: int) -> tuple[int, int] | None:
        """Before the request writes at position ``start``: if that block is shared (``needs_copy``),
        replace it in the request's table by a fresh block and return the (src, dst) copy the runner
        must make before the forward; else None (the block is the request's own, written in place)."""
        if not self.needs_copy(request_id, start):
            return None
        table, i = self.block_tables[request_id], start // self.block_size
        src = table[i]
        assert not self.is_cached(src), f"block {src} is cached, so full: nobody writes into it"
        if not self.device.num_free:
            raise InvalidArgument(f"cannot copy block {src} on write for request {request_id!r}: no free "
                                  "device block (check can_allocate(..., start=...) first)")
        dst = self.device.take()
        self.device.drop(src)                     # still held by the others: stays allocated
        table[i] = dst
        return src, dst

    # --- swapping ----------------------------------------------------------------------------
    def can_swap_out(self, request_id: str) -> bool:
        """Room in the host pool for the request's whole table, none of it shared? (Else: recompute.)"""
        table = self.block_tables.get(request_id)
        return (table is not None and len(table) <= self.host.num_free
                and all(self.device.ref_counts[b] == 1 for b in table))

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request's table to the host pool; return the (device, host) block copies."""
        if not self.can_swap_out(request_id):
            table = self.block_table(request_id)
            shared = sum(self.device.ref_counts[b] > 1 for b in table)
            raise InvalidArgument(f"cannot swap out request {request_id!r}: it holds {len(table)} device "
                                  f"blocks, host has {self.host.num_free} free; {shared} of its blocks are "
                                  "shared (a shared block is never swapped out)")
        self.num_hashed.pop(request_id, None)
        return _move(request_id, self.block_tables, self.device, self.host_tables, self.host)

    def can_swap_in(self, request_id: str, num_tokens: int = 0) -> bool:
        """Can the request's host table come back to the device, grown to cover ``num_tokens``?"""
        table = self.host_tables.get(request_id)
        if table is None:
            return False
        return max(len(table), self.blocks_needed(num_tokens)) <= self.device.num_free

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request's table back to fresh device blocks; return the (host, device) copies.

        The new blocks are private and not cached; ``cache_full_blocks`` offers them again (they
        enter the cache unless their prefix is still cached from before)."""
        if not self.can_swap_in(request_id):
            raise InvalidArgument(f"cannot swap in request {request_id!r}: it holds "
                                  f"{len(self.host_tables.get(request_id, ()))} host blocks, device has "
                                  f"{self.device.num_free} free")
        return _move(request_id, self.host_tables, self.host, self.block_tables, self.device)

    # --- helpers -----------------------------------------------------------------------------
    def _check_not_swapped(self, request_id: str) -> None:
        if request_id in self.host_tables:
            raise InvalidArgument(f"request {request_id!r} is swapped out: swap it in before allocating")

    def check_integrity(self) -> None:
        """Every invariant of the module docstring (``check_block_manager``)."""
        check_block_manager(self)


def _move(request_id: str, src_tables: dict[str, list[int]], src: BlockPool,
          dst_tables: dict[str, list[int]], dst: BlockPool) -> list[tuple[int, int]]:
    # Take every destination block before dropping the sources, so that a copy never lands on a
    # block another copy of the same move still reads from.
    table = src_tables.pop(request_id)
    copies = [(block, dst.take()) for block in table]
    src.drop_table(table)
    dst_tables[request_id] = [d for _, d in copies]
    return copies


def _check_computed(bm: BlockManager, request_id: str, computed: Sequence[int]) -> None:
    if not computed:
        return
    if bm.block_tables.get(request_id):
        raise InvalidArgument(f"computed blocks can only start a new table; request {request_id!r} "
                              "already holds blocks")
    if not all(isinstance(b, int) and 0 <= b < bm.num_blocks
               and (bm.is_cached(b) or bm.device.ref_counts[b] > 0) for b in computed):
        raise InvalidArgument(
            f"computed blocks must be cached or held device blocks, got {list(computed)}")


def check_block_manager(bm: BlockManager) -> None:
    """The block manager's invariants (its module docstring): no request has both a device and a
    host table; each pool's own against the tables in it; a host block is never shared; hashing
    progress within each table; the prefix cache's against the device tables."""
    both = set(bm.block_tables) & set(bm.host_tables)
    assert not both, f"requests with both a device and a host table: {sorted(both)}"
    bm.device.check_integrity(bm.block_tables, "device pool")
    bm.host.check_integrity(bm.host_tables, "host pool")
    assert all(c <= 1 for c in bm.host.ref_counts), "a host block is shared (only private tables swap)"
    assert set(bm.num_hashed) <= set(bm.block_tables), "hashing progress without a table"
    for rid, n in bm.num_hashed.items():
        assert 0 <= n <= len(bm.block_tables[rid]), f"{rid}: {n} blocks hashed of a shorter table"
    if bm.cache is not None:
        bm.cache.check_integrity(bm.block_tables, bm.block_size)
