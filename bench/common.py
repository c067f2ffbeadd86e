"""Helpers shared by the benchmarks: the machine's matmul ceiling and a small timing loop."""

from __future__ import annotations

import platform
import statistics
import time

import torch


def matmul_ceiling_gflops(n: int = 2048, repeats: int = 5, dtype=torch.float32) -> float:
    """The machine's measured float32 matmul throughput (GFLOP/s), best of ``repeats``."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def median_time(fn, repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine_description() -> str:
    return (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}, Python {platform.python_version()}")
