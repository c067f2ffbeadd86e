"""Where a cold W2 run's time goes, by plain timers around the parts of a step (no profiler).

    python bench/step_parts.py                    # W2, LLM()'s defaults, one thread
    python bench/step_parts.py --threads 2        # the same on two threads: which parts scale
    python bench/step_parts.py --workload W1      # W1 instead (32 prompts of 16-128 tokens, 64 new each)
    python bench/step_parts.py --dtype bfloat16   # a bfloat16 model (its linears computed in float32)
    python bench/step_parts.py --reference-ops    # without the fused CPU ops (MINICB_FUSED_OPS=0)
    python bench/step_parts.py --lm-head          # the LM head alone: how much is memory traffic
    python bench/step_parts.py --pool-pages       # a fresh KV pool: plain pages against huge pages
    python bench/step_parts.py --openmp           # which OpenMP runtimes the process has loaded
    python bench/step_parts.py --scaling          # one thread against two, outside minicb

``bench/breakdown.py`` splits the time with cProfile, whose per-call overhead lands in "rest"; this
script wraps a handful of functions with ``time.perf_counter`` instead (about a microsecond per call)
and reports the wall time spent inside each: the layers' linear layers (``nn.Linear.forward``, or
``cpu_linear.Float32ComputeLinear`` for bfloat16), the LM head (packed for oneDNN or not:
``cpu_linear``), the decode kernel's C calls (``cpu_paged.decode_into``),
SDPA (prompt chunks), the KV cache writes, the SiLU, the whole model forward and the whole engine
step. "other" is the forward's time outside those parts (norms, rotary embedding, residual adds, the
attention backend's glue, Python); "step - forward" is scheduling, packing and sampling. The engine
is fresh (a cold prefix cache) and ``LLM()``'s defaults are used.

``--lm-head`` times SmolLM2's LM head (``[rows, 576] x [576, 49152]``, float32, 113 MB of weight) at
row counts from 1 to 512 (W2's decode steps have up to 64), through ``F.linear`` (MKL, which packs the
weight on every call) and through ``cpu_linear.PackedLinear`` (oneDNN, packed once), and prints
GFLOP/s and the GB/s of weight each streams, beside a plain pass over the weight (``torch.sum``): how
fast one core reads memory. At few rows MKL's per-call copy of the weight is most of its time; the
packed weight is read once per call and nothing is copied.

``--pool-pages`` writes W2's K/V (10,705 tokens, 30 layers, K and V) into a fresh SmolLM2-sized pool
(2,912 blocks of 16, float32, 2.1 GB) the way the engine does (a step's rows at a time, layer by
layer), once into ``host_memory.lazy_zeros`` (plain lazily mapped pages) and once into numpy's ``zeros``
(which asks for transparent huge pages), each in a fresh process: seconds, page faults, and the huge
pages the process ended with.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import load_smollm2, machine_description  # noqa: E402
from workloads import w1, w2  # noqa: E402

import minicb.fastpaths.cpu_linear as cpu_linear  # noqa: E402
import minicb.fastpaths.cpu_paged as cpu_paged  # noqa: E402
import minicb.model.kv_cache as kv_cache  # noqa: E402
import minicb.model.llama as llama  # noqa: E402
from minicb.core.sampling_params import SamplingParams  # noqa: E402
from minicb.entrypoints.llm import LLM, cpu_fast_paths  # noqa: E402

SECONDS: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            SECONDS[name] += time.perf_counter() - t
            CALLS[name] += 1
    return wrapper


def parts(args) -> None:
    cpu_paged.decode_into = timed("decode kernel", cpu_paged.decode_into)
    linear_classes = (cpu_linear.PackedLinear, cpu_linear.PackedProjections, cpu_linear.Float32ComputeLinear,
                      torch.nn.Linear)
    for cls in linear_classes:
        cls.forward = timed("linear", cls.forward)
    kv_cache.KVCache.write = timed("kv write", kv_cache.KVCache.write)
    F.scaled_dot_product_attention = timed("sdpa", F.scaled_dot_product_attention)
    F.silu = timed("silu", F.silu)
    llama.LlamaForCausalLM.forward = timed("forward", llama.LlamaForCausalLM.forward)
    if args.reference_ops:
        os.environ["MINICB_FUSED_OPS"] = "0"
    blocks: dict = {}                 # the GGUF's blocks, which LLM() hands the fast paths
    model = load_smollm2(getattr(torch, args.dtype), blocks)
    applied = cpu_fast_paths(model, "cpu", gguf_blocks=blocks)
    head_is_linear = isinstance(model.lm_head, linear_classes)     # then "linear" counts it too
    model.lm_head.forward = timed("lm head", model.lm_head.forward)
    wl = w1() if args.workload == "W1" else w2()
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    llm = LLM(model)
    llm.engine.step = timed("engine step", llm.engine.step)
    t, c = time.perf_counter(), time.process_time()
    llm.generate(wl.prompts, params)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    print(f"machine: {machine_description()}; {args.threads} torch thread(s); fast paths "
          f"{applied or 'none'}; load average {os.getloadavg()[0]:.2f}")
    print(f"{wl.name} ({args.dtype}): {wall:.1f} s wall, {cpu:.1f} CPU s, "
          f"{wl.num_output_tokens / wall:.1f} tokens/s")
    if head_is_linear:
        SECONDS["linear"] -= SECONDS["lm head"]
        CALLS["linear"] -= CALLS["lm head"]
    for name in ("engine step", "forward", "linear", "lm head", "decode kernel", "sdpa", "kv write", "silu"):
        print(f"  {name:<15}{SECONDS[name]:7.2f} s {CALLS[name]:7d} calls")
    inner = sum(SECONDS[n] for n in ("linear", "lm head", "decode kernel", "sdpa", "kv write", "silu"))
    print(f"  {'other':<15}{SECONDS['forward'] - inner:7.2f} s   (forward minus the parts above)")
    print(f"  {'step - forward':<15}{SECONDS['engine step'] - SECONDS['forward']:7.2f} s")


def lm_head() -> None:
    from minicb.fastpaths.cpu_linear import PackedLinear

    head = torch.nn.Linear(576, 49152, bias=False)
    with torch.no_grad():
        head.weight.normal_(0, 0.02)
    paths = {"F.linear": lambda x: F.linear(x, head.weight), "packed": PackedLinear(head)}
    print(f"machine: {machine_description()}; {torch.get_num_threads()} thread(s); SmolLM2's LM head, "
          "float32; best of 3 (ms, GFLOP/s, GB/s of weight)")
    print(f"  {'rows':>5}" + "".join(f"  {name:>24}" for name in paths) + "  speed-up")
    for rows in (1, 8, 36, 64, 128, 512):
        x = torch.randn(rows, 576)
        best = {}
        for name, fn in paths.items():
            for _ in range(2):
                fn(x)
            reps = max(3, 400 // rows)
            best[name] = min(_seconds(fn, x, reps) for _ in range(3))
        gflop = 2 * rows * head.weight.numel() / 1e9
        cells = "".join(f"  {t * 1e3:7.2f} {gflop / t:6.1f} {head.weight.numel() * 4 / t / 1e9:6.1f}  "
                        for t in best.values())
        print(f"  {rows:5d}{cells}  {best['F.linear'] / best['packed']:5.2f}x")
    with torch.inference_mode():
        stream = min(_seconds(lambda w: w.sum(), head.weight, 5) for _ in range(3))
    print(f"  for scale: one pass reading the weight (torch.sum) takes {stream * 1e3:.2f} ms, "
          f"{head.weight.numel() * 4 / stream / 1e9:.1f} GB/s")


def _seconds(fn, x, reps: int) -> float:
    t = time.perf_counter()
    with torch.inference_mode():
        for _ in range(reps):
            fn(x)
    return (time.perf_counter() - t) / reps


def scaling() -> None:
    """What a second thread gives on work with no engine around it: a prompt-sized and a decode-sized
    matmul of SmolLM2's MLP shape, and a plain read of 113 MB (the LM head's weight)."""
    print(f"machine: {machine_description()}; best of 5, torch threads 1 against 2")
    w = torch.randn(1536, 576)
    big = torch.randn(113 * 2**20 // 4)
    cases = {"matmul 2048 x 576 x 1536 (GFLOP/s)": (torch.randn(2048, 576), 2 * 2048 * 576 * 1536 / 1e9),
             "matmul   64 x 576 x 1536 (GFLOP/s)": (torch.randn(64, 576), 2 * 64 * 576 * 1536 / 1e9)}
    for name, (x, gflop) in cases.items():
        rates = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            rates.append(gflop / min(_seconds(lambda a: F.linear(a, w), x, 20) for _ in range(5)))
        print(f"  {name}  {rates[0]:7.1f}  {rates[1]:7.1f}  {rates[1] / rates[0]:5.2f}x")
    rates = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        rates.append(big.numel() * 4 / 1e9 / min(_seconds(lambda a: a.sum(), big, 5) for _ in range(5)))
    name = "read 113 MB (torch.sum, GB/s)"
    print(f"  {name:<35} {rates[0]:7.1f}  {rates[1]:7.1f}  {rates[1] / rates[0]:5.2f}x")


POOL_CHILD = """
import resource, sys, time
import numpy as np, torch
from minicb.model.kv_cache import lazy_zeros
torch.set_num_threads(1)
shape = (30, 2, 2912 * 16, 3, 64)
if sys.argv[1] == "numpy":
    pool = torch.from_numpy(np.zeros(int(np.prod(shape)) * 4, np.uint8)).view(torch.float32).view(shape)
else:
    pool = lazy_zeros(shape, torch.float32, "cpu")
rows, slot = torch.randn(82, 3, 64), 0
r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
for step in range(130):
    idx = torch.arange(slot, slot + 82)
    slot += 82
    for layer in range(30):
        for kv in range(2):
            pool[layer, kv].index_copy_(0, idx, rows)
dt, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
huge = [line.split()[1] for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages")]
faults, kernel = r1.ru_minflt - r0.ru_minflt, r1.ru_stime - r0.ru_stime
print(f"{sys.argv[1]:<11}{dt:6.2f} s{faults:>9} faults{kernel:6.2f} s in the kernel, "
      f"huge pages {huge[0] if huge else '?'} kB")
"""


def pool_pages() -> None:
    import subprocess
    print(f"machine: {machine_description()}; W2's K/V written into a fresh 2.1 GB pool")
    for kind in ("lazy_zeros", "numpy"):
        subprocess.run([sys.executable, "-c", POOL_CHILD, kind], check=True)


def openmp_runtimes() -> None:
    """Load both C libraries (decode kernel, fused ops) beside torch; print the OpenMP runtimes mapped."""
    from minicb.fastpaths import cpu_fused
    cpu_paged.load()
    cpu_fused.load()
    with open("/proc/self/maps") as f:
        libs = sorted({line.split()[-1] for line in f if "omp" in line.rsplit("/", 1)[-1]})
    print(f"torch {torch.__version__}: OpenMP runtimes mapped after loading both C libraries:")
    for lib in libs:
        print("  " + lib)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--workload", default="W2", choices=["W1", "W2"])
    ap.add_argument("--reference-ops", action="store_true", help="MINICB_FUSED_OPS=0")
    ap.add_argument("--lm-head", action="store_true", help="time the LM head alone")
    ap.add_argument("--pool-pages", action="store_true", help="a fresh KV pool: plain against huge pages")
    ap.add_argument("--openmp", action="store_true", help="the OpenMP runtimes the process has loaded")
    ap.add_argument("--scaling", action="store_true",
                    help="one thread against two on a plain matmul and a plain read: what the machine gives")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.threads == 1 and not args.scaling and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    if args.scaling:
        scaling()
    elif args.openmp:
        openmp_runtimes()
    elif args.pool_pages:
        pool_pages()
    elif args.lm_head:
        lm_head()
    else:
        parts(args)


if __name__ == "__main__":
    main()
