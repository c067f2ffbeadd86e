"""The KV pool's host memory (``kv_cache.lazy_zeros``): zeros, mapped lazily (checked in
``/proc/self/smaps``)."""

from __future__ import annotations

import sys

import pytest
import torch

from minicb.model.kv_cache import lazy_zeros
from proc_maps import mapping_of


# --- the KV pool -------------------------------------------------------------------------------------
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")
def test_the_pool_is_mapped_lazily():
    t = lazy_zeros((64, 1 << 20), torch.float32, "cpu")              # 256 MiB
    m = mapping_of(t.data_ptr())
    assert int(m["Rss"].split()[0]) < 4096, m["Rss"]                  # nothing committed yet (kB)
    t[:4].fill_(1.0)                                                  # 16 MiB written
    rss = int(mapping_of(t.data_ptr())["Rss"].split()[0])
    assert 16 * 1024 <= rss < 64 * 1024, rss
