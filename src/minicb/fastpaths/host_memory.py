"""Host memory for the two big, long-lived kinds of tensor, and the page size each one wants.

Linux maps a process's memory in 4 KiB pages, or, where asked (``madvise(MADV_HUGEPAGE)``) and the
kernel allows it (``/sys/kernel/mm/transparent_hugepage/enabled`` says ``madvise`` or ``always``), in
2 MiB ones. Which is better depends on how the memory is written and read:

* **The KV pool** (``minicb.model.kv_cache.lazy_zeros``, beside the reference cache) is sized for the
  worst case and written sparsely: each layer's K and
  V are separate regions, a few blocks of each at a time. Plain pages, mapped only when first written,
  so that an unused pool costs neither time nor memory; with huge pages the first write into each 2 MiB
  stretch makes the kernel find and zero a whole one.
* **The weights a step streams through** (``on_huge_pages``: the skinny kernel's panels) are written
  once, densely, at load, and read from start to end by every step. Huge pages: a 4 KiB page ends the
  core's hardware prefetch stream and takes a TLB entry, 135,000 of them for SmolLM2's 538 MB of
  float32 weights, far more than the TLB holds. Most of a layer's panels are smaller than a few huge
  pages, so they are cut, one after another, from 64 MiB stretches mapped for them (an arena): nothing
  is left on plain pages but the last part of a 2 MiB page of a tensor over 16 MiB, which gets a
  mapping of its own. (oneDNN's packed layers are
  opaque tensors of its own, left where oneDNN put them.) On the Zen 4 VM of ``bench/RESULTS.md``
  (``python bench/huge_pages.py``: both ways in one process, alternating): one thread read 21 GB/s
  on plain pages and 31 on huge ones, and a decode step of 1 or 4 sequences ran 1.10-1.24x faster
  with the panels on huge pages, one of 16 sequences 1.0-1.06x (its products do more arithmetic per
  weight read), in float32 and bfloat16 alike.

``MINICB_HUGE_PAGES=0`` keeps the weights on plain pages (to measure the difference). Where the
platform has no ``MADV_HUGEPAGE`` (not Linux), or the kernel says ``never``, nothing is moved.
"""

from __future__ import annotations

import functools
import mmap
import threading

import torch

from minicb.fastpaths.settings import Settings

HUGE_PAGE = 2 << 20
ARENA_BYTES = 64 << 20        # the stretch weights are cut from; a bigger tensor gets a mapping of its own
MIN_BYTES = 64 << 10          # a smaller tensor stays where it is (tests' tiny models, biases, norms)
ALIGN = 4096                  # where each tensor starts in the arena: a page, so none shares a first line
_THP_SWITCH = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_enabled(settings: Settings | None = None) -> bool:
    """Whether ``on_huge_pages`` moves weights: not with ``MINICB_HUGE_PAGES=0``, nor where the
    platform has no ``MADV_HUGEPAGE`` or the kernel's transparent huge pages are ``never``."""
    if not (settings or Settings.from_env()).huge_pages or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    return _kernel_allows(_THP_SWITCH)


@functools.cache
def _kernel_allows(switch: str) -> bool:
    """The kernel's transparent-huge-page switch, read once (a load asks for every packed layer)."""
    try:
        with open(switch) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``t`` on memory advised to be mapped in 2 MiB pages (the module
    docstring says why weights want it); ``t.contiguous()`` when it is under ``MIN_BYTES`` or
    ``huge_pages_enabled()`` says no. Values, shape and dtype are ``t``'s."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < MIN_BYTES or not huge_pages_enabled():
        return t.contiguous()
    out = _ARENA.take(nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


class _Arena:
    """Hands out page-aligned slices of 64 MiB huge-page mappings, one after another. A mapping lives as
    long as a slice of it does (each slice's tensor holds it), and the arena holds only the one it
    is cutting from: dropping a model frees its weights' stretches, all but the last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stretch: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes > ARENA_BYTES // 4:
            return _mapped(nbytes)
        with self._lock:
            if self._stretch is None or self._used + nbytes > ARENA_BYTES:
                self._stretch, self._used = _mapped(ARENA_BYTES), 0
            out = self._stretch[self._used:self._used + nbytes]
            self._used += -(-nbytes // ALIGN) * ALIGN
            return out


_ARENA = _Arena()


def _mapped(nbytes: int) -> torch.Tensor:
    """``nbytes`` of a fresh private anonymous mapping as a uint8 tensor (it keeps the mapping alive).

    The tensor starts on a 2 MiB boundary (a mapping is only 4 KiB aligned, so one huge page
    more is mapped, and the unused stretch before the start is never touched, so never committed), and
    only its whole 2 MiB stretches are advised ``MADV_HUGEPAGE``: the tail stays on plain pages, where a
    huge one would commit up to 2 MiB that nothing uses."""
    import numpy as np

    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(buf, np.uint8)
    skip = (-whole.ctypes.data) % HUGE_PAGE
    if nbytes >= HUGE_PAGE:
        try:
            buf.madvise(mmap.MADV_HUGEPAGE, skip, nbytes - nbytes % HUGE_PAGE)
        except OSError:           # a kernel built without huge pages, a sandbox that refuses: plain ones
            pass
    return torch.from_numpy(whole[skip:skip + nbytes])
