"""Weights on huge pages (``host_memory.on_huge_pages``): the same values, on a 2 MiB boundary, the
whole 2 MiB stretches advised ``MADV_HUGEPAGE`` and the tail not; when it applies, and when it must not.

What the kernel then does with the advice (``AnonHugePages``) depends on the machine's settings and
free memory, so these tests read the advice itself: the ``hg`` flag in ``/proc/self/smaps``'
``VmFlags``, which ``madvise(MADV_HUGEPAGE)`` sets whatever the kernel later makes of it."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from minicb.fastpaths import host_memory, skinny_gemm
from preconditions import unavailable
from proc_maps import mapping_of

MIB = 1 << 20


def _flags_at(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping that holds ``address``."""
    return mapping_of(address)["VmFlags"].split()


@pytest.fixture
def linux_advice(monkeypatch):
    if sys.platform != "linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        unavailable("huge-page advice is Linux's madvise(MADV_HUGEPAGE), read back from /proc/self/smaps")
    monkeypatch.setattr(host_memory, "huge_pages_enabled", lambda: True)   # whatever this kernel allows


@pytest.fixture
def small_arena(monkeypatch):
    """A fresh arena of 4 MiB stretches: a tensor over 1 MiB gets a mapping of its own."""
    monkeypatch.setattr(host_memory, "ARENA_BYTES", 4 * MIB)
    monkeypatch.setattr(host_memory, "_ARENA", host_memory._Arena())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_big_tensor_gets_its_own_mapping_on_2_mib_and_only_its_whole_stretches_are_advised(
        linux_advice, small_arena, dtype):
    t = torch.randn(5 * MIB // 4 + 3).to(dtype)           # 5 MiB and 12 bytes; in bfloat16 half that
    nbytes = t.numel() * t.element_size()
    out = host_memory.on_huge_pages(t)
    assert out.dtype == t.dtype and out.shape == t.shape and out.is_contiguous()
    assert torch.equal(out, t) and out.data_ptr() != t.data_ptr()
    start = out.data_ptr()
    assert start % host_memory.HUGE_PAGE == 0
    whole = nbytes - nbytes % host_memory.HUGE_PAGE
    assert "hg" in _flags_at(start) and "hg" in _flags_at(start + whole - 1)
    assert "hg" not in _flags_at(start + whole)                     # the tail: plain pages
    assert "hg" not in _flags_at(start + nbytes - 1)


def test_small_tensors_are_cut_back_to_back_from_advised_stretches_and_keep_their_values(
        linux_advice, small_arena):
    sizes = [1_000_000] * 5 + [100_000]          # bytes: four fill a 4 MiB stretch, the fifth starts one
    ts = [torch.randn(n // 4) for n in sizes]
    outs = [host_memory.on_huge_pages(t) for t in ts]
    starts = [o.data_ptr() for o in outs]
    step = -(-1_000_000 // host_memory.ALIGN) * host_memory.ALIGN
    assert all(s % host_memory.ALIGN == 0 for s in starts)
    assert starts[0] % host_memory.HUGE_PAGE == 0
    assert starts[1:4] == [starts[0] + k * step for k in (1, 2, 3)]
    assert starts[4] % host_memory.HUGE_PAGE == 0 and starts[4] not in range(starts[0], starts[3] + step)
    assert starts[5] == starts[4] + step
    for o, t in zip(outs, ts):
        assert "hg" in _flags_at(o.data_ptr()) and "hg" in _flags_at(o.data_ptr() + o.numel() * 4 - 1)
        assert torch.equal(o, t)                                  # nothing overwrote anything


def test_a_non_contiguous_tensor_is_copied_in_order(linux_advice):
    t = torch.arange(4 * MIB // 4 * 2, dtype=torch.float32).view(2, -1).t()   # a transposed view
    out = host_memory.on_huge_pages(t)
    assert out.is_contiguous() and torch.equal(out, t)


def test_the_skinny_kernels_panels_are_advised(linux_advice):
    w = torch.randn(960, 576)                                      # the fused q/k/v: 2.1 MiB of panels
    panels = skinny_gemm.pack(w)
    assert "hg" in _flags_at(panels.data_ptr()) and "hg" in _flags_at(panels.data_ptr() + 960 * 576 * 4 - 1)
    out_f, in_f = w.shape
    assert torch.equal(panels.permute(0, 2, 1).reshape(out_f, in_f), w)   # the layout: [panels, in, 64]


def test_small_tensors_and_refusals_leave_the_tensor_where_it_is(monkeypatch):
    small = torch.randn(host_memory.MIN_BYTES // 4 - 1)
    assert host_memory.on_huge_pages(small) is small
    big = torch.randn(4 * MIB // 4)
    monkeypatch.setattr(host_memory, "huge_pages_enabled", lambda: False)
    assert host_memory.on_huge_pages(big) is big
    transposed = big.view(2, -1).t()
    moved = host_memory.on_huge_pages(transposed)                 # still contiguous, as the kernel needs
    assert moved.is_contiguous() and torch.equal(moved, transposed)


@pytest.mark.parametrize("switch, env, expected", [
    ("always [madvise] never\n", None, True),
    ("[always] madvise never\n", None, True),
    ("always madvise [never]\n", None, False),
    ("always [madvise] never\n", "0", False),
    ("always [madvise] never\n", "1", True),
    (None, None, False),                                          # no such file: not Linux's THP
])
def test_huge_pages_are_used_where_the_kernel_allows_them_and_not_with_the_switch_off(
        monkeypatch, tmp_path, switch, env, expected):
    path = tmp_path / "enabled"
    if switch is not None:
        path.write_text(switch)
    monkeypatch.setattr(host_memory, "_THP_SWITCH", str(path))
    monkeypatch.setattr(host_memory.mmap, "MADV_HUGEPAGE", 14, raising=False)
    if env is None:
        monkeypatch.delenv("MINICB_HUGE_PAGES", raising=False)
    else:
        monkeypatch.setenv("MINICB_HUGE_PAGES", env)
    assert host_memory.huge_pages_enabled() is expected


def test_without_madv_hugepage_nothing_is_advised(monkeypatch, tmp_path):
    (tmp_path / "enabled").write_text("[always] madvise never\n")
    monkeypatch.setattr(host_memory, "_THP_SWITCH", str(tmp_path / "enabled"))
    monkeypatch.delattr(host_memory.mmap, "MADV_HUGEPAGE", raising=False)
    assert host_memory.huge_pages_enabled() is False


def test_a_refused_advice_still_gives_the_copy(monkeypatch):
    """A kernel without huge pages (or a sandbox) answers ``madvise`` with an error: the weights are
    copied all the same, onto plain pages."""
    advised = []

    class Refusing(bytearray):
        def madvise(self, *args):
            advised.append(args)
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(host_memory, "huge_pages_enabled", lambda: True)
    monkeypatch.setattr(host_memory.mmap, "mmap", lambda _fd, n, **_kw: Refusing(n))
    monkeypatch.setattr(host_memory.mmap, "MADV_HUGEPAGE", 14, raising=False)
    monkeypatch.setattr(host_memory, "_ARENA", host_memory._Arena())
    t = torch.randn(3 * MIB // 4)
    out = host_memory.on_huge_pages(t)
    assert advised and torch.equal(out, t) and out.data_ptr() != t.data_ptr()
