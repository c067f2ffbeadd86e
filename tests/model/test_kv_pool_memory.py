"""The KV pool's host memory (``host_memory.lazy_zeros``): zeros, mapped lazily (checked in
``/proc/self/smaps``)."""

from __future__ import annotations

import sys

import pytest
import torch

from minicb.model.host_memory import lazy_zeros


# --- the KV pool -------------------------------------------------------------------------------------
def _mapping_of(address: int) -> dict[str, str]:
    """The ``/proc/self/smaps`` entry holding ``address``."""
    entry, found = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:            # a new mapping: "start-end perms ..."
                if found:
                    break
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= address < hi
                entry = {"range": head}
            elif found:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
    assert found, hex(address)
    return entry


def test_lazy_zeros_are_zeros_of_the_asked_shape_and_writable():
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        t = lazy_zeros((3, 2, 5, 4), dtype, "cpu")
        assert t.shape == (3, 2, 5, 4) and t.dtype == dtype and t.is_contiguous()
        assert torch.equal(t, torch.zeros_like(t))
        t[1, 0, 2] = 7
        assert float(t.sum()) == 28 and int((t != 0).sum()) == 4
    assert lazy_zeros((0, 4), torch.float32, "cpu").shape == (0, 4)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")
def test_the_pool_is_mapped_lazily():
    t = lazy_zeros((64, 1 << 20), torch.float32, "cpu")              # 256 MiB
    m = _mapping_of(t.data_ptr())
    assert int(m["Rss"].split()[0]) < 4096, m["Rss"]                  # nothing committed yet (kB)
    t[:4].fill_(1.0)                                                  # 16 MiB written
    rss = int(_mapping_of(t.data_ptr())["Rss"].split()[0])
    assert 16 * 1024 <= rss < 64 * 1024, rss
