"""``BlockManager.fork`` and ``copy_on_write`` on their own (the scheduler's use of them is
``tests/core/test_forks.py``): tables and ref counts worked out by hand, lowest free block first."""

from __future__ import annotations

import pytest

from minicb.core.block_manager import BlockManager
from minicb.core.errors import InvalidArgument


def test_fork_shares_every_block_and_the_hashing_progress():
    bm = BlockManager(6, 4, enable_caching=True)
    bm.allocate("p", 10)                                 # [0, 1, 2]; blocks 0 and 1 full
    bm.cache_full_blocks("p", list(range(10)), 10)
    assert bm.num_hashed.get("p", 0) == 2
    bm.fork("p", "c")
    assert bm.block_table("c") == [0, 1, 2] and bm.device.ref_counts[:3] == [2, 2, 2]
    assert bm.num_hashed.get("c", 0) == 2                # the child offers only blocks after those
    bm.check_integrity()


def test_fork_refuses_a_child_that_holds_blocks_and_a_parent_that_holds_none():
    bm = BlockManager(6, 4, num_host_blocks=4)
    bm.allocate("p", 5)
    bm.allocate("c", 1)
    with pytest.raises(InvalidArgument, match="already holds blocks"):
        bm.fork("p", "c")
    bm.swap_out("c")
    with pytest.raises(InvalidArgument, match="already holds blocks"):
        bm.fork("p", "c")                                # a host table counts too
    with pytest.raises(InvalidArgument, match="holds no device blocks"):
        bm.fork("nobody", "d")
    assert bm.device.ref_counts[:2] == [1, 1] and "d" not in bm.block_tables
    bm.check_integrity()


def test_copy_on_write_copies_a_shared_block_and_the_last_holder_writes_in_place():
    bm = BlockManager(5, 4)
    bm.allocate("p", 6)                                  # [0, 1], block 1 half full
    bm.fork("p", "c")
    assert bm.needs_copy("p", 6) and not bm.needs_copy("p", 8)       # position 8: a block not held
    assert bm.can_allocate("p", 7, start=6)
    assert bm.copy_on_write("p", 6) == (1, 2)
    assert bm.block_table("p") == [0, 2] and bm.device.ref_counts[:3] == [2, 1, 1]
    assert bm.copy_on_write("c", 6) is None              # alone with block 1 now: in place
    assert bm.needs_copy("c", 0)                         # block 0 is shared (full: nobody writes it)
    bm.check_integrity()


def test_copy_on_write_without_a_free_block_raises_and_changes_nothing():
    bm = BlockManager(2, 4)
    bm.allocate("p", 6)                                  # both blocks
    bm.fork("p", "c")
    assert not bm.can_allocate("p", 7, start=6)          # the copy needs a block
    with pytest.raises(InvalidArgument, match="no free device block"):
        bm.copy_on_write("p", 6)
    assert bm.block_table("p") == [0, 1] and bm.device.ref_counts == [2, 2]
    bm.check_integrity()


def test_a_new_table_may_start_with_held_blocks_and_counts_only_cached_ones_as_offered():
    bm = BlockManager(8, 4, enable_caching=True)
    bm.allocate("a", 12)                                 # [0, 1, 2]
    bm.cache_full_blocks("a", list(range(12)), 4)        # only block 0 is cached (computed so far)
    assert bm.allocate("b", 12, [0, 1]) == [3]           # 0 cached, 1 held by a (a same-step share)
    assert bm.device.ref_counts[:4] == [2, 2, 1, 1]
    assert bm.num_hashed.get("b", 0) == 1                # block 1 is offered again once computed
    bm.allocate("c", 8, [0])
    assert bm.num_hashed.get("c", 0) == 1
    with pytest.raises(InvalidArgument, match="cached or held"):
        bm.allocate("d", 8, [5])                         # a free, uncached block is not computed
    bm.check_integrity()
