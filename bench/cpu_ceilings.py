"""The two ceilings of a step on one core: the core's multiply-add peak (float32, and bfloat16 where the
CPU has AVX-512 BF16) and what it reads from memory, measured bare, beside what minicb's kernels reach.

    python bench/cpu_ceilings.py            # one thread, best of 5 repeats each, about 20 s
    python bench/cpu_ceilings.py --repeats 9

Prints ``lscpu``'s model and flags first, then:

* **FMA peak**: 12 independent chains of the widest fused multiply-add the CPU has, in registers
  (``cpu_ceilings.c``, built like minicb's kernels with ``-march=native``), GFLOP/s. Beside it, the
  float32 skinny product (``minicb.fastpaths.skinny_gemm``) on SmolLM2's q/k/v shape, 256 rows, its
  weights in the caches: how close the products minicb spends most of a float32 step in come to it.
* **vdpbf16ps peak** (CPUs with AVX-512 BF16): the same with the bfloat16 pair dot product the bfloat16
  products are made of (64 FLOPs an instruction), beside the bfloat16 skinny product on the same shape.
* **vpdpbusd peak** (CPUs with AVX-512 VNNI, beside the bfloat16 line): the int8 byte dot product (64
  byte products, 128 ops an instruction) an int8 product path would be made of, and its ratio to the
  vdpbf16ps peak: the most such a path could gain on products that already run at that peak.
* **Reading memory**: GB/s of reading a 2 GiB buffer in chunks, one after another (1 MiB chunks) and at
  random places (12 KiB chunks: one 16-token block of one layer's float32 keys in SmolLM2's cache),
  the latter with and without asking for the chunk 4 ahead (``prefetcht1``) while reading this one. A
  decode step reads its KV cache the random way; ``bench/decode_kernel.py`` prints the kernel's rate in
  keys/s (a key is 1.5 KiB of float32 K and V): times 1.5 KiB, it compares with these.

A one-off measurement of the machine as it is now: on a shared host both ceilings move with the
neighbours (the other hyperthread of the core, other tenants' memory traffic).
"""

from __future__ import annotations

import ctypes
import math
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import one_thread_repeats  # noqa: E402

from minicb.fastpaths import ckernels, skinny_gemm  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent


def probe() -> ctypes.CDLL:
    lib = ckernels.open_library(ckernels.build(HERE / "cpu_ceilings.c"), "bench/cpu_ceilings.c")
    lib.fma_seconds.argtypes, lib.fma_seconds.restype = [ctypes.c_int64], ctypes.c_double
    lib.fma_lanes.restype = ctypes.c_int
    lib.dot_bf16_seconds.argtypes, lib.dot_bf16_seconds.restype = [ctypes.c_int64], ctypes.c_double
    lib.dot_u8s8_seconds.argtypes, lib.dot_u8s8_seconds.restype = [ctypes.c_int64], ctypes.c_double
    lib.read_gbps.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                              ctypes.c_int64, ctypes.c_uint64, ctypes.POINTER(ctypes.c_double)]
    lib.read_gbps.restype = ctypes.c_double
    return lib


def fma_peak(lib: ctypes.CDLL, repeats: int) -> float:
    lanes, n = lib.fma_lanes(), 20_000_000
    if lanes == 0:
        return float("nan")
    return max(24 * lanes * n / lib.fma_seconds(n) for _ in range(repeats)) / 1e9


def dot_bf16_peak(lib: ctypes.CDLL, repeats: int) -> float:
    """GFLOP/s of 12 chains of vdpbf16ps (64 FLOPs each), or nan where the build has none."""
    n = 20_000_000
    if lib.dot_bf16_seconds(1) < 0:
        return float("nan")
    return max(12 * 64 * n / lib.dot_bf16_seconds(n) for _ in range(repeats)) / 1e9


def dot_u8s8_peak(lib: ctypes.CDLL, repeats: int) -> float:
    """Giga integer ops/s of 12 chains of vpdpbusd (128 ops each), or nan where the build has none."""
    n = 20_000_000
    if lib.dot_u8s8_seconds(1) < 0:
        return float("nan")
    return max(12 * 128 * n / lib.dot_u8s8_seconds(n) for _ in range(repeats)) / 1e9


def skinny_rate(repeats: int, rows: int = 256, in_f: int = 576, out_f: int = 960,
                dtype: torch.dtype = torch.float32) -> float:
    """The skinny kernel's best GFLOP/s on a ``[rows, in_f] x [in_f, out_f]`` product, weights cached."""
    panels = skinny_gemm.pack(torch.randn(out_f, in_f).to(dtype))
    x = torch.randn(rows, in_f).to(dtype)
    skinny_gemm.matmul(x, panels, in_f, out_f)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(10):
            skinny_gemm.matmul(x, panels, in_f, out_f)
        best = min(best, (time.perf_counter() - t0) / 10)
    return 2 * rows * in_f * out_f / best / 1e9


def read_rate(lib: ctypes.CDLL, buf: torch.Tensor, chunk: int, random: bool, ahead: int,
              repeats: int) -> float:
    chunks = (1 << 30) // chunk                      # 1 GiB read per repeat
    sink = ctypes.c_double()
    return max(lib.read_gbps(buf.data_ptr(), buf.numel(), chunk, chunks, int(random), ahead, 1 + r,
                             ctypes.byref(sink)) for r in range(repeats))


def main() -> None:
    repeats = one_thread_repeats(__doc__)
    lib = probe()
    peak = fma_peak(lib, repeats)
    lanes = lib.fma_lanes()
    print(f"FMA peak ({lanes * 32}-bit vectors, 12 chains): {peak:6.1f} GFLOP/s float32")
    rate = skinny_rate(repeats)
    print(f"skinny float32 product [256, 576] x [576, 960], weights cached: {rate:6.1f} GFLOP/s "
          f"({rate / peak:.0%} of the peak)")
    dot = dot_bf16_peak(lib, repeats)
    if not math.isnan(dot):                           # the CPU has AVX-512 BF16
        print(f"vdpbf16ps peak (512-bit vectors, 12 chains): {dot:6.1f} GFLOP/s bfloat16")
        rate = skinny_rate(repeats, dtype=torch.bfloat16)
        print(f"skinny bfloat16 product [256, 576] x [576, 960], weights cached: {rate:6.1f} GFLOP/s "
              f"({rate / dot:.0%} of the peak)")
        int8 = dot_u8s8_peak(lib, repeats)
        if not math.isnan(int8):                      # and AVX-512 VNNI: what an int8 path could reach
            print(f"vpdpbusd peak (512-bit vectors, 12 chains): {int8:6.1f} Gop/s int8 "
                  f"({int8 / dot:.2f}x the vdpbf16ps peak)")
    buf = torch.ones(2 << 30, dtype=torch.uint8)     # 2 GiB: far more than any cache
    for label, chunk, random, ahead in (("1 MiB chunks, one after another", 1 << 20, False, 0),
                                        ("12 KiB chunks at random, no prefetch", 12 << 10, True, 0),
                                        ("12 KiB chunks at random, 4 ahead asked for", 12 << 10, True, 4)):
        print(f"reading {label:<44} {read_rate(lib, buf, chunk, random, ahead, repeats):6.1f} GB/s")


if __name__ == "__main__":
    main()
