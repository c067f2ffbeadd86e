"""The paged KV-cache bookkeeping: which fixed-size blocks of the pool hold which request's tokens,
and (prefix caching) which full blocks can be reused by a later request with the same prefix.

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
*ref count*: the number of tables that name it. Blocks leave and return to a pool only through
``BlockPool.take`` / ``share`` / ``drop``.

Prefix caching (``enable_caching``; vLLM's automatic prefix caching)
--------------------------------------------------------------------
The K/V of a token depends on the token and everything before it, so a *full* block can be reused by
any request whose first tokens, up to the end of that block, are the same. Each full, computed block
gets a hash chained from its parent block's hash and its own token ids, and a table maps hashes to
blocks::

    prompt A:  [sys sys sys sys][sys sys usr1 usr1][usr1 ..            block_size = 4
    hashes:     h0 = H(ROOT, b0)  h1 = H(h0, b1)       (not full: no hash)
    prompt B:  [sys sys sys sys][sys sys usr2 usr2][...
                h0: hit            H(h0, b1') misses   -> B shares block h0, computes the rest

* **Lookup** (``computed_blocks``, at admission): walk the request's full blocks from the first and
  take the longest chain of cached ones. A hit never covers the whole request: at most
  ``(num_tokens - 1) // block_size`` blocks, so the last token is always computed and there are
  logits to sample from. A prompt of exactly ``k`` blocks, all cached, reuses ``k - 1`` and recomputes
  the last block into a new block of its own (never writing into a shared block).
* **Sharing** (``allocate(..., computed=hits)``): each hit block gets ref count + 1; a hit that sat on
  the free list (ref count 0) leaves it.
* **Caching** (``cache_full_blocks``, after the step that computed them): a block enters the table
  when it is full *and* its K/V has been computed, never before, so no request can read a block that
  the same step is still writing, and a failed step caches nothing. Blocks filled by generated tokens
  are cached too (as in vLLM): a later turn of the same conversation, or a recompute-preempted
  request, finds them. A block is cached only if its parent is (the chain is unbroken); when the same
  prefix was computed twice at the same time, the first copy is kept and the other stays private.
* **Collisions**: each cached block stores its token ids and its parent block. A lookup accepts a
  block only if both match (the parent is the block it matched one level up), so by induction a hit's
  whole prefix equals the request's, whatever the hash function does; a collision only costs a miss.
* **Free and evict**: a freed block keeps its hash and goes to an LRU list of reusable free blocks
  (the table's tail first, so a request's last blocks are evicted before its first ones). ``take``
  prefers blocks that hold nothing reusable (lowest first) and only then evicts the least recently
  used cached block, dropping its hash. Because every holder of a block also holds its parent, a
  parent always enters the LRU list after its children: eviction only ever takes leaves of the
  prefix tree, and a cached block's parent is always cached.

Swap preemption moves a whole table to a second, *host* pool (``num_host_blocks``; CPU memory in
vLLM): ``swap_out`` returns the (device block, host block) copies the engine must make, frees the
device blocks and keeps the table in the host pool; ``swap_in`` reverses it into fresh, private device
blocks. A request's table lives in exactly one pool at a time. A request that shares a block with
another (ref count > 1) cannot be swapped out (``can_swap_out`` is False): the preemption policy
recomputes it instead. Its shared prefix stays resident because the others hold it, so when it is
re-admitted the lookup finds that prefix again and only its private tail is recomputed. Blocks
swapped out with ref count 1 stay cached on the device (they are merely free) until evicted.

Invariants (``check_integrity``), for the device pool and the host pool alike:

* free + held == total, and no block is both free and held (a block with ref count > 0 is never on a
  free list);
* a block's ref count == the number of tables that name it (0 for a free block);
* prefix cache: the table and the per-block records agree; a cached block is full and its parent is
  cached; in every block table the cached blocks form a prefix and each one's parent is the block
  before it; the LRU list holds exactly the free cached blocks, children before their parents.

This module imports no torch.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from minicb.core.errors import InvalidArgument, check_int
from minicb.core.memory import available_cpu_bytes, check_fits

ROOT_HASH = 0x6D696E6963620000     # the "parent hash" of a request's first block


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """A full block's hash, chained from its parent's: Python's hash of a tuple of ints, which (unlike
    that of a str) is the same in every process, so tensor-parallel ranks agree. Collisions are
    harmless: lookups compare token ids and parents (tests monkeypatch this to force them)."""
    return hash((parent_hash, token_ids))


@dataclass(slots=True, frozen=True)
class CachedBlock:
    """What the prefix cache knows about one cached block."""

    block_hash: int
    parent: int | None                 # the block holding the previous block_size tokens (None: first)
    token_ids: tuple[int, ...]         # this block's tokens, compared on lookup (collision guard)


@dataclass(slots=True)
class PrefixCache:
    """hash -> block for full, computed blocks, and per cached block its hash, parent and tokens."""

    by_hash: dict[int, int] = field(default_factory=dict)
    blocks: dict[int, CachedBlock] = field(default_factory=dict)
    num_children: Counter = field(default_factory=Counter)   # cached children per cached block

    def is_cached(self, block: int) -> bool:
        return block in self.blocks

    def hash_of(self, block: int | None) -> int:
        return ROOT_HASH if block is None else self.blocks[block].block_hash

    def lookup(self, parent: int | None, token_ids: tuple[int, ...]) -> int | None:
        """The cached block that follows ``parent`` (None: at the start) with ``token_ids``, or None."""
        block = self.by_hash.get(hash_block(self.hash_of(parent), token_ids))
        if block is None:
            return None
        rec = self.blocks[block]
        if rec.parent != parent or rec.token_ids != token_ids:
            return None                            # a hash collision: not our prefix
        return block

    def insert(self, block: int, parent: int | None, token_ids: tuple[int, ...]) -> bool:
        """Cache ``block`` (full and computed) after ``parent``; False if it cannot be: already cached,
        its parent is not cached, or its hash is taken (the same prefix cached already, or a collision)."""
        if block in self.blocks or (parent is not None and parent not in self.blocks):
            return False
        h = hash_block(self.hash_of(parent), token_ids)
        if h in self.by_hash:
            return False
        self.by_hash[h] = block
        self.blocks[block] = CachedBlock(h, parent, token_ids)
        if parent is not None:
            self.num_children[parent] += 1
        return True

    def clear(self) -> None:
        """Forget every cached block."""
        self.by_hash.clear()
        self.blocks.clear()
        self.num_children.clear()

    def evict(self, block: int) -> None:
        """Forget ``block``'s hash (it is about to be reused for other tokens)."""
        assert not self.num_children[block], f"block {block} is evicted before its cached children"
        rec = self.blocks.pop(block)
        del self.by_hash[rec.block_hash]
        self.num_children.pop(block, None)
        if rec.parent is not None:
            self.num_children[rec.parent] -= 1


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
    _num_hashed: dict[str, int] = field(init=False, repr=False)  # leading table blocks offered to the cache

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
        self._num_hashed = {}

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

    def is_cached(self, block: int) -> bool:
        """Is the device ``block`` in the prefix cache?"""
        return self.cache is not None and self.cache.is_cached(block)

    def num_hashed_blocks(self, request_id: str) -> int:
        """Leading blocks of the request's table already offered to the prefix cache."""
        return self._num_hashed.get(request_id, 0)

    def num_new_blocks(self, request_id: str, num_tokens: int, computed: Sequence[int] = ()) -> int:
        """Blocks the request's device table must gain to cover ``num_tokens`` positions (a new table
        starting with the ``computed`` cached blocks)."""
        held = len(self.block_tables.get(request_id, ())) + len(computed)
        return max(0, self.blocks_needed(num_tokens) - held)

    # --- prefix caching ----------------------------------------------------------------------------
    def computed_blocks(self, token_ids: Sequence[int]) -> list[int]:
        """The longest chain of cached blocks holding a prefix of ``token_ids``, leaving at least the
        last token to compute (see the module docstring). Changes nothing; [] without caching."""
        if self.cache is None:
            return []
        bs, hits, parent = self.block_size, [], None
        for i in range((len(token_ids) - 1) // bs):
            block = self.cache.lookup(parent, tuple(token_ids[i * bs:(i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
            parent = block
        return hits

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> int:
        """Offer the request's full blocks whose K/V is computed (its first ``num_computed_tokens``
        positions, ``token_ids`` being at least those tokens) to the prefix cache; return how many
        entered it. Each block is offered once; a no-op without caching."""
        table = self.block_tables.get(request_id)
        if self.cache is None or table is None:
            return 0
        bs = self.block_size
        full = min(num_computed_tokens // bs, len(table))
        start = self._num_hashed.get(request_id, 0)
        added = 0
        for i in range(start, full):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            assert len(tokens) == bs, f"cache_full_blocks needs the tokens of block {i}"
            added += self.cache.insert(table[i], table[i - 1] if i else None, tokens)
        self._num_hashed[request_id] = max(start, full)
        return added

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (vLLM's ``reset_prefix_cache``), so that the next request computes its
        whole prompt again: what a benchmark wants before it reruns the same prompts. Only possible when
        no request holds a block (a held cached block is part of a live request's K/V); returns whether
        it was done. A no-op returning True without caching."""
        if self.cache is None:
            return True
        if self.block_tables or self.host_tables:
            return False
        self.device.forget_cached()
        self.cache.clear()
        return True

    # --- device allocation -----------------------------------------------------------------------
    def can_allocate(self, request_id: str, num_tokens: int, computed: Sequence[int] = ()) -> bool:
        """Can the request's device table grow to cover ``num_tokens`` positions right now? A new
        table may start with ``computed`` cached blocks (``computed_blocks``); those on the free list
        are taken from it too."""
        self._check_not_swapped(request_id)
        self._check_computed(request_id, computed)
        reused = sum(1 for b in computed if self.device.ref_counts[b] == 0)
        return self.num_new_blocks(request_id, num_tokens, computed) + reused <= self.device.num_free

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
        if computed:
            self._num_hashed[request_id] = len(computed)
        new = [self.device.take() for _ in range(self.num_new_blocks(request_id, num_tokens))]
        table.extend(new)
        return new

    def free(self, request_id: str) -> int:
        """Drop every block the request holds, device or host; return how many.

        Freeing a request that holds nothing is a no-op, so abort can call it from any state. Cached
        device blocks stay in the prefix cache (on the LRU list) until a new block is needed.
        """
        self._num_hashed.pop(request_id, None)
        if request_id in self.host_tables:
            return self.host.drop_table(self.host_tables.pop(request_id))
        return self.device.drop_table(self.block_tables.pop(request_id, []))

    # --- swapping ----------------------------------------------------------------------------
    def can_swap_out(self, request_id: str) -> bool:
        """Does the host pool have room for the request's whole device table, none of whose blocks is
        shared with another request? (A request holding shared blocks is recomputed instead.)"""
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
        self._num_hashed.pop(request_id, None)
        return self._move(request_id, self.block_tables, self.device, self.host_tables, self.host)

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
                                  f"{len(self.host_block_table(request_id))} host blocks, device has "
                                  f"{self.device.num_free} free")
        return self._move(request_id, self.host_tables, self.host, self.block_tables, self.device)

    # --- helpers -----------------------------------------------------------------------------
    def _check_not_swapped(self, request_id: str) -> None:
        if request_id in self.host_tables:
            raise InvalidArgument(f"request {request_id!r} is swapped out: swap it in before allocating")

    def _check_computed(self, request_id: str, computed: Sequence[int]) -> None:
        if not computed:
            return
        if self.block_tables.get(request_id):
            raise InvalidArgument(f"computed blocks can only start a new table; request {request_id!r} "
                                  "already holds blocks")
        if not all(isinstance(b, int) and self.is_cached(b) for b in computed):
            raise InvalidArgument(f"computed blocks must be cached device blocks, got {list(computed)}")

    @staticmethod
    def _move(request_id: str, src_tables: dict[str, list[int]], src: BlockPool,
              dst_tables: dict[str, list[int]], dst: BlockPool) -> list[tuple[int, int]]:
        # Take every destination block before dropping the sources, so that a copy never lands on a
        # block another copy of the same move still reads from.
        table = src_tables.pop(request_id)
        copies = [(block, dst.take()) for block in table]
        src.drop_table(table)
        dst_tables[request_id] = [d for _, d in copies]
        return copies

    def check_integrity(self) -> None:
        both = set(self.block_tables) & set(self.host_tables)
        assert not both, f"requests with both a device and a host table: {sorted(both)}"
        self.device.check_integrity(self.block_tables, "device pool")
        self.host.check_integrity(self.host_tables, "host pool")
        assert set(self._num_hashed) <= set(self.block_tables), "hashing progress without a table"
        for rid, n in self._num_hashed.items():
            assert 0 <= n <= len(self.block_tables[rid]), f"{rid}: {n} blocks hashed of a shorter table"
        if self.cache is not None:
            self._check_cache()

    def _check_cache(self) -> None:
        cache, bs = self.cache, self.block_size
        assert len(cache.by_hash) == len(cache.blocks), "prefix cache: hash table and records disagree"
        children = Counter()
        for block, rec in cache.blocks.items():
            assert cache.by_hash.get(rec.block_hash) == block, \
                f"prefix cache: block {block} is not under its hash"
            assert len(rec.token_ids) == bs, f"prefix cache: block {block} is not full"
            assert rec.parent is None or cache.is_cached(rec.parent), \
                f"prefix cache: block {block} is cached but its parent {rec.parent} is not"
            if rec.parent is not None:
                children[rec.parent] += 1
        assert +cache.num_children == +children, "prefix cache: child counts drift"
        for rid, table in self.block_tables.items():
            for i, block in enumerate(table):
                if not cache.is_cached(block):
                    assert not any(cache.is_cached(b) for b in table[i:]), \
                        f"{rid}: cached blocks do not form a prefix of its table {table}"
                    break
                assert cache.blocks[block].parent == (table[i - 1] if i else None), \
                    f"{rid}: cached block {block} at index {i} does not follow its parent"
