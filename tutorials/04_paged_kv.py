"""Chapter 04: paged KV and the block manager.

Run: python tutorials/04_paged_kv.py

Every token a request has seen keeps its key and value vectors in the KV cache. A padded engine
reserves a contiguous [max_len] stretch per row up front; PagedAttention (vLLM) cuts the cache into
fixed-size blocks and gives each request a *block table*, grown one block at a time as it decodes.
``minicb.block_manager.BlockManager`` keeps those tables, the free list and the ref counts.
"""

from __future__ import annotations

from _common import chapter, explain, section

from minicb.block_manager import BlockManager

NUM_BLOCKS, BLOCK_SIZE = 8, 4


def picture(bm: BlockManager) -> None:
    """The pool, block by block: which request holds it (or '.' for free)."""
    owner = {b: rid for rid, table in bm.block_tables.items() for b in table}
    cells = " ".join(f"{b}:{owner.get(b, '.'):<2}" for b in range(bm.num_blocks))
    print(f"  pool   {cells}")
    for rid, table in bm.block_tables.items():
        print(f"  table  {rid}: {table}")
    print(f"  free list: {bm.device.free_blocks()}   ({bm.num_free_blocks} of {bm.num_blocks} free)")


def main() -> None:
    chapter(4, "paged KV and the block manager")
    explain(f"""
        A pool of {NUM_BLOCKS} blocks of {BLOCK_SIZE} token positions each. Position p of a request
        lives in block table[p // {BLOCK_SIZE}] at offset p % {BLOCK_SIZE}; the flat KV "slot" the
        model writes is table[p // {BLOCK_SIZE}] * {BLOCK_SIZE} + p % {BLOCK_SIZE} (slot_mapping).
    """)
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)

    section("1. admit A (10-token prompt) and B (5-token prompt)")
    print(f"allocate('A', 10) -> new blocks {bm.allocate('A', 10)}")
    print(f"allocate('B', 5)  -> new blocks {bm.allocate('B', 5)}")
    picture(bm)

    section("2. A decodes: a new block only when the last one is full")
    for n in (11, 12, 13):
        new = bm.allocate("A", n)
        print(f"allocate('A', {n}) -> new blocks {new}")
    picture(bm)
    print(f"  A holds {len(bm.block_table('A'))} blocks for 13 tokens: at most one block partly filled")
    table = bm.block_table("A")
    slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(13)]
    print(f"  A's slot_mapping for positions 0..12: {slots}")
    print("  (positions 12.. live in block 5: the table, not the position, says where K/V is stored)")

    section("3. B finishes: its blocks return at once; C (7 tokens) takes the lowest free ones")
    print(f"free('B') -> {bm.free('B')} blocks returned")
    print(f"  free list: {bm.device.free_blocks()}")
    print(f"can_allocate('C', 7) = {bm.can_allocate('C', 7)}")
    print(f"allocate('C', 7)  -> new blocks {bm.allocate('C', 7)}")
    picture(bm)
    print(f"can_allocate('D', 16) = {bm.can_allocate('D', 16)}   (needs 4 blocks, "
          f"{bm.num_free_blocks} free): admission would stop here")
    bm.check_integrity()
    print("check_integrity(): free + held == total, ref counts == tables naming each block  OK")

    section("4. why pages: reserving up front versus growing on demand")
    explain("""
        A padded static cache reserves prompt + max_tokens positions per request before the first step,
        because it cannot grow a row later. Three requests with 8-token prompts and max_tokens=120 that
        end after 10, 30 and 120 tokens:
    """)
    lens = [8 + 10, 8 + 30, 8 + 120]
    reserved = 3 * (8 + 120)
    paged = sum(BlockManager(64, 16).blocks_needed(n) * 16 for n in lens)
    print(f"  reserved up front (contiguous rows): {reserved} token positions")
    print(f"  paged, block_size 16, at each request's end: {paged} token positions "
          f"({100 * (1 - paged / reserved):.0f}% less)")
    explain("""
        The blocks a request does not need yet stay free for others, so more requests fit at once.
        The price: a request may need a block that is not there. Chapter 07 (preemption) is what the
        scheduler does then.
    """)


if __name__ == "__main__":
    main()
