"""What a product on int8 activations and the GGUF's 4-bit weights would reach, beside the bfloat16 one.

    python bench/int8_product.py              # one thread, best of 5, about 10 s
    python bench/int8_product.py --repeats 9

W2's products run at 96% of the ``vdpbf16ps`` peak (``bench/cpu_ceilings.py``), and ``vpdpbusd``'s peak is
twice that; ``int8_product.c`` says what a product made of it costs per block of 32 inputs (the integer
sum, then a convert, a multiply and two multiply-adds for the Q4_1 scales). This script builds it, checks
it against the same sums in float64 (numpy), and times it on SmolLM2's q/k/v shape (``[rows, 576] x
[576, 960]``, weights in the caches) at 64 rows (a W2 decode step) and 256 (a prompt chunk's run),
beside ``skinny_gemm``'s bfloat16 product on the same shape: GFLOP/s counted as 2 x rows x in x out for
both, and the ratio. Prints ``lscpu``'s model and flags first. A CPU without AVX-512 VNNI gets one line
saying so.

The int8 path changes the model's numbers (activations rounded to 8 bits per 32 inputs), so a faster
product here is a ceiling for a path that would also need its agreement measured; nothing in minicb
uses this kernel.
"""

from __future__ import annotations

import ctypes
import pathlib
import sys

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import one_thread_repeats  # noqa: E402
from cpu_ceilings import skinny_rate  # noqa: E402

from minicb.fastpaths import ckernels  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent


def load() -> ctypes.CDLL:
    lib = ckernels.open_library(ckernels.build(HERE / "int8_product.c"), "bench/int8_product.c")
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.int8_product.argtypes = [ptr] * 7 + [i64] * 3
    lib.int8_product.restype = ctypes.c_int
    lib.int8_product_seconds.argtypes = [ptr] * 7 + [i64] * 3 + [ctypes.c_int]
    lib.int8_product_seconds.restype = ctypes.c_double
    return lib


def operands(rows: int, in_f: int, out_f: int, seed: int = 0) -> dict:
    """Random Q4_1-style weights and byte-rounded activations, in numpy, plain and in the C layout."""
    rng = np.random.default_rng(seed)
    nb = in_f // 32
    q = rng.integers(0, 16, size=(out_f, nb, 32), dtype=np.uint8)
    d = rng.uniform(0.001, 0.02, size=(out_f, nb)).astype(np.float32)
    m = rng.uniform(-0.1, 0.0, size=(out_f, nb)).astype(np.float32)
    x = rng.standard_normal((rows, nb, 32)).astype(np.float32)
    s = (np.abs(x).max(axis=2) / 127).astype(np.float32)
    p = np.round(x / s[..., None]).astype(np.int8)
    psum = (s * p.astype(np.int32).sum(axis=2)).astype(np.float32)
    panels = out_f // 64
    # [panel, block, group of 4 inputs, vector, output of the vector, input of the group]
    wq = q.reshape(panels, 4, 16, nb, 8, 4).transpose(0, 3, 4, 1, 2, 5)
    wd = d.reshape(panels, 64, nb).transpose(0, 2, 1)
    wm = m.reshape(panels, 64, nb).transpose(0, 2, 1)
    return {"q": q, "d": d, "m": m, "p": p, "s": s, "psum": psum, "nb": nb,
            "c": [np.ascontiguousarray(a) for a in (wq, wd, wm, p, s, psum)]}


def reference(o: dict) -> np.ndarray:
    """The same block sums in float64: d s (q . p) + m (s sum p), summed over the blocks."""
    dots = np.einsum("onk,rnk->ron", o["q"].astype(np.float64), o["p"].astype(np.float64))
    return (dots * o["d"][None].astype(np.float64) * o["s"][:, None].astype(np.float64)
            + o["m"][None].astype(np.float64) * o["psum"][:, None].astype(np.float64)).sum(axis=2)


def run(lib: ctypes.CDLL, o: dict, rows: int, out_f: int, repeats: int = 0) -> tuple[np.ndarray, float]:
    """(y, best seconds of one call over ``repeats`` timings of 10 calls; 0 without timing)."""
    y = np.zeros((rows, out_f), dtype=np.float32)
    args = [a.ctypes.data for a in o["c"]] + [y.ctypes.data, rows, o["nb"], out_f]
    if lib.int8_product(*args) != 0:
        raise RuntimeError("this build has no AVX-512 VNNI")
    best = min((lib.int8_product_seconds(*args, 10) / 10 for _ in range(repeats)), default=0.0)
    return y, best


def main() -> None:
    repeats = one_thread_repeats(__doc__, "timings")
    lib, in_f, out_f = load(), 576, 960
    for rows in (64, 256):
        o = operands(rows, in_f, out_f)
        try:
            y, t = run(lib, o, rows, out_f, repeats)
        except RuntimeError as e:
            print(f"int8 product: {e}")
            return
        err = float(np.abs(y - reference(o)).max() / np.abs(reference(o)).max())
        int8 = 2 * rows * in_f * out_f / t / 1e9
        bf16 = skinny_rate(repeats, rows=rows, in_f=in_f, out_f=out_f, dtype=torch.bfloat16)
        print(f"[{rows}, {in_f}] x [{in_f}, {out_f}], weights cached: int8 x Q4_1 {int8:6.1f} GFLOP/s, "
              f"bfloat16 skinny {bf16:6.1f}: {int8 / bf16:.2f}x (int8 against float64 sums: {err:.1e})")


if __name__ == "__main__":
    main()
