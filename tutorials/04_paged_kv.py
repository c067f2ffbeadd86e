"""Chapter 04: paged KV and the block manager.

Run: python tutorials/04_paged_kv.py
Prerequisites: chapters 02 (slot_mapping) and 03.

Every token a request has seen keeps its key and value vectors in the KV cache.
A padded engine reserves a contiguous [max_len] stretch per row up front;
PagedAttention (vLLM) cuts the cache into fixed-size blocks and gives each
request a *block table*, grown one block at a time as it decodes.
``minicb.core.block_manager.BlockManager`` keeps those tables, the free list and
the ref counts.
"""

# %% [markdown]
# A pool of 8 blocks of 4 token positions each (`--block-size` changes the 4;
# the pool keeps 32 positions). Position `p` of a request lives in block
# `table[p // 4]` at offset `p % 4`; the flat KV "slot" the model writes is
# `table[p // 4] * 4 + p % 4`: chapter 02's `slot_mapping`. The block manager is
# plain Python: we drive it by hand.

# %%
from _common import Exercise, flags

from minicb.core.block_manager import BlockManager

args = flags(__doc__, block_size=(4, "token positions per block"),
             page=(16, "block size of section 4's comparison"))
BLOCK_SIZE = args.block_size
NUM_BLOCKS = 32 // BLOCK_SIZE       # a pool of 32 token positions
bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)


def picture(bm: BlockManager) -> None:
    """The pool, block by block: which request holds it ('.' = free)."""
    owner = {b: rid for rid, table in bm.block_tables.items() for b in table}
    print("  pool   " + " ".join(f"{b}:{owner.get(b, '.')}"
                                 for b in range(bm.num_blocks)))
    for rid, table in bm.block_tables.items():
        print(f"  table  {rid}: {table}")
    print(f"  free list: {bm.device.free_blocks()}   "
          f"({bm.num_free_blocks} of {bm.num_blocks} free)")


# %% [markdown]
# ## 1. Admit A (a 10-token prompt) and B (a 5-token prompt)
#
# `allocate(request, num_tokens)` grows the request's table to cover that many
# positions and returns the blocks it added, lowest free block first.

# %%
print(f"allocate('A', 10) -> new blocks {bm.allocate('A', 10)}")
print(f"allocate('B', 5)  -> new blocks {bm.allocate('B', 5)}")
picture(bm)

# %% [markdown]
# ## 2. A decodes: a new block only when the last one is full

# %%
for n in (11, 12, 13):
    print(f"allocate('A', {n}) -> new blocks {bm.allocate('A', n)}")
picture(bm)
table = bm.block_table("A")
print(f"A holds {len(table)} blocks for 13 tokens: at most one partly filled")

# %% [markdown]
# The table maps A's *logical* blocks (positions 0-3, 4-7, ...) to *physical*
# blocks of the pool, wherever they happen to be free. The kernel never needs
# A's positions to be contiguous in memory: it follows the table.

# %%
print("logical block -> physical block: positions -> KV slots")
for i, block in enumerate(table):
    first, last = i * BLOCK_SIZE, min(13, (i + 1) * BLOCK_SIZE) - 1
    slots = [block * BLOCK_SIZE + p % BLOCK_SIZE
             for p in range(first, last + 1)]
    print(f"  {i} -> {block}: positions {first:2d}..{last:2d} -> slots {slots}")
mapping = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
           for p in range(13)]
print(f"A's slot_mapping for positions 0..12: {mapping}")

# %% [markdown]
# ## 3. B finishes: its blocks return at once
#
# C (7 tokens) takes the lowest free blocks, which B just gave back. D (16
# tokens) does not fit: the scheduler's admission would stop there.

# %%
print(f"free('B') -> {bm.free('B')} blocks returned")
print(f"  free list: {bm.device.free_blocks()}")
print(f"can_allocate('C', 7) = {bm.can_allocate('C', 7)}")
print(f"allocate('C', 7)  -> new blocks {bm.allocate('C', 7)}")
picture(bm)
need = bm.blocks_needed(16)
print(f"can_allocate('D', 16) = {bm.can_allocate('D', 16)}   "
      f"(needs {need} blocks, {bm.num_free_blocks} free)")
bm.check_integrity()
print("check_integrity(): free + held == total, and each block's ref count")
print("equals the number of tables naming it: OK")

# %% [markdown]
# ## 4. Why pages: reserving up front versus growing on demand
#
# A padded static cache reserves prompt + `max_tokens` positions per request
# before the first step, because it cannot grow a row later. Three requests with
# 8-token prompts and `max_tokens=120` that end after 10, 30 and 120 tokens:

# %%
PAGE = args.page
lens = [8 + 10, 8 + 30, 8 + 120]
reserved = 3 * (8 + 120)
paged = sum(BlockManager(64, PAGE).blocks_needed(n) * PAGE for n in lens)
print(f"reserved up front (contiguous rows): {reserved} token positions")
print(f"paged, block_size {PAGE}, at each request's end: {paged} positions "
      f"({100 * (1 - paged / reserved):.0f}% less)")

# %% [markdown]
# The blocks a request does not need yet stay free for others, so more requests
# fit at once. The price: a request may need a block that is not there. Chapter
# 07 (preemption) is what the scheduler does then.

# %%
EXERCISES = [
    Exercise(
        "--block-size 2",
        "With blocks of 2 positions, how many blocks does A hold for its 13 "
        "tokens, and into which KV slot does its position 12 go?",
        r"^(A holds|A's slot_mapping)",
        "Smaller blocks: more of them, and less room left unused in the last "
        "one (at most block_size - 1 positions per request). Position 12 goes "
        "to the first slot of A's last block."),
    Exercise(
        "--page 64",
        "With pages of 64 positions, how much does paging save over reserving "
        "up front?",
        r"^paged, block_size",
        "Less: a request's last page is on average half empty, so large pages "
        "give back part of what paging wins. vLLM uses 16."),
]
