"""The prefix cache (vLLM's automatic prefix caching): which full, computed device blocks can be reused
by a later request that starts with the same tokens.

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
* **Sharing** (``BlockManager.allocate(..., computed=hits)``): each hit block gets ref count + 1; a
  hit that sat on the free list (ref count 0) leaves it.
* **Caching** (``cache_blocks``, after the step that computed them): a block enters the table when it
  is full *and* its K/V has been computed, never before, so no request can read a block that the same
  step is still writing, and a failed step caches nothing. Blocks filled by generated tokens are
  cached too (as in vLLM): a later turn of the same conversation, or a recompute-preempted request,
  finds them. A block is cached only if its parent is (the chain is unbroken); when the same prefix
  was computed twice at the same time, the first copy is kept and the other stays private.
* **Collisions**: each cached block stores its token ids and its parent block. A lookup accepts a
  block only if both match (the parent is the block it matched one level up), so by induction a hit's
  whole prefix equals the request's, whatever the hash function does; a collision only costs a miss.
* **Salts** (vLLM's ``cache_salt``, ``SamplingParams.cache_salt``): a request's salt starts its chain
  at a root of its own (``root_hash(salt)``) and is stored with its first cached block, which a lookup
  compares like the tokens. Two requests with different salts (tenants) never share a cached block,
  even for equal prompts: nobody can learn from a hit's speed what another tenant's prompt holds.
* **Free and evict**: a freed cached block keeps its hash and goes to the device pool's LRU list of
  reusable free blocks (``block_pool``; the table's tail first, so a request's last blocks are evicted
  before its first ones). The pool hands out blocks that hold nothing reusable first and only then
  evicts the least recently used cached block (``evict``). Because every holder of a block also holds
  its parent, a parent always enters the LRU list after its children: eviction only ever takes leaves
  of the prefix tree, and a cached block's parent is always cached.

Invariants (``check_integrity``): the hash table and the per-block records agree; a cached block is
full and its parent is cached; in every block table the cached blocks form a prefix and each one's
parent is the block before it. This module imports no torch.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

ROOT_HASH = 0x6D696E6963620000     # the "parent hash" of a request's first block


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """A full block's hash, chained from its parent's: Python's hash of a tuple of ints, which (unlike
    that of a str) is the same in every process, so tensor-parallel ranks agree. Collisions are
    harmless: lookups compare token ids and parents (tests monkeypatch this to force them)."""
    return hash((parent_hash, token_ids))


def root_hash(salt: str | None) -> int:
    """The "parent hash" of a request's first block: ``ROOT_HASH``, or one of the salt's own (a
    digest of its text, the same in every process, as ``hash_block``'s are)."""
    if salt is None:
        return ROOT_HASH
    digest = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass(slots=True, frozen=True)
class CachedBlock:
    """What the prefix cache knows about one cached block."""

    block_hash: int
    parent: int | None                 # the block holding the previous block_size tokens (None: first)
    token_ids: tuple[int, ...]         # this block's tokens, compared on lookup (collision guard)
    salt: str | None = None            # a first block's cache salt, compared on lookup like the tokens


@dataclass(slots=True)
class PrefixCache:
    """hash -> block for full, computed blocks, and per cached block its hash, parent and tokens."""

    by_hash: dict[int, int] = field(default_factory=dict)
    blocks: dict[int, CachedBlock] = field(default_factory=dict)
    num_children: Counter = field(default_factory=Counter)   # cached children per cached block

    def is_cached(self, block: int) -> bool:
        return block in self.blocks

    def hash_of(self, block: int | None, salt: str | None = None) -> int:
        return root_hash(salt) if block is None else self.blocks[block].block_hash

    def lookup(self, parent: int | None, token_ids: tuple[int, ...], salt: str | None = None) -> int | None:
        """The cached block that follows ``parent`` (None: at the start, under ``salt``) with
        ``token_ids``, or None."""
        block = self.by_hash.get(hash_block(self.hash_of(parent, salt), token_ids))
        if block is None:
            return None
        rec = self.blocks[block]
        if rec.parent != parent or rec.token_ids != token_ids or (parent is None and rec.salt != salt):
            return None                            # a hash collision: not our prefix
        return block

    def insert(self, block: int, parent: int | None, token_ids: tuple[int, ...],
               salt: str | None = None) -> bool:
        """Cache ``block`` (full and computed) after ``parent`` (None: first, under ``salt``); False if it
        cannot be: already cached, its parent is not cached, or its hash is taken (the same prefix
        cached already, or a collision)."""
        if block in self.blocks or (parent is not None and parent not in self.blocks):
            return False
        h = hash_block(self.hash_of(parent, salt), token_ids)
        if h in self.by_hash:
            return False
        self.by_hash[h] = block
        self.blocks[block] = CachedBlock(h, parent, token_ids, salt if parent is None else None)
        if parent is not None:
            self.num_children[parent] += 1
        return True

    def computed_blocks(self, token_ids: Sequence[int], block_size: int,
                        salt: str | None = None) -> list[int]:
        """The longest chain of cached blocks holding a prefix of ``token_ids`` under ``salt``, leaving
        at least the last token to compute (see the module docstring). Changes nothing."""
        bs, hits, parent = block_size, [], None
        for i in range((len(token_ids) - 1) // bs):
            block = self.lookup(parent, tuple(token_ids[i * bs:(i + 1) * bs]), salt)
            if block is None:
                break
            hits.append(block)
            parent = block
        return hits

    def cache_blocks(self, table: Sequence[int], token_ids: Sequence[int], start: int, stop: int,
                     block_size: int, salt: str | None = None) -> int:
        """Offer ``table[start:stop]``, full blocks of one request holding ``token_ids`` (its cache
        ``salt``), in order; return how many entered the cache."""
        bs, added = block_size, 0
        for i in range(start, stop):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            assert len(tokens) == bs, f"cache_blocks needs the tokens of block {i}"
            added += self.insert(table[i], table[i - 1] if i else None, tokens, salt)
        return added

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

    def check_integrity(self, tables: dict[str, list[int]], block_size: int) -> None:
        """The records agree with the hash table and with the block ``tables`` that name cached blocks."""
        assert len(self.by_hash) == len(self.blocks), "prefix cache: hash table and records disagree"
        children = Counter()
        for block, rec in self.blocks.items():
            assert self.by_hash.get(rec.block_hash) == block, \
                f"prefix cache: block {block} is not under its hash"
            assert len(rec.token_ids) == block_size, f"prefix cache: block {block} is not full"
            assert rec.parent is None or self.is_cached(rec.parent), \
                f"prefix cache: block {block} is cached but its parent {rec.parent} is not"
            if rec.parent is not None:
                children[rec.parent] += 1
        assert +self.num_children == +children, "prefix cache: child counts drift"
        for rid, table in tables.items():
            for i, block in enumerate(table):
                if not self.is_cached(block):
                    assert not any(self.is_cached(b) for b in table[i:]), \
                        f"{rid}: cached blocks do not form a prefix of its table {table}"
                    break
                assert self.blocks[block].parent == (table[i - 1] if i else None), \
                    f"{rid}: cached block {block} at index {i} does not follow its parent"
