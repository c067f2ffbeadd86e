"""minicb's int8-activation products (``int8_gemm``, ``MINICB_INT8_PRODUCTS=1``) beside its bfloat16 ones.

    python bench/int8_product.py              # one thread, best of 5, about 20 s
    python bench/int8_product.py --repeats 9
    python bench/int8_product.py --avx2       # both kernels built without AVX-512: a Zen 2's loops

The bfloat16 products run at 96% of ``vdpbf16ps``'s peak (``bench/cpu_ceilings.py``); ``vpdpbusd``'s
peak is twice that. This times ``int8_gemm.matmul`` (int8-rounded activations x the GGUF's Q4_1 blocks)
and ``skinny_gemm.matmul`` (bfloat16 panels of the same weights) on SmolLM2's qkv, gate/up and down
shapes (``[rows, 576] x [576, 960]``, ``[576, 3072]``, ``[1536, 576]``) at 1 to 256 rows, one thread,
random weights that stay in the caches: microseconds a call and the bfloat16 time over the int8 one.
Each int8 product is first checked against ``int8_gemm.reference`` (float64) to one bfloat16
rounding. Prints ``lscpu``'s model and flags first. ``--avx2`` builds both with ``-mno-avx512f``: the
loops a CPU without AVX-512 runs (``vpmaddubsw`` for int8, bfloat16 widened to float32), timed here.

What the int8 products do to the model's tokens: ``python bench/agreement.py --dtypes bfloat16 --modes
fast,int8``.
"""

from __future__ import annotations

import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import one_thread_repeats  # noqa: E402

from minicb.fastpaths import int8_gemm, skinny_gemm  # noqa: E402

SHAPES = ((576, 960), (576, 3072), (1536, 576))       # (in, out): qkv, gate/up, down
ROWS = (1, 4, 16, 64, 256)


def best(fn, repeats: int, calls: int) -> float:
    """The best of ``repeats`` timings of ``calls`` calls, per call, in seconds."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls)
    return min(times)


def compare(rows: int, in_f: int, out_f: int, repeats: int, flags: tuple[str, ...] = ()) -> dict:
    """One shape: the int8 product's largest error against float64 (relative to the output, beyond
    float32's rounding of the terms where they cancel) and both products' best time per call;
    ``flags``: both kernels built with them."""
    libs = int8_gemm.load(flags), skinny_gemm.load(flags)
    blocks, x = int8_gemm.random_q4_1(out_f, in_f), torch.randn(rows, in_f).to(torch.bfloat16)
    packed, panels = int8_gemm.pack(blocks), skinny_gemm.pack(skinny_gemm.blocks_weight(blocks))
    y, want = int8_gemm.matmul(x, packed, in_f, out_f, libs[0]).double(), int8_gemm.reference(x, blocks)
    slack = int8_gemm.reference(x, blocks, magnitudes=True) * 2.0 ** -18
    err = float((((y - want).abs() - slack).clamp_min(0) / want.abs().clamp_min(1e-30)).max())
    calls = max(1, 2000 // rows)
    return {"rows": rows, "in": in_f, "out": out_f, "err": err,
            "int8_s": best(lambda: int8_gemm.matmul(x, packed, in_f, out_f, libs[0]), repeats, calls),
            "bf16_s": best(lambda: skinny_gemm.matmul(x, panels, in_f, out_f, libs[1]), repeats, calls)}


def main() -> None:
    args = one_thread_repeats(__doc__, "timings", lambda ap: ap.add_argument(
        "--avx2", action="store_true", help="both kernels built with -mno-avx512f"))
    repeats, flags = args.repeats, ("-mno-avx512f",) if args.avx2 else ()
    loop = int8_gemm.PATH_NAMES[int8_gemm.path(int8_gemm.load(flags))]
    bf16 = skinny_gemm.PATH_NAMES[torch.bfloat16][skinny_gemm.path(torch.bfloat16, skinny_gemm.load(flags))]
    print(f"int8 kernel: {loop}; bfloat16 kernel: {bf16}" + (" (built -mno-avx512f)" if flags else ""))
    print(f"{'rows':>5} {'[in, out]':>12} {'int8 us':>9} {'bf16 us':>9} {'bf16 / int8':>11}  int8 vs float64")
    for rows in ROWS:
        for in_f, out_f in SHAPES:
            r = compare(rows, in_f, out_f, repeats, flags)
            print(f"{rows:>5} {f'[{in_f}, {out_f}]':>12} {r['int8_s'] * 1e6:>9.1f} {r['bf16_s'] * 1e6:>9.1f} "
                  f"{r['bf16_s'] / r['int8_s']:>10.2f}x  {r['err']:.1e}", flush=True)


if __name__ == "__main__":
    main()
