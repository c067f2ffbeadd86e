"""Unit tests of the block manager with exact block tables, ref counts and free lists."""

import pytest

from minicb.core.block_manager import BlockManager
from minicb.core.block_pool import BlockPool
from minicb.core.errors import InvalidArgument


def test_blocks_needed_is_ceil_division():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert [bm.blocks_needed(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
    assert BlockManager(8, 1).blocks_needed(7) == 7
    with pytest.raises(InvalidArgument, match="num_tokens"):
        bm.blocks_needed(-1)


def test_table_grows_exactly_when_a_block_fills():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 1) == [0]
    assert bm.allocate("a", 4) == []              # block 0 now full, no new block yet
    assert bm.allocate("a", 5) == [1]             # position 4 opens block 1
    assert bm.allocate("a", 3) == []              # tables never shrink
    assert bm.block_table("a") == [0, 1]
    assert bm.num_free_blocks == 6
    bm.check_integrity()


def test_interleaved_requests_get_lowest_blocks_and_exact_tables():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 5)                           # [0, 1]
    bm.allocate("b", 4)                           # [2]
    bm.allocate("a", 9)                           # + [3]
    bm.allocate("b", 12)                          # + [4, 5]
    assert bm.block_table("a") == [0, 1, 3]
    assert bm.block_table("b") == [2, 4, 5]
    assert bm.device.ref_counts == [1, 1, 1, 1, 1, 1, 0, 0]
    assert bm.device.free_blocks() == [6, 7]
    assert bm.free("a") == 3
    assert bm.device.free_blocks() == [0, 1, 3, 6, 7]
    assert bm.device.ref_counts == [0, 0, 1, 0, 1, 1, 0, 0]
    assert bm.allocate("c", 6) == [0, 1]          # freed blocks are reused lowest first
    assert bm.block_table("a") == []
    bm.check_integrity()


def test_can_allocate_counts_only_the_missing_blocks():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate("a", 3)                           # [0, 1]
    assert bm.can_allocate("a", 4)                # still 2 blocks
    assert bm.can_allocate("a", 6)                # needs 1 more, 1 free
    assert not bm.can_allocate("a", 7)            # needs 2 more
    assert not bm.can_allocate("b", 3)
    with pytest.raises(InvalidArgument, match="cannot allocate 2 blocks.*'b'.*only 1 free"):
        bm.allocate("b", 3)
    assert bm.block_table("b") == [] and "b" not in bm.block_tables and bm.num_free_blocks == 1
    bm.check_integrity()


def test_free_unknown_request_is_a_noop():
    bm = BlockManager(num_blocks=2, block_size=2)
    assert bm.free("nobody") == 0
    assert bm.num_free_blocks == 2
    bm.check_integrity()


def test_swap_out_and_in_with_exact_copies():
    bm = BlockManager(num_blocks=6, block_size=2, num_host_blocks=4)
    bm.allocate("a", 3)                           # [0, 1]
    bm.allocate("b", 5)                           # [2, 3, 4]
    assert bm.can_swap_out("b")
    assert bm.swap_out("b") == [(2, 0), (3, 1), (4, 2)]
    assert bm.block_table("b") == [] and bm.host_tables.get("b") == [0, 1, 2]
    assert bm.is_swapped("b") and not bm.is_swapped("a")
    assert bm.device.free_blocks() == [2, 3, 4, 5]
    assert bm.host.free_blocks() == [3]
    assert bm.host.ref_counts == [1, 1, 1, 0]
    bm.check_integrity()

    bm.allocate("c", 4)                           # [2, 3]: takes the blocks b gave back
    assert not bm.can_swap_in("b")                # 3 host blocks, 2 device free
    bm.free("c")
    assert bm.can_swap_in("b") and bm.can_swap_in("b", 8) and not bm.can_swap_in("b", 9)
    assert bm.swap_in("b") == [(0, 2), (1, 3), (2, 4)]
    assert bm.block_table("b") == [2, 3, 4] and not bm.is_swapped("b")
    assert bm.host.free_blocks() == [0, 1, 2, 3]
    bm.check_integrity()


def test_swap_limits_and_errors():
    bm = BlockManager(num_blocks=4, block_size=1, num_host_blocks=2)
    bm.allocate("a", 3)
    assert not bm.can_swap_out("a")               # 3 blocks, host holds 2
    with pytest.raises(InvalidArgument, match="swap out request 'a': it holds 3 device blocks, host has 2"):
        bm.swap_out("a")
    assert not bm.can_swap_out("nobody") and not bm.can_swap_in("a")
    with pytest.raises(InvalidArgument, match="cannot swap in request 'a'"):
        bm.swap_in("a")
    bm.allocate("b", 1)
    bm.swap_out("b")
    with pytest.raises(InvalidArgument, match="swapped out"):
        bm.allocate("b", 2)
    with pytest.raises(InvalidArgument, match="swapped out"):
        bm.can_allocate("b", 2)
    assert bm.free("b") == 1                      # frees the host copy
    assert bm.host.free_blocks() == [0, 1] and not bm.is_swapped("b")
    bm.check_integrity()


def test_no_host_pool_means_no_swap():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate("a", 1)
    assert not bm.can_swap_out("a")
    assert bm.num_free_host_blocks == 0


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_blocks=0, block_size=4), "num_blocks"),
    (dict(num_blocks=4, block_size=0), "block_size"),
    (dict(num_blocks=4, block_size=4, num_host_blocks=-1), "num_host_blocks"),
])
def test_constructor_validates(kwargs, name):
    with pytest.raises(InvalidArgument, match=name):
        BlockManager(**kwargs)


def test_check_integrity_catches_ref_count_drift_and_leaks():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 2)
    bm.device.ref_counts[0] = 2
    with pytest.raises(AssertionError, match="ref count"):
        bm.check_integrity()
    bm.device.ref_counts[0] = 1
    bm.block_tables["a"].append(3)                # named by a table but still on the free list
    with pytest.raises(AssertionError, match="both free and held"):
        bm.check_integrity()


def test_block_pool_shared_block_is_freed_by_the_last_reference():
    pool = BlockPool(3)
    b = pool.take()
    pool.ref_counts[b] += 1                       # what prefix caching will do when two tables share b
    pool.drop(b)
    assert pool.num_free == 2 and pool.ref_counts[b] == 1
    pool.drop(b)
    assert pool.free_blocks() == [0, 1, 2]
    with pytest.raises(AssertionError):
        pool.drop(b)
