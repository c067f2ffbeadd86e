"""Helpers shared by the benchmarks: the model, the machine's matmul ceiling and a small timing loop."""

from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import sys
import time

import torch

# A benchmark measures the checkout it sits in, whichever copy of minicb pip's editable install points at.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "src"))

from minicb.measure import bench_cli
from minicb.model.llama import LlamaForCausalLM
from minicb.model.weights.loader import load_model


def matmul_ceiling_gflops(n: int = 2048, repeats: int = 5) -> float:
    """The machine's measured float32 matmul throughput (GFLOP/s), best of ``repeats`` n x n products
    (``minicb bench``'s measurement, with a larger matrix)."""
    return bench_cli.matmul_ceiling_gflops(n, repeats)


def load_smollm2(dtype: torch.dtype = torch.float32, gguf_blocks: dict | None = None) -> LlamaForCausalLM:
    """The installed SmolLM2-135M as minicb's model, weights in ``dtype``; ``gguf_blocks``, a dict, gets
    its quantized weights as stored (a bfloat16 load's), for ``cpu_fast_paths(..., gguf_blocks=)``."""
    loaded = load_model(None, dtype=dtype)
    if gguf_blocks is not None:
        gguf_blocks.update(loaded.gguf_blocks)
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


def cpu_model() -> str:
    """``lscpu``'s model name (from ``/proc/cpuinfo``), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_header() -> str:
    """The CPU a figure was measured on: its model and the matrix-relevant flags (every figure names it)."""
    from minicb.fastpaths.cpu_linear import cpu_flags, fast_bf16_matmul

    flags = " ".join(cpu_flags()) or "none of avx2/avx512/bf16/amx"
    return f"CPU: {cpu_model()}; flags: {flags}; oneDNN bfloat16 matmul native: {fast_bf16_matmul()}"


def one_thread_repeats(doc: str, what: str = "measurements", add=None):
    """The ``--repeats`` of a one-thread measurement script (``cpu_ceilings.py``, ``int8_product.py``):
    parses it, keeps torch on one thread and prints the machine line the figures below it belong to.
    ``add(parser)`` adds more arguments: then the parsed arguments are returned, not the count."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help=f"best of this many {what} each")
    if add:
        add(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {machine_description()}; one thread, best of {args.repeats}")
    return args if add else args.repeats


def machine_description() -> str:
    return (f"{cpu_model()} ({' '.join(_flags()) or 'no avx512/bf16/amx flags'}), "
            f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def _flags() -> list[str]:
    from minicb.fastpaths.cpu_linear import cpu_flags

    return cpu_flags()
