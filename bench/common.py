"""Helpers shared by the benchmarks: the model, the machine's matmul ceiling and a small timing loop."""

from __future__ import annotations

import platform
import statistics
import time

import torch

from minicb.measure import bench_cli
from minicb.model.llama import LlamaForCausalLM
from minicb.model.weights.loader import load_model


def matmul_ceiling_gflops(n: int = 2048, repeats: int = 5) -> float:
    """The machine's measured float32 matmul throughput (GFLOP/s), best of ``repeats`` n x n products
    (``minicb bench``'s measurement, with a larger matrix)."""
    return bench_cli.matmul_ceiling_gflops(n, repeats)


def load_smollm2(dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """The installed SmolLM2-135M as minicb's model, weights in ``dtype``."""
    loaded = load_model(None, dtype=dtype)
    return LlamaForCausalLM.from_state_dict(loaded.config, loaded.state_dict, dtype)


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
