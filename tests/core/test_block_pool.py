"""The block pool and the block manager's own argument checks, on their own (``core/block_pool.py``,
``core/block_manager.py``).

The scheduler-level tests reach the pool only through ``BlockManager``, whose checks run first;
these call ``BlockPool`` directly, with sizes worked out by hand.
"""

from __future__ import annotations

import pytest

import minicb.core.block_pool as block_pool
from minicb.core.block_manager import BlockManager
from minicb.core.block_pool import BlockPool
from minicb.core.errors import InvalidArgument


@pytest.mark.parametrize("bad", [-1, 2.5, "4", None])
def test_a_pool_needs_a_non_negative_integer_size(bad):
    with pytest.raises(InvalidArgument, match="num_blocks"):
        BlockPool(bad)


def test_an_empty_pool_is_valid():
    assert BlockPool(0).num_free == 0


def test_a_pool_whose_tables_cannot_fit_in_memory_is_refused(monkeypatch):
    """The pool's two Python lists cost about 64 bytes a block: 100 blocks need 6,400 bytes."""
    monkeypatch.setattr(block_pool, "available_cpu_bytes", lambda: 6400)
    assert BlockPool(100).num_free == 100
    with pytest.raises(InvalidArgument, match="num_blocks=101"):
        BlockPool(101)
    with pytest.raises(InvalidArgument, match="lower num_blocks"):
        BlockManager(num_blocks=200, block_size=4)


@pytest.mark.parametrize("bad", [1, 0, "yes", None])
def test_enable_caching_must_be_a_bool(bad):
    with pytest.raises(InvalidArgument, match="enable_caching must be a bool"):
        BlockManager(num_blocks=4, block_size=4, enable_caching=bad)


def test_forget_cached_moves_every_cached_free_block_and_counts_them():
    bm = BlockManager(num_blocks=8, block_size=2, enable_caching=True)
    tokens = [1, 2, 3, 4, 5, 6, 7]                              # 3 full blocks and a partial one
    bm.allocate("a", len(tokens))
    assert bm.cache_full_blocks("a", tokens, len(tokens)) == 3
    bm.free("a")
    assert len(bm.device.cached_free_blocks()) == 3 and bm.num_free_blocks == 8
    assert bm.device.forget_cached() == 3
    assert bm.device.cached_free_blocks() == [] and bm.num_free_blocks == 8
    assert bm.device.forget_cached() == 0
    assert bm.device.free_blocks() == list(range(8))
