"""The ``cpu-paged`` decode kernel alone, on a synthetic step the size of W2's decode steps.

    python bench/decode_kernel.py                         # the kernel minicb builds, float32, one thread
    python bench/decode_kernel.py --dtype bfloat16
    git show 0936cfe:src/minicb/fastpaths/csrc/paged_decode.c > /tmp/old.c
    python bench/decode_kernel.py --compare /tmp/old.c --compare-flags=-ffp-contract=off   # beside another

The step: 64 decode rows with contexts drawn uniformly from 60-259 keys (about 10,700 keys in all;
W2's steps run 18-64 rows of 60-300), their 16-slot blocks drawn at random from SmolLM2's default
pool (2,912 blocks), SmolLM2's heads (9 query heads sharing 3 KV heads of 64). Each round calls the
kernel once per layer for 30 layers, each layer's cache a separate region of the pool, so keys and
values come from memory as in a real step rather than from the core's caches. The kernels run
alternately, round by round (a slow spell of the shared machine hits both); the figures are the median
and the best round, in milliseconds per call and millions of keys per second (a key: 9 query heads'
scores and weighted values), and the largest difference between the kernels' outputs.

``--compare SOURCE`` builds another C file with the same entry points (an older ``paged_decode.c``)
with ``ckernels.FLAGS`` plus ``--compare-flags`` (default: the flags minicb's kernel is built with).
The kernel's portable loops beside its AVX2 path, from the same file::

    python bench/decode_kernel.py --compare src/minicb/fastpaths/csrc/paged_decode.c \
        --compare-flags="-ffp-contract=fast -fno-trapping-math -DDECODE_AVX2=0"

``--resident`` times the arithmetic alone: every row reads the same 8 blocks (128 keys, 192 KB of
float32 keys and values, which stay in the core's L2), so nothing waits for memory.

``--prompts`` times one prompt's attention (SmolLM2's heads, 16 to 2,048 tokens, nothing cached
before it) three ways, alternately: what the reference backend runs for it (``grouped_sdpa``:
PyTorch's SDPA with the causal mask folded once, on the prompt's own K/V), the decode kernel with
every prompt token a row whose context ends at itself (``rows``: what ``cpu-paged`` did before the
prompt kernel), and the prompt kernel (``tiles``: ``paged_prompt``, what ``cpu-paged`` does where
``prompts_on_kernel``); milliseconds per call (median, and the range over the rounds), GFLOP/s
(4 L (L + 1) / 2 x heads x head_dim: the causal prompt's multiply-adds, counted twice for scores and
values) and the largest difference from SDPA::

    python bench/decode_kernel.py --prompts --dtype bfloat16
    python bench/decode_kernel.py --prompts --dtype bfloat16 --prompt-flags=-DF32_WEIGHTED_SUM  # and a build

``--prompt-flags=FLAGS`` adds the prompt kernel built with those extra flags as one more way (``tiles
FLAGS``): ``-DF32_WEIGHTED_SUM`` sums the weighted values in float32 where the default build uses
``vdpbf16ps`` (``paged_prompt.c``'s header).
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import shlex
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import machine_description  # noqa: E402

from minicb.fastpaths import (
    ckernels,  # noqa: E402
    cpu_paged,  # noqa: E402
)

LAYERS, NUM_BLOCKS, BLOCK, Q_HEADS, KV_HEADS, HEAD_DIM, ROWS = 30, 2912, 16, 9, 3, 64, 64


def library(source: pathlib.Path | None, flags: tuple[str, ...]) -> ctypes.CDLL:
    lib = cpu_paged.load() if source is None else ctypes.CDLL(str(ckernels.build(source, extra_flags=flags)))
    for name in cpu_paged.DTYPES.values():
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_double, ctypes.c_int]
        fn.restype = ctypes.c_int
    return lib


def prompt_case(length: int, dtype: torch.dtype, g: torch.Generator, builds: tuple = ()) -> dict:
    """One prompt of ``length`` tokens with nothing cached before it, its K/V in random blocks of a
    SmolLM2-sized pool: the ways to attend it (``builds``: the prompt kernel built with each of these
    tuples of extra flags too), as functions of nothing."""
    from minicb.model.attention import fold_mask, grouped_sdpa

    nb = -(-length // BLOCK)
    kc, vc = (torch.randn(NUM_BLOCKS * BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    blocks = torch.randperm(NUM_BLOCKS, generator=g)[:nb].to(torch.int32)
    slots = (blocks[:, None].long() * BLOCK + torch.arange(BLOCK)).flatten()[:length]
    q = torch.randn(length, Q_HEADS, HEAD_DIM, generator=g).to(dtype)
    k, v = kc[slots], vc[slots]                      # the prompt's own K/V, as SDPA reads them
    tables = blocks[None].expand(length, nb).contiguous()
    ctx = torch.arange(1, length + 1, dtype=torch.int32)
    tiles = cpu_paged.prompt_tiles([0], [length], [0], cpu_paged.tile_rows(Q_HEADS, KV_HEADS))
    i = torch.arange(length)
    mask = fold_mask((i[None, :] <= i[:, None])[None], Q_HEADS // KV_HEADS, dtype)
    # the kernels' arguments checked once, as the backend does (once a step, not once a layer)
    cpu_paged.check_decode_args(q, kc, vc, tables, ctx, BLOCK, length)
    cpu_paged.check_prompt_args(q, kc, vc, blocks[None], tiles, BLOCK)
    out = torch.empty_like(q)

    def rows():
        cpu_paged.decode_into(out, q, kc, vc, tables, ctx, BLOCK, length)
        return out

    def tiled(flags=()):
        kernel = getattr(cpu_paged.load_prompt(flags), cpu_paged.kernel_name(dtype, prompt=True))
        table = blocks[None]

        def call():
            cpu_paged.prompt_into(out, q, kc, vc, table, tiles, BLOCK, kernel=kernel)
            return out
        return call

    ways = {"sdpa": lambda: grouped_sdpa(q[None], k[None], v[None], mask)[0], "rows": rows, "tiles": tiled()}
    for flags in builds:          # the prompt kernel built with other flags, the same call
        ways[f"tiles {' '.join(flags)}"] = tiled(flags)
    return ways


def prompts(dtype: torch.dtype, rounds: int, threads: int, builds: tuple = ()) -> None:
    print(f"machine: {machine_description()}; {threads} thread(s); {dtype}; one prompt of L tokens, nothing "
          f"cached before it, {Q_HEADS} query / {KV_HEADS} kv heads of {HEAD_DIM}; ms per call and GFLOP/s, "
          f"median [range] of {rounds} rounds, the three ways alternating")
    g = torch.Generator().manual_seed(0)
    for length in (16, 64, 256, 512, 1024, 2048):
        ways = prompt_case(length, dtype, g, builds)
        times: dict[str, list[float]] = {name: [] for name in ways}
        reps = max(1, 2000 // length)
        for _ in range(rounds):
            for name, fn in ways.items():
                t = time.perf_counter()
                for _ in range(reps):
                    fn()
                times[name].append((time.perf_counter() - t) / reps)
        sdpa = ways["sdpa"]().double()      # (each way's output read before the next way runs)
        flops = 4 * length * (length + 1) / 2 * Q_HEADS * HEAD_DIM
        med = {name: statistics.median(ts) for name, ts in times.items()}
        for name, ts in times.items():
            diff = (ways[name]().double() - sdpa).abs().max().item()
            gf = [flops / t / 1e9 for t in (med[name], max(ts), min(ts))]
            print(f"  {length:5d} tokens  {name:<5} {med[name] * 1e3:9.3f} ms [{min(ts) * 1e3:.3f}-"
                  f"{max(ts) * 1e3:.3f}]  {gf[0]:6.1f} GFLOP/s [{gf[1]:.1f}-{gf[2]:.1f}]  "
                  f"max |difference from sdpa| {diff:.1e}")
        print(f"  {length:5d} tokens  tiles {med['rows'] / med['tiles']:.2f}x as fast as rows, "
              f"{med['sdpa'] / med['tiles']:.2f}x as fast as sdpa"
              + "".join(f", {med[n] / med['tiles']:.2f}x as fast as {n}" for n in med
                        if n.startswith("tiles ")))


def lp_share() -> None:
    """How much of the long-prompt workload's prefill is attention: its causal attention's flops beside
    the layers' products' (2 x SmolLM2's 106 M multiply-adds a token), at one pass over each prompt."""
    from workloads import lp

    lens = [len(p) for p in lp().prompts]
    attn = sum(4 * n * (n + 1) / 2 * Q_HEADS * HEAD_DIM * LAYERS for n in lens)
    hidden, inter, qkv = 576, 1536, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    products = 2 * LAYERS * hidden * (qkv + Q_HEADS * HEAD_DIM + 3 * inter) * sum(lens)
    print(f"LP (bench/workloads.py): {len(lens)} prompts, {sum(lens):,} tokens (longest {max(lens)}): causal "
          f"attention {attn / 1e12:.2f} TFLOP, the layers' products {products / 1e12:.2f} TFLOP")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--compare", type=pathlib.Path, help="another kernel source to time beside minicb's")
    ap.add_argument("--resident", action="store_true",
                    help="every row reads the same 8 blocks of one layer: the arithmetic without memory")
    ap.add_argument("--compare-flags", default=" ".join(cpu_paged.EXTRA_FLAGS),
                    help="extra compiler flags for --compare (default: minicb's kernel's)")
    ap.add_argument("--prompts", action="store_true",
                    help="one prompt: SDPA, the decode kernel's rows and the prompt kernel, 16-2,048 tokens")
    ap.add_argument("--prompt-flags", action="append", default=[],
                    help="with --prompts: time the prompt kernel built with these extra flags too "
                         "(e.g. -DF32_WEIGHTED_SUM; may be given again)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.prompts:
        prompts(dtype, args.rounds, args.threads, tuple(tuple(shlex.split(f)) for f in args.prompt_flags))
        lp_share()
        return
    kernels = {"minicb": library(None, ())}
    if args.compare:
        flags = tuple(shlex.split(args.compare_flags))
        label = " ".join([args.compare.name, *(f for f in flags if f not in cpu_paged.EXTRA_FLAGS)])
        kernels[label] = library(args.compare, flags)

    g = torch.Generator().manual_seed(0)
    pool = torch.empty(LAYERS, 2, NUM_BLOCKS * BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    pool.copy_(torch.randn(pool.shape, generator=g))
    if args.resident:
        ctx = torch.full((ROWS,), 8 * BLOCK, dtype=torch.int32)
        tables = torch.arange(8, dtype=torch.int32).repeat(ROWS, 1)
    else:
        ctx = torch.randint(60, 260, (ROWS,), generator=g, dtype=torch.int32)
        tables = torch.randperm(NUM_BLOCKS, generator=g)[:ROWS * -(-int(ctx.max()) // BLOCK)].to(torch.int32)
        tables = tables.view(ROWS, -1)
    max_blocks = tables.shape[1]
    q = torch.randn(ROWS, Q_HEADS, HEAD_DIM, generator=g).to(dtype)
    keys = int(ctx.sum())
    where = "the same 8 blocks for every row (resident)" if args.resident else f"a {NUM_BLOCKS}-block pool"
    print(f"machine: {machine_description()}; {args.threads} thread(s); {args.dtype}; {ROWS} rows, "
          f"{keys:,} keys, {LAYERS} layers of {where}")

    times: dict[str, list[float]] = {name: [] for name in kernels}
    outs: dict[str, torch.Tensor] = {}
    for _ in range(args.rounds):
        for name, lib in kernels.items():
            fn = getattr(lib, cpu_paged.DTYPES[dtype])
            out = torch.empty_like(q)
            t = time.perf_counter()
            for layer in range(LAYERS):
                kc, vc = pool[0 if args.resident else layer, 0], pool[0 if args.resident else layer, 1]
                fn(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), tables.data_ptr(), ctx.data_ptr(),
                   out.data_ptr(), ROWS, Q_HEADS, KV_HEADS, HEAD_DIM, max_blocks, BLOCK, int(ctx.max()),
                   HEAD_DIM ** -0.5, args.threads)
            times[name].append((time.perf_counter() - t) / LAYERS)
            outs[name] = out.double()
    ref = outs["minicb"]
    for name, ts in times.items():
        med, best = statistics.median(ts), min(ts)
        print(f"  {name:<34} median {med * 1e3:6.3f} ms per call (best {best * 1e3:6.3f}), "
              f"{keys / med / 1e6:5.2f} M keys/s; max |difference| from minicb's "
              f"{(outs[name] - ref).abs().max().item():.1e}")


if __name__ == "__main__":
    main()
